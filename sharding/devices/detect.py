"""Inventories of the running job: detected from its JAX devices, or simulated.

* ``detect_inventory()``: from ``jax.devices()``, one host per process.
* ``simulate_inventory("h100:4,a100:4", jax.devices())``: pretend the simulated CPU
  devices are GPUs of the given kinds, for tests and planner dry runs.
* ``device_memory(devices)``: the memory one device may use, and where the figure comes from.

JAX is imported only inside `detect_inventory` when it is given no devices: this module calls no
JAX at import time.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from sharding.devices.inventory import Host, Inventory
from sharding.devices.kinds import DEFAULT_INTER_HOST_BANDWIDTH, DeviceKind, kind_from_device_kind_string
from sharding.devices.spec import parse_cluster


def detect_inventory(
    devices: Sequence[Any] | None = None,
    inter_host_bandwidth: float = DEFAULT_INTER_HOST_BANDWIDTH,
) -> Inventory:
    """Builds the inventory of the running JAX job.

    One host per ``process_index`` (in order of first appearance in ``devices``); a
    process whose devices are of several kinds gives one host per kind, named
    ``process<p>-<kind>``, which the planner then treats as separate hosts linked by
    the network (conservative). Kinds come from ``device_kind``; an unknown string
    (``"cpu"``) gives a kind named after it with unknown (``None``) figures and
    ``source`` saying it was detected. When ``memory_stats()["bytes_limit"]`` is
    available, it replaces ``memory_bytes`` (the smallest over the devices of that
    kind). That is the JAX allocator's limit, what this process can use, not the
    physical size: on an H200 with JAX's default preallocation (75%) it is 112.6e9
    bytes, not 141e9. CPU devices report no memory stats.

    Global device order is host by host, each host's devices in ``devices`` order; it
    equals ``devices`` order when, as JAX does, each process's devices are contiguous.

    Args:
        devices: Devices to describe; default ``jax.devices()``.
        inter_host_bandwidth: Bytes/s per host (JAX cannot see the network).

    Returns:
        The inventory.

    Raises:
        ValueError: When ``devices`` is empty.
    """
    if devices is None:
        import jax  # lazy: no JAX at import time

        devices = jax.devices()
    devices = list(devices)
    if not devices:
        raise ValueError("detect_inventory: no devices")
    kinds = _detected_kinds(devices)
    counts: dict[tuple[int, str], int] = {}  # (process, kind name) -> devices, in order
    for d, kind in zip(devices, kinds):
        key = (getattr(d, "process_index", 0), kind.name)
        counts[key] = counts.get(key, 0) + 1
    by_name = {k.name: k for k in kinds}
    processes = [p for p, _ in counts]
    hosts = tuple(
        Host(
            kind=by_name[name],
            count=count,
            name=f"process{p}" if processes.count(p) == 1 else f"process{p}-{name}",
        )
        for (p, name), count in counts.items()
    )
    return Inventory(hosts=hosts, inter_host_bandwidth=inter_host_bandwidth)


def _detected_kinds(devices: Sequence[Any]) -> list[DeviceKind]:
    """The kind of each device; devices of one kind name share one DeviceKind object."""
    kinds = []
    limits: dict[str, int] = {}
    for d in devices:
        kind_string = str(getattr(d, "device_kind", "unknown"))
        kind = kind_from_device_kind_string(kind_string) or _unknown_kind(kind_string)
        kinds.append(kind)
        limit = _bytes_limit(d)
        if limit:
            limits[kind.name] = min(limit, limits.get(kind.name, limit))
    resolved = {k.name: k for k in kinds}
    for name, limit in limits.items():
        resolved[name] = dataclasses.replace(resolved[name], memory_bytes=float(limit))
    return [resolved[k.name] for k in kinds]


def _unknown_kind(kind_string: str) -> DeviceKind:
    slug = re.sub(r"[^a-z0-9]+", "_", kind_string.lower()).strip("_") or "unknown"
    return DeviceKind(
        name=slug,
        label=kind_string,
        peak_bf16_flops=None,
        memory_bytes=None,
        memory_bandwidth=None,
        intra_host_bandwidth=None,
        source=f"detected: JAX device_kind {kind_string!r} is not in the table; figures unknown",
    )


def _bytes_limit(device: Any) -> int | None:
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory stats raise various errors
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if isinstance(limit, (int, float)) and limit > 0 else None


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The host's available memory (``MemAvailable`` of ``/proc/meminfo``), bytes; None where unreadable."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_memory(devices: Sequence[Any]) -> tuple[int | None, str]:
    """The memory one of ``devices`` (this process's) may use, bytes, and where the figure comes from.

    In order: the allocator's ``memory_stats()["bytes_limit"]`` (the smallest over the devices), the
    datasheet of the device kind (`KINDS`), or, for CPU devices, the host's ``MemAvailable`` shared
    evenly by the simulated devices of this process (they all live in its memory).

    Returns:
      ``(bytes, source)``; ``(None, reason)`` when no figure is known.
    """
    devices = list(devices)
    limits = [_bytes_limit(d) for d in devices]
    if devices and all(limits):
        return min(limits), "the allocator's bytes_limit (memory_stats)"
    kinds = [kind_from_device_kind_string(str(getattr(d, "device_kind", ""))) for d in devices]
    if devices and all(k is not None and k.memory_bytes for k in kinds):
        small = min(kinds, key=lambda k: k.memory_bytes)
        return int(small.memory_bytes), f"the {small.label} datasheet"
    cpu = [d for d in devices if getattr(d, "platform", "") == "cpu"]
    available = host_available_bytes()
    if cpu and len(cpu) == len(devices) and available:
        return available // len(cpu), (
            f"the host's available memory ({available / 2**30:.1f} GiB, /proc/meminfo) shared by {len(cpu)} CPU devices"
        )
    return None, "device memory unknown"


def simulate_inventory(spec: str, devices: Sequence[Any]) -> tuple[Inventory, dict[int, DeviceKind]]:
    """Pretends the given (simulated CPU) devices form the cluster in ``spec``.

    Each spec item is one simulated host; devices are assigned in order, device ``i``
    of ``devices`` getting the kind of the host that holds global device ``i``. Used
    by ``--simulate-cluster h100:4,a100:4`` on 8 CPU devices.

    Args:
        spec: A cluster spec, as :func:`parse_cluster` (``@BANDWIDTH`` allowed).
        devices: The devices, e.g. ``jax.devices()``.

    Returns:
        The inventory and ``device.id -> DeviceKind``.

    Raises:
        ValueError: As :func:`parse_cluster`, or when the spec's device counts do not
            sum to ``len(devices)`` (the message gives both numbers).
    """
    inventory = parse_cluster(spec)
    devices = list(devices)
    if inventory.num_devices != len(devices):
        counts = "+".join(str(h.count) for h in inventory.hosts)
        raise ValueError(
            f"simulated cluster {spec!r} has {counts} = {inventory.num_devices} devices, "
            f"but there are {len(devices)} devices to assign; make the counts sum to {len(devices)}"
        )
    assignment = {d.id: kind for d, kind in zip(devices, inventory.device_kinds())}
    return inventory, assignment
