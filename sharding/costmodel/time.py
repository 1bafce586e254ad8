"""The clock: predicted seconds of one step on one device (`step_time`).

Compute at ``efficiency x`` the device's peak FLOP/s, the optimizer's memory traffic at the device's
memory bandwidth, and each collective by an alpha-beta model of its link class (within a host or
across hosts, `sharding.costmodel.collectives.link_classes`): ring algorithms (`Comm.wire_bytes`,
`Comm.steps`), Thakur, Rabenseifner and Gropp (IJHPCA 2005), section 4, as NCCL implements them.
`Hardware` holds what one device and its links can do; `hardware_for` reads it from a
`sharding.devices.DeviceKind`.

Units: seconds, FLOP/s, bytes/s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sharding.costmodel.collectives import Comm
from sharding.costmodel.cost import Cost


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What one device and its links can do.

    Attributes:
      peak_flops: Dense peak of the compute dtype, FLOP/s.
      memory_bytes: Device memory, bytes.
      memory_bandwidth: Bytes/s.
      intra_bandwidth: Bytes/s one device sends to a peer on its host, one direction.
      inter_bandwidth: Bytes/s one device gets of its host's network, one direction (the host's
        bandwidth over its devices).
      intra_latency: Seconds per ring step inside a host (alpha).
      inter_latency: Seconds per ring step across hosts (alpha).
      efficiency: Fraction of peak the matrix products reach (MFU of a well-tuned step).
    """

    peak_flops: float
    memory_bytes: float
    memory_bandwidth: float
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float = 5e-6
    inter_latency: float = 15e-6
    efficiency: float = 0.5


def hardware_for(kind: Any, devices_per_host: int, inter_host_bandwidth: float, efficiency: float = 0.5) -> Hardware:
    """`Hardware` from a `sharding.devices.DeviceKind` and its host.

    Alphas: about 5 us per step over NVLink/PCIe and 15 us across hosts, the small-message
    latencies nccl-tests reports for all-reduce on DGX-class systems (NCCL PERFORMANCE.md).

    Raises:
      ValueError: When the kind's figures are unknown (e.g. a detected CPU).
    """
    if not getattr(kind, "is_known", False):
        raise ValueError(f"device kind {getattr(kind, 'name', kind)!r} has unknown figures; "
                         f"describe the cluster (the run's cluster or simulate_cluster) with a known kind, e.g. h100:8")
    return Hardware(
        peak_flops=kind.peak_bf16_flops,
        memory_bytes=kind.memory_bytes,
        memory_bandwidth=kind.memory_bandwidth,
        intra_bandwidth=kind.intra_host_bandwidth,
        inter_bandwidth=inter_host_bandwidth / max(devices_per_host, 1),
        efficiency=efficiency,
    )


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step on one device.

    Attributes:
      compute: Matrix products and elementwise work at ``efficiency x peak``.
      optimizer: The update's memory traffic (read gradient, parameter, moments; write them).
      exposed_comm: Collectives on the critical path (tensor, sequence, stage).
      overlapped_comm: Collectives that can overlap compute (weight gathers, gradient reductions).
      total: ``max(compute, overlapped_comm) + exposed_comm + optimizer``.
      by_kind: Seconds per collective kind.
    """

    compute: float
    optimizer: float
    exposed_comm: float
    overlapped_comm: float
    total: float
    by_kind: dict[str, float]


def comm_seconds(comm: Comm, hw: Hardware, links: Mapping[str, str]) -> float:
    """Alpha-beta time of one collective's executions per step on the slowest link of its axes."""
    inter = any(links.get(a) == "inter" for a in comm.axes)
    bandwidth = hw.inter_bandwidth if inter else hw.intra_bandwidth
    alpha = hw.inter_latency if inter else hw.intra_latency
    return comm.count * (comm.steps() * alpha + comm.wire_bytes() / bandwidth)


def step_time(cost: Cost, hw: Hardware, links: Mapping[str, str]) -> StepTime:
    """Step time of one device from its `Cost`.

    Args:
      cost: From `estimate` or `device_cost` (``backend="gpu"``).
      hw: The device (`Hardware`).
      links: Mesh axis -> ``intra``/``inter`` (`link_classes`).

    Returns:
      The `StepTime` (seconds).
    """
    compute = cost.flops.total / (hw.peak_flops * hw.efficiency)
    optimizer = 7 * cost.memory.parameters / hw.memory_bandwidth  # read 4 arrays, write 3
    exposed = overlapped = 0.0
    by_kind: dict[str, float] = {}
    for c in cost.comms:
        seconds = comm_seconds(c, hw, links)
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + seconds
        if c.overlappable:
            overlapped += seconds
        else:
            exposed += seconds
    total = max(compute, overlapped) + exposed + optimizer
    return StepTime(compute, optimizer, exposed, overlapped, total, by_kind)
