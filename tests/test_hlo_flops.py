"""`sharding.hlo.dot_flops_split`: matrix-product FLOPs with loop trips counted, conditional branches apart."""

import jax
import jax.numpy as jnp
import pytest

from sharding import hlo

TRIPS, M, K, N = 5, 8, 16, 32


def _text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_a_dot_in_a_skipped_branch_is_counted_apart_from_the_one_that_always_runs():
    def fn(x, w, v):
        def body(h, i):
            always = h @ w  # [M, N]: 2*M*K*N FLOPs per trip
            branch = jax.lax.cond(i % 2 == 0, lambda a: a @ v, lambda a: jnp.zeros((M, N), a.dtype), h)
            return h * 0.5, always + branch  # h changes: no product is loop-invariant

        return jax.lax.scan(body, x, jnp.arange(TRIPS))[1]

    x, w, v = jnp.ones((M, K)), jnp.ones((K, N)), jnp.ones((K, N))
    text = _text(fn, x, w, v)
    outside, inside = hlo.dot_flops_split(text)
    assert outside == pytest.approx(TRIPS * 2 * M * K * N)
    # Every branch on every trip (the upper bound; 3 of the 5 trips take it when run).
    assert inside == pytest.approx(TRIPS * 2 * M * K * N)
    assert hlo.dot_flops(text) == pytest.approx(outside + inside)


def test_without_conditionals_everything_is_outside():
    def fn(x, w):
        return jax.lax.scan(lambda h, _: (h * 0.5, h @ w), x, None, length=TRIPS)[1]

    outside, inside = hlo.dot_flops_split(_text(fn, jnp.ones((M, K)), jnp.ones((K, N))))
    assert (outside, inside) == (pytest.approx(TRIPS * 2 * M * K * N), 0.0)


def test_device_groups_read_mesh_axes_replica_groups_with_sub_axes_and_a_device_order():
    """XLA's mesh-axes replica groups on literal HLO lines (the forms `MeshAxesReplicaGroupList::ToString`
    prints in XLA's own tests). A sub-axis ``b:(1)2`` was read as the whole of ``b`` (groups of 4, not 2), and
    the ``@mesh<...>`` form and a mesh's own device order were not read. Each expected group is built here
    by walking the mesh coordinates, not by the reshape the reader uses."""
    line = "%ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups=mesh['a'=2,'b'=4] {'b':(1)2}, to_apply=%add"
    # device (a, b) is 4a + b; b = 2 * major + minor; a group spans the major factor of b
    expected = [[4 * a + 2 * major + minor for major in range(2)] for a in range(2) for minor in range(2)]
    assert hlo.device_groups(line.split("all-reduce", 1)[1]) == expected == [[0, 2], [1, 3], [4, 6], [5, 7]]

    listed = "replica_groups=@mesh<ooo=10>(devices=[10]8,3,7,5,4,2,6,0,1,9) {ooo:(5)2}, dimensions={0}"
    assert hlo.device_groups(listed) == [[8, 3], [7, 5], [4, 2], [6, 0], [1, 9]]  # consecutive pairs of the order

    tiled = "replica_groups=@mesh<a=2,b=4,c=4,d=2>(devices=[2,4,4,2]<=[4,16]T(1,0)) {a,b:(1)2,d}"
    order = [[row * 16 + col for row in range(4)] for col in range(16)]  # [4,16] transposed, read row-major
    flat = [i for col in order for i in col]

    def device(a, b, c, d):
        return flat[((a * 4 + b) * 4 + c) * 2 + d]

    groups = [
        [device(a, 2 * major + minor, c, d) for a in range(2) for major in range(2) for d in range(2)]
        for minor in range(2)
        for c in range(4)
    ]
    assert hlo.device_groups(tiled) == groups
    assert hlo.device_groups("replica_groups=@mesh<x=2,y=4> {y,x}") == [[0, 4, 1, 5, 2, 6, 3, 7]]
    # a mesh whose device order is printed as device_ids=(...) is not read: None, never groups of another order
    assert hlo.device_groups("replica_groups=mesh['a'=2], device_ids=(1,0) {'a'}") is None
