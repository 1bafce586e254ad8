"""How a mixture of experts' tokens reach the devices of their experts: one `ExpertDispatch` record each.

The model (`models.moe`, which binds to each record the function that performs it), the cost model
(`sharding.costmodel`: its collectives, the rows its experts compute, whether its products run over
fixed buffers) and the run report read the record that `expert_dispatch` chooses; none of them
compares a dispatch's name.

* `LOCAL`: no expert parallelism; every device runs every expert on its own tokens.
* `RING`: all-gather the tokens and their routing over ``expert``, run the local experts on every gathered
  token's copies routed to them, reduce-scatter the partial outputs back (MaxText's "ring of experts"):
  ``2 (E_p - 1) N D`` elements per device and layer.
* `ALL_TO_ALL`: with a capacity every device sends each expert a fixed buffer of ``C = ceil(cf N k / E)``
  rows, so a plain all-to-all carries the dispatch and the combine (GShard, Lepikhin et al., 2020):
  ``2 cf N k D (E_p - 1) / E_p`` elements per device and layer.

This module imports no JAX and nothing of the project but `sharding.bound`.
"""

from __future__ import annotations

import dataclasses

from sharding.bound import BindsRun

__all__ = ["ALL_TO_ALL", "DISPATCHES", "LOCAL", "RING", "ExpertDispatch", "expert_dispatch"]


@dataclasses.dataclass(frozen=True)
class ExpertDispatch(BindsRun):
    """One way of sending routed tokens to their experts and their outputs back.

    It holds the function that performs it on one device once `models.moe` has bound it
    (`sharding.bound.BindsRun`: ``record.run``, ``(x [B, T, D], experts [B, T, K], weights [B, T, K], gate, up,
    down, config, place) -> (out [B, T, D], keep [B, T, K] bool)``).

    Attributes:
      name: What it is called (reports, messages).
      report: The run report's phrase for it; ``{routing}`` is filled in (`describe`).
      collectives: The HLO collectives it issues over ``expert`` (empty: none).
      gathers_tokens: Whether each device receives every token of the devices that split the experts and
        computes all of their copies its experts can receive (the ring); False: a device computes the copies
        routed to its experts from its own tokens' buffers, or all ``k`` of its own tokens' copies.
      fixed_buffers: Whether the experts run as batched products over fixed buffers of ``C`` rows per expert
        (`jax.lax.all_to_all` needs equal blocks) rather than grouped products (`jax.lax.ragged_dot`).
    """

    what = "expert dispatch"
    bound_in = "models.moe"

    name: str
    report: str
    collectives: tuple[str, ...] = ()
    gathers_tokens: bool = False
    fixed_buffers: bool = False

    def describe(self, capacity_factor: float) -> str:
        """The run report's phrase, e.g. ``all-to-all over expert (capacity factor 1.25)``; the ring says
        ``dropless`` only without a capacity (with one it drops the copies the all-to-all would)."""
        routing = f"capacity factor {capacity_factor:g}" if capacity_factor else "dropless"
        return self.report.format(routing=routing)


LOCAL = ExpertDispatch("local", "local (no expert parallelism)")
RING = ExpertDispatch(
    "ring",
    "all-gather / reduce-scatter over expert ({routing})",
    collectives=("all-gather", "reduce-scatter"),
    gathers_tokens=True,
)
ALL_TO_ALL = ExpertDispatch(
    "all_to_all",
    "all-to-all over expert ({routing})",
    collectives=("all-to-all",),
    fixed_buffers=True,
)
DISPATCHES: tuple[ExpertDispatch, ...] = (LOCAL, RING, ALL_TO_ALL)
"""Every dispatch; `models.moe` checks on import that it can run each."""


def expert_dispatch(
    capacity_factor: float, experts_per_token: int, expert_split: int, *, splits_tokens: bool = True
) -> ExpertDispatch:
    """The dispatch a mixture of experts uses over ``expert_split`` devices.

    Without expert parallelism (``expert_split`` 1) the layer is `LOCAL`. Dropless routing uses `RING`.
    With a capacity `ALL_TO_ALL` is chosen where it moves less than the ring, i.e. when ``cf * k < E_p``,
    and only where every axis that splits the experts also splits the tokens: over an axis that does not, a
    device's fixed buffers would hold the same tokens as its peers', and the ring's gather and sum handle that
    split. Both give the same sums (the same copies are dropped).

    Args:
      capacity_factor: 0 for dropless routing, else the capacity factor cf.
      experts_per_token: k.
      expert_split: E_p, the devices that split the experts.
      splits_tokens: Whether every mesh axis that splits the experts also splits the tokens (the batch or
        the length); False sends a capacity-bound layer through `RING` too.
    """
    if expert_split <= 1:
        return LOCAL
    if splits_tokens and capacity_factor and capacity_factor * experts_per_token < expert_split:
        return ALL_TO_ALL
    return RING
