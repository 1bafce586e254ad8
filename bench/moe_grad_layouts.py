"""The MoE layer's gradients on expert meshes against one device, for batches the batch axes do not divide.

For each ``MESH:ROWS`` case, moe-test's MoE layer (the layer and input of ``tests/test_moe.py``: key 0 for
the weights, key 1 for a ``[8, 4, embed]`` float32 input, the first ``ROWS`` rows taken) is differentiated on
one device and on the mesh (8 simulated CPU devices), the loss ``sum(y * cos(i)) + aux + z``. Each row of the
table gives the largest relative error over the parameters, ``max |g - w| / max |w|`` per array, and the array
it comes from: the figure of issue 23 (with the unpatched layer the input's gradient is wrong wherever the
tokens stay whole over ``expert``). Deterministic: compiled numerics, not timings.

    python bench/moe_grad_layouts.py
    python bench/moe_grad_layouts.py expert=8:2 fsdp=8:4
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = ("expert=4,fsdp=2:8", "expert=4,fsdp=2:4", "expert=8:4", "expert=8:2", "fsdp=8:4", "data=2,expert=2,tensor=2:2")


def worst_error(mesh_spec: str, rows: int) -> tuple[float, str]:
    """``(error, array)``: the largest relative gradient error of the layer on ``mesh_spec`` with ``rows``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.config import get_config
    from models.moe import MoE
    from sharding.mesh import make_mesh, parse_mesh
    from sharding.parallel import UNSHARDED, Parallelism

    config = get_config("moe-test")
    graphdef, state = nnx.split(MoE(config, rngs=nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (8, 4, config.embed_dim), jnp.float32)[:rows]
    probe = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)

    def loss(state, x, par):
        y, stats = nnx.merge(graphdef, state)(x, par)
        return jnp.sum(y * probe) + stats["aux"] + stats["z"]

    par = Parallelism.of(make_mesh(parse_mesh(mesh_spec, 8)))
    grad = jax.grad(loss, argnums=(0, 1))
    want = jax.jit(lambda s, x: grad(s, x, UNSHARDED))(state, x)
    got = jax.jit(lambda s, x: grad(s, x, par))(state, x)
    errors = []
    for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got), strict=True):
        error = float(jnp.max(jnp.abs(g - w)) / jnp.maximum(jnp.max(jnp.abs(w)), 1e-30))
        errors.append((error, "input" if path[0].idx == 1 else jax.tree_util.keystr(path[1:])))
    return max(errors)


def main(argv=None) -> int:
    import jax

    cases = (argv if argv is not None else sys.argv[1:]) or list(CASES)
    print(f"jax {jax.__version__}, {jax.device_count()} devices")
    print("| mesh | rows | worst relative gradient error | array |")
    print("|---|---:|---:|---|")
    for case in cases:
        mesh_spec, _, rows = case.rpartition(":")
        if not mesh_spec or not rows.isdigit():
            print(f"error: case {case!r} is not MESH:ROWS; e.g. expert=8:2", file=sys.stderr)
            return 2
        error, array = worst_error(mesh_spec, int(rows))
        print(f"| {mesh_spec} | {rows} | {error:.2e} | {array} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
