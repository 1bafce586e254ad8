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
