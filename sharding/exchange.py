"""How context-parallel attention moves keys and values over a split length: one `ContextExchange` record each.

An attention kernel's traits (`sharding.modeldesc.AttentionTraits.context_exchange`) name one of these;
the attention registry and the model (`models.attention_registry`, `models.attention`), the cost model
(`sharding.costmodel.context`: which axes carry which collective, and their bytes) and the planner
(`sharding.planner.search`) read the record, never compare its name.

* `RING`: key/value blocks passed around the ring of the length's devices (Liu et al., 2023).
* `ALL_TO_ALL`: the length split traded for a head split and back (Jacobs et al., 2023).
* `USP`: an all-to-all over the innermost length axis (``sequence``, inside a host) and a ring over the
  others (``context``, across hosts) (Fang & Zhao, 2024).
* `NONE`: a kernel that keeps the length whole exchanges nothing.

This module imports nothing of the project, and no JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

__all__ = ["ALL_TO_ALL", "EXCHANGES", "NONE", "RING", "USP", "ContextExchange", "context_exchange"]


@dataclasses.dataclass(frozen=True)
class ContextExchange:
    """One way of exchanging keys and values between the devices of a split length.

    Attributes:
      name: What a kernel's traits call it (``ring``, ``all_to_all``, ``usp``; empty for `NONE`).
      ring: Whether it passes key/value blocks around a ring (collective-permutes).
      all_to_all: Whether it trades the length split for a head split by all-to-all, so the query heads of a
        device must divide by the all-to-all's devices (KV heads are repeated up to them). With ``ring`` too,
        the all-to-all runs over the innermost length axis only and the ring over the others.
      takes_shares: Whether it runs on uneven sequence shards (``context_shares``): a ring alone, whose
        kernel masks and skips the padding; an all-to-all trades equal blocks.
    """

    name: str
    ring: bool
    all_to_all: bool
    takes_shares: bool = False

    def groups(self, mesh: Mapping[str, int], length_axes: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The mesh axes of its ring and of its all-to-all on ``mesh`` (mesh axis -> size, missing ones 1).

        A ring passes blocks around every device of the length (``length_axes``, one ring); an all-to-all
        trades heads over all of them; both together run the all-to-all over the innermost length axis (the
        rule's last, as the kernel does, `models.attention_kernels.run_usp`) and the ring over the others.
        Axes of size 1 are left out.

        Args:
          mesh: Mesh axis -> size (missing axes are 1).
          length_axes: The mesh axes the rules map ``length`` to, outermost first, sizes 1 included
            (`sharding.rules.Rules.mesh_axes`): ``context`` and ``sequence`` under every preset.

        Returns:
          ``(ring_axes, all_to_all_axes)``; both empty for `NONE`.
        """
        split = tuple(a for a in length_axes if mesh.get(a, 1) > 1)
        if self.ring and self.all_to_all:
            inner = tuple(length_axes[-1:])
            return tuple(a for a in split if a not in inner), tuple(a for a in split if a in inner)
        if self.ring:
            return split, ()
        if self.all_to_all:
            return (), split
        return (), ()


NONE = ContextExchange("", ring=False, all_to_all=False)
RING = ContextExchange("ring", ring=True, all_to_all=False, takes_shares=True)
ALL_TO_ALL = ContextExchange("all_to_all", ring=False, all_to_all=True)
USP = ContextExchange("usp", ring=True, all_to_all=True)
EXCHANGES: tuple[ContextExchange, ...] = (RING, ALL_TO_ALL, USP)
"""The exchanges of kernels that split the length (`NONE` aside)."""


def context_exchange(name: str) -> ContextExchange:
    """The record called ``name`` (`NONE` for the empty name).

    Raises:
      ValueError: When there is none, naming those there are.
    """
    for record in (NONE, *EXCHANGES):
        if record.name == name:
            return record
    raise ValueError(f"context exchange {name!r}: choose one of {', '.join(e.name for e in EXCHANGES)}")
