"""Heterogeneous clusters: the data-parallel groups of a mesh and their devices' speeds.

The uneven strategy (`train.strategies.uneven`) gives each data-parallel group along ``data`` x ``fsdp``
its own count of microbatches; these helpers name the groups (in the order of the counts) and read their
speeds from the devices' datasheets (`sharding.devices.peak_flops`). Start-up calibration
(`train.setup.calibrate`) and rebalancing between steps (`train.runtime.loop`) use them too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sharding import axes as ax
from sharding.devices import kind_from_device_kind_string, peak_flops


def batch_groups(mesh) -> list[list[Any]]:
    """The data-parallel groups along ``data`` x ``fsdp`` (data-major: the order of uneven counts), each the
    devices that share its batch rows and run its one count (its ``tensor`` peers, in mesh order; one device
    on a mesh over ``data`` and ``fsdp`` only)."""
    names = list(mesh.axis_names)
    batch = [names.index(a) for a in ax.BATCH_MESH_AXES if a in names]
    order = batch + [i for i in range(len(names)) if i not in batch]
    devices = np.asarray(mesh.devices).transpose(order)
    groups = math.prod(devices.shape[: len(batch)])
    return [list(row) for row in devices.reshape(groups, -1)]


def batch_grid(mesh) -> list[Any]:
    """The first device of each data-parallel group (`batch_groups`), in the order of uneven counts."""
    return [group[0] for group in batch_groups(mesh)]


def slowest_of_groups(values: Sequence[float], groups: Sequence[Sequence[Any]], larger_is_slower: bool) -> list[float]:
    """One figure per data-parallel group from one per device (``values`` in the order of
    ``[d for g in groups for d in g]``): the slowest member's, since a group's devices meet in its tensor
    collectives after every layer and run one count.

    Args:
      values: A speed (larger_is_slower False, e.g. FLOP/s) or a time (True, e.g. seconds per microbatch).
      groups: `batch_groups`.
      larger_is_slower: Whether a larger value is slower.
    """
    out, start = [], 0
    for group in groups:
        members = values[start : start + len(group)]
        out.append(max(members) if larger_is_slower else min(members))
        start += len(group)
    return out


def compute_pools(grid: Sequence) -> list[int] | None:
    """Which devices share compute, as `sharding.balance.counts_for_speeds` takes ``pools``: CPU devices
    share their process's cores (one pool per process); accelerators are each their own (None)."""
    if not grid or grid[0].platform != "cpu":
        return None
    return [d.process_index for d in grid]


def device_speeds(mesh, simulated: Mapping[int, Any] | None = None) -> list[float]:
    """Peak FLOP/s of each data-parallel group along the batch axes (its slowest device's: the group runs
    one count), in the order of the uneven counts.

    Args:
      mesh: The `jax.sharding.Mesh`.
      simulated: ``device.id -> DeviceKind`` from `sharding.devices.simulate_inventory`.

    Raises:
      ValueError: When a device's peak is unknown (e.g. CPU without ``--simulate-cluster``).
    """
    speeds, groups = [], batch_groups(mesh)
    for device in (d for group in groups for d in group):
        peak = peak_flops(device, simulated)
        if peak is None:
            raise ValueError(
                f"--hetero-batch kinds: the peak speed of device {device.id} ({device.device_kind}) is unknown; "
                f"give --simulate-cluster (e.g. h100:4,a100:4), measure with --hetero-batch auto, or give counts "
                f"(--hetero-batch 3,3,3,3,1,1,1,1)"
            )
        speeds.append(peak)
    return slowest_of_groups(speeds, groups, larger_is_slower=False)


def group_kinds(mesh, simulated: Mapping[int, Any] | None = None) -> list[str]:
    """The kind name of each data-parallel group (`batch_groups`' order): its slowest device's (by peak
    FLOP/s), as the planner counts a group's kind (`sharding.planner`).

    Args:
      mesh: The `jax.sharding.Mesh`.
      simulated: ``device.id -> DeviceKind`` from `sharding.devices.simulate_inventory`.

    Raises:
      ValueError: When a device's kind is unknown (e.g. CPU without ``--simulate-cluster``), naming the flag.
    """
    out = []
    for group in batch_groups(mesh):
        kinds = []
        for device in group:
            kind = simulated.get(device.id) if simulated else None
            kind = kind or kind_from_device_kind_string(str(getattr(device, "device_kind", "")))
            if kind is None:
                raise ValueError(
                    f"--hetero-batch KIND=COUNT: the kind of device {device.id} ({device.device_kind}) is unknown; "
                    f"give --simulate-cluster (e.g. h100:4,a100:4) or counts per group (--hetero-batch 3,3,1,1)"
                )
            kinds.append(kind)
        out.append(min(kinds, key=lambda k: (k.peak_bf16_flops, k.name)).name)
    return out


__all__ = ["batch_grid", "batch_groups", "compute_pools", "device_speeds", "group_kinds", "slowest_of_groups"]
