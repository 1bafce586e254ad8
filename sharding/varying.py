"""Device variance inside `jax.shard_map`: which manual mesh axes a value varies over, and the cast that
marks it varying.

Its own module, below `sharding.parallel` and `sharding.pipeline`, because both need it: the pipeline's
relayout (`sharding.pipeline.relayout`) casts its stage rows, and `sharding.parallel` imports the pipeline
plan. `sharding.parallel` re-exports both functions. Imports JAX only when called.
"""

from __future__ import annotations

from collections.abc import Sequence


def to_varying(tree, axes: str | Sequence[str]):
    """Marks each leaf device-varying over ``axes`` (inside `jax.shard_map`), where it is not already.

    `jax.grad` with respect to a value that is invariant over a manual axis (replicated, or just
    gathered) adds a ``psum`` over that axis in the backward pass; inside a loop whose trip count
    differs per device that collective would deadlock, and inside any loop it runs once per trip.
    Cast first, the gradient stays per device and is reduced once, after the loop (docs/conventions.md, JAX pitfalls).
    """
    import jax

    axes = (axes,) if isinstance(axes, str) else tuple(axes)

    def cast(x):
        vma = varying_axes(x)
        missing = tuple(a for a in axes if a not in vma)
        if not missing:
            return x
        return jax.lax.pcast(x, missing, to="varying")

    return jax.tree.map(cast, tree)


def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes an array varies over (inside `jax.shard_map`; empty outside one)."""
    import jax

    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", frozenset())
    return frozenset(vma)
