"""Where a mixture of experts' layer sits on the mesh, and so which dispatch it runs: one decision, read by the
model (`models.moe`, which lays its `jax.shard_map` out by it), the cost model (`sharding.costmodel`: the
dispatch's collectives, the rows its experts compute) and the run report.

From the rules (`sharding.rules`), the mesh sizes and the shape of the tokens one call of the layer sees
``[batch, length]``, `expert_placement` finds:

* the mesh axes that split the experts (the routed weights' ``expert`` dimension, ``[E, D, F]``);
* those of them that also split the tokens (the activations' ``batch`` or ``length``): the ring gathers the
  tokens over them;
* the others, over which each device holds every token and the partial outputs are summed (rules that keep
  the batch whole over an axis, or a batch the axis does not divide: `sharding.rules.logical_to_spec` leaves
  such an axis out of the spec);
* the axes that split the experts' ``mlp`` (partial outputs summed there too);
* the dispatch (`sharding.dispatch.expert_dispatch`): the fixed buffers only where every axis that splits the
  experts splits the tokens.

Imports nothing of the project but `sharding.axes`, `sharding.dispatch`, `sharding.modeldesc`,
`sharding.parallel` and `sharding.rules`; JAX only when a spec is built (`sharding.rules.logical_to_spec`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from sharding import axes as ax
from sharding.dispatch import ExpertDispatch
from sharding.modeldesc import ExpertGeometry, held_copies
from sharding.parallel import spec_axes, spec_entry
from sharding.rules import Rules, logical_to_spec

__all__ = ["ExpertPlacement", "expert_placement"]


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """Where one device's share of a mixture of experts' layer sits on the mesh.

    Attributes:
      expert_axes: The mesh axes that split the experts, in the rules' order.
      gather_axes: Those of them that also split the tokens (the ring gathers the tokens over them).
      mlp_axes: The mesh axes that split the experts' ``mlp``.
      token_axes: Every mesh axis that splits the tokens (the activations' ``batch`` and ``length``).
      sizes: Mesh axis -> size, every axis the layer may split over (a manual axis counted as 1).
      num_experts: E.
      dispatch: The dispatch the layer runs (`sharding.dispatch`).
    """

    expert_axes: tuple[str, ...]
    gather_axes: tuple[str, ...]
    mlp_axes: tuple[str, ...]
    token_axes: tuple[str, ...]
    sizes: Mapping[str, int]
    num_experts: int
    dispatch: ExpertDispatch

    @property
    def sum_axes(self) -> tuple[str, ...]:
        """The mesh axes the partial outputs are summed over: those of ``expert_axes`` that do not split the
        tokens, then ``mlp_axes``."""
        return self.summed_expert_axes + self.mlp_axes

    @property
    def summed_expert_axes(self) -> tuple[str, ...]:
        """The axes that split the experts but not the tokens: every device there holds the same tokens, runs
        its experts on them and the partial outputs are summed."""
        return tuple(a for a in self.expert_axes if a not in self.gather_axes)

    @property
    def splits_tokens(self) -> bool:
        """Whether every axis that splits the experts also splits the tokens."""
        return self.gather_axes == self.expert_axes

    @property
    def split(self) -> int:
        """E_p: the devices that split the experts."""
        return self._size(self.expert_axes)

    @property
    def gather_split(self) -> int:
        """The devices whose tokens the ring gathers (1 with no gather)."""
        return self._size(self.gather_axes)

    @property
    def token_split(self) -> int:
        """The devices the tokens of one call are split over."""
        return self._size(self.token_axes)

    @property
    def local_experts(self) -> int:
        """Experts per device, E / E_p."""
        return self.num_experts // self.split

    def describe(self, capacity_factor: float) -> str:
        """The run report's phrase for the collectives the layer issues, e.g. ``all-to-all over expert (capacity
        factor 1.25)``: the dispatch's own (`sharding.dispatch.ExpertDispatch.describe`), except that the ring
        names what it does over each axis: it gathers the tokens over ``gather_axes`` only, and over the axes
        that split the experts but not the tokens every device already holds them, so the partial outputs are
        summed there (an all-reduce in the compiled layer, forward and backward)."""
        if self.dispatch.name != "ring" or self.splits_tokens:
            return self.dispatch.describe(capacity_factor)
        routing = f"capacity factor {capacity_factor:g}" if capacity_factor else "dropless"
        parts = [f"all-gather / reduce-scatter over {'+'.join(self.gather_axes)}"] if self.gather_axes else []
        parts.append(f"all-reduce over {'+'.join(self.summed_expert_axes)} (partial outputs summed)")
        return f"{'; '.join(parts)} ({routing})"

    def copies_held(self, experts_per_token: int) -> int:
        """Routed copies a device computes per token of its own: ``k`` over fixed buffers; else every token it
        holds after the gather (``gather_split`` of its own) brings the copies its ``E / E_p`` experts can receive,
        ``gather_split * min(k, E / E_p)`` (`sharding.modeldesc.held_copies`; ``k`` without expert parallelism),
        most of them for other devices' experts under the ring (rows a GPU's fixed shapes hold too, dropless)."""
        if self.dispatch.fixed_buffers:
            return experts_per_token
        return held_copies(self.gather_split, experts_per_token, self.local_experts)

    def _size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.sizes[a] for a in axes)


def expert_placement(
    experts: ExpertGeometry,
    rules: Rules,
    mesh_shape: Mapping[str, int],
    tokens_shape: tuple[int, int] | None = None,
) -> ExpertPlacement:
    """The placement of a mixture of experts' layer (module docstring) and the dispatch it runs.

    Args:
      experts: The routing and the routed weights' sizes (`sharding.modeldesc.ExpertGeometry`; its ``embed_dim``
        and ``expert_dim`` 0 take the rules' axes as dividing them).
      rules: The logical rules.
      mesh_shape: Mesh axis -> size of the axes the layer may split over (a manual axis as 1, a missing one 1);
        no axis above 1: no expert parallelism (`sharding.dispatch.LOCAL`).
      tokens_shape: ``[batch, length]`` of one call of the layer (sequences and positions, whole over the
        mesh); None takes the rules' axes as dividing them.

    Returns:
      The `ExpertPlacement`.

    Raises:
      ValueError: When the rules split the activations' embed over an axis that splits the experts or their
        ``mlp``.
      ConfigError: When two of an array's logical axes map to one mesh axis (`sharding.rules.logical_to_spec`).
    """
    sizes = {a: int(s) for a, s in mesh_shape.items()}
    d, f, e = experts.embed_dim, experts.expert_dim, experts.num_experts
    x_shape = (*tokens_shape, d) if tokens_shape is not None and d else None
    x_spec, _ = logical_to_spec((ax.BATCH, ax.LENGTH, ax.ACT_EMBED), rules, x_shape, sizes)
    weights_shape = (e, d, f) if d and f else None
    w_spec, _ = logical_to_spec((ax.EXPERT, ax.EXPERT_EMBED, ax.MLP), rules, weights_shape, sizes)
    e_spec, _ = logical_to_spec((ax.EXPERT,), rules, (e,), sizes)  # E is always known: an axis not dividing it is out
    expert_axes, mlp_axes = _axes(e_spec, 0), _axes(w_spec, 2)
    token_axes = _axes(x_spec, 0) + _axes(x_spec, 1)
    if set(_axes(x_spec, 2)) & set(expert_axes + mlp_axes):
        raise ValueError("the rules split the activations' embed over an axis that splits the experts or their mlp")
    gather_axes = tuple(a for a in expert_axes if a in token_axes)
    split = math.prod(sizes[a] for a in expert_axes)
    record = experts.dispatch(split, splits_tokens=gather_axes == expert_axes)
    return ExpertPlacement(expert_axes, gather_axes, mlp_axes, token_axes, sizes, e, record)


def _axes(spec, dim: int) -> tuple[str, ...]:
    return spec_axes(spec_entry(spec, dim))
