"""One collective: its kind, groups and bytes (`Comm`), what it costs on the wire under ring
algorithms, and which links its groups cross.

* Ring algorithms: Thakur, Rabenseifner and Gropp, "Optimization of collective communication
  operations in MPICH" (IJHPCA 2005), section 4, as NCCL implements them ("bus bandwidth" in the
  nccl-tests documentation, PERFORMANCE.md): `Comm.wire_bytes` (bytes each device sends per
  execution) and `Comm.steps` (latency terms per execution; `sharding.costmodel.time` prices them).
* The hierarchy: `link_classes`, whether a mesh axis's groups stay inside a host or cross hosts.
* `collective_bytes`: per-kind totals, for `Comm` and for `sharding.hlo.Collective` alike (the tests
  compare the two).
* `BACKENDS` and `_partitioner`: what the collectives depend on besides the layout (the backend's
  lowering, the jax version's partitioner).

Units: bytes, counts per step. Imports nothing of the project outside `sharding`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from sharding import axes as ax

BACKENDS = ("gpu", "cpu")


@dataclasses.dataclass(frozen=True)
class Comm:
    """One collective, as the compiled step runs it.

    Attributes:
      kind: ``all-gather``, ``reduce-scatter``, ``all-reduce``, ``all-to-all`` or
        ``collective-permute``.
      axes: Mesh axes of its device groups.
      group: Devices per group.
      result_bytes: Bytes of each device's result (``sharding.hlo.Collective.result_bytes``).
      count: Executions per step.
      what: What it moves (for reports).
      overlappable: Whether it can overlap compute (weight gathers and gradient reductions), or
        sits on the critical path (tensor-parallel activations, pipeline sends).
      layer_loop: Whether it runs once per layer (or block of layers) inside the layer loop, a per-layer
        FSDP weight gather or gradient reduction, which hides behind one layer's compute only
        (`sharding.costmodel.time.overlap`).
    """

    kind: str
    axes: tuple[str, ...]
    group: int
    result_bytes: float
    count: float
    what: str
    overlappable: bool = True
    layer_loop: bool = False

    @property
    def total_bytes(self) -> float:
        return self.result_bytes * self.count

    def wire_bytes(self) -> float:
        """Bytes each device sends per execution under ring algorithms (Thakur et al. 2005, section 4)."""
        n = self.group
        if n <= 1:
            return 0.0
        if self.kind == "all-gather":
            return self.result_bytes * (n - 1) / n
        if self.kind == "reduce-scatter":
            return self.result_bytes * (n - 1)
        if self.kind == "all-reduce":
            return 2.0 * self.result_bytes * (n - 1) / n
        if self.kind == "all-to-all":
            return self.result_bytes * (n - 1) / n
        return self.result_bytes  # collective-permute

    def steps(self) -> int:
        """Latency terms (ring steps) per execution."""
        n = self.group
        if n <= 1:
            return 0
        if self.kind == "all-reduce":
            return 2 * (n - 1)
        if self.kind == "collective-permute":
            return 1
        return n - 1


def collective_bytes(comms: Sequence[Comm] | Sequence[Any]) -> dict[str, float]:
    """Kind -> per-device result bytes per step (``sum(result_bytes * count)``).

    Accepts `Comm` objects or `sharding.hlo.Collective` objects (``op``, ``total_bytes``).
    """
    out: dict[str, float] = {}
    for c in comms:
        kind = getattr(c, "kind", None) or c.op
        out[kind] = out.get(kind, 0.0) + float(c.total_bytes)
    return out


def _axes(mesh: Mapping[str, int], *names: str) -> tuple[tuple[str, ...], int]:
    """The axes of ``names`` with size > 1, and their product."""
    kept = tuple(a for a in names if mesh[a] > 1)
    return kept, math.prod(mesh[a] for a in kept)


def _partitioner() -> str:
    """``"0.10"`` or ``"0.12"``: which jax's partitioner lowers the embedding lookup (they differ in
    its backward pass). jax 0.11 is assumed to behave as 0.12: not checked yet (it is installed only on
    the GPU machine)."""
    import jax

    return "0.10" if tuple(jax.__version_info__[:2]) < (0, 11) else "0.12"


def link_classes(mesh: Mapping[str, int], devices_per_host: int) -> dict[str, str]:
    """Mesh axis -> ``intra`` or ``inter``: whether its groups cross hosts.

    Devices are laid out as `sharding.mesh.split_outer_inner` does by default: the innermost axes
    (``tensor``, ``sequence``, ``fsdp``, ``stage``, ``data``) fill a host first.
    """
    inner = host_shares(mesh, devices_per_host)
    return {axis: "intra" if inner[axis] == mesh.get(axis, 1) else "inter" for axis in ax.MESH_AXES}


def host_shares(mesh: Mapping[str, int], devices_per_host: int) -> dict[str, int]:
    """Mesh axis -> how many of its positions lie inside one host (the rest span hosts), laid out as
    `link_classes` says."""
    shares, remaining = {}, devices_per_host
    for axis in reversed(ax.MESH_AXES):
        shares[axis] = math.gcd(mesh.get(axis, 1), remaining)
        remaining //= shares[axis]
    return {axis: shares[axis] for axis in ax.MESH_AXES}
