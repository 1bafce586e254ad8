"""The cluster as hosts of devices: `Host` (devices of one kind on one host) and `Inventory` (the
hosts in global device order and the network between them).

Made by `sharding.devices.spec` (a cluster string or file) and `sharding.devices.detect` (the
running job, or simulated kinds on CPU devices). Units: FLOP/s, bytes, bytes/s (decimal prefixes).

This module imports nothing of the project but the kind table and calls no JAX at import time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sharding.devices.kinds import DEFAULT_INTER_HOST_BANDWIDTH, DeviceKind, _is_positive_int, _is_positive_number


@dataclasses.dataclass(frozen=True)
class Host:
    """One host: ``count`` devices of one kind, joined by the kind's intra-host link.

    Attributes:
        kind: Kind of every device on the host.
        count: Number of devices, > 0.
        name: Host name, unique within an inventory.

    Raises:
        ValueError: When ``count`` is not a positive integer or ``name`` is empty.
    """

    kind: DeviceKind
    count: int
    name: str

    def __post_init__(self) -> None:
        if not _is_positive_int(self.count):
            raise ValueError(f"host {self.name!r}: count must be a positive integer, got {self.count!r}")
        if not self.name:
            raise ValueError("host name must not be empty")


@dataclasses.dataclass(frozen=True)
class Inventory:
    """The cluster: hosts in global device order, and the network between them.

    Global device ``i`` is on the host whose running device count first exceeds ``i``:
    host 0 holds devices ``0 .. hosts[0].count - 1``, and so on.

    Attributes:
        hosts: The hosts, in global device order (a list is turned into a tuple).
        inter_host_bandwidth: Bytes/s one host can send to the other hosts, one
            direction, all its network adapters together (per host, not per device).

    Raises:
        ValueError: On no hosts, duplicate host names or a bandwidth that is not positive.
    """

    hosts: tuple[Host, ...]
    inter_host_bandwidth: float = DEFAULT_INTER_HOST_BANDWIDTH

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", tuple(self.hosts))
        if not self.hosts:
            raise ValueError("an inventory needs at least one host")
        names = [h.name for h in self.hosts]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate host names: {', '.join(duplicates)}")
        bw = self.inter_host_bandwidth
        if not _is_positive_number(bw):
            raise ValueError(f"inter_host_bandwidth must be a positive number of bytes/s, got {bw!r}")

    @property
    def num_devices(self) -> int:
        """Total number of devices over all hosts."""
        return sum(h.count for h in self.hosts)

    @property
    def num_hosts(self) -> int:
        """Number of hosts."""
        return len(self.hosts)

    def device_kinds(self) -> tuple[DeviceKind, ...]:
        """The kind of each global device, host by host."""
        return tuple(h.kind for h in self.hosts for _ in range(h.count))

    def device_hosts(self) -> tuple[int, ...]:
        """The host index of each global device, host by host."""
        return tuple(i for i, h in enumerate(self.hosts) for _ in range(h.count))

    @property
    def kinds_present(self) -> tuple[DeviceKind, ...]:
        """Distinct kinds, in order of first appearance."""
        seen: dict[DeviceKind, None] = {}
        for h in self.hosts:
            seen.setdefault(h.kind, None)
        return tuple(seen)

    @property
    def is_homogeneous(self) -> bool:
        """True when every device has the same kind."""
        return len(self.kinds_present) == 1

    def describe(self) -> str:
        """A fixed-width table of the hosts, their figures and the totals: one line per run of consecutive
        hosts of the same kind and size (all on the one inter-host network), named ``first..last`` with
        ``HOSTSxDEVICES`` devices, so a cluster of thousands of hosts prints a line per kind."""
        header = ("host", "kind", "devices", "bf16 TFLOP/s", "memory GiB", "mem GB/s", "intra GB/s")
        rows = [header] + [
            (
                run[0].name if len(run) == 1 else f"{run[0].name}..{run[-1].name}",
                run[0].kind.name,
                str(run[0].count) if len(run) == 1 else f"{len(run)}x{run[0].count}",
                _fmt(run[0].kind.peak_bf16_flops, 1e12),
                _fmt(run[0].kind.memory_bytes, 2**30),
                _fmt(run[0].kind.memory_bandwidth, 1e9),
                _fmt(run[0].kind.intra_host_bandwidth, 1e9),
            )
            for run in self.runs()
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(_cells(row, widths)) for row in rows]
        lines.insert(1, "-" * len(lines[0]))
        total = _total_flops(self)
        lines.append(
            f"{self.num_hosts} host(s), {self.num_devices} device(s), "
            f"total bf16 peak {_fmt(total, 1e15)} PFLOP/s, "
            f"inter-host {self.inter_host_bandwidth / 1e9:g} GB/s per host each way "
            f"({self.inter_host_bandwidth * 8 / 1e9:g} Gb/s); "
            "intra GB/s is per device, each way"
            + ("; HxD devices: H hosts of D" if len(rows) - 1 < self.num_hosts else "")
        )
        return "\n".join(lines)

    def runs(self) -> list[tuple[Host, ...]]:
        """The hosts in runs of consecutive hosts of the same kind and device count, in device order."""
        out: list[list[Host]] = []
        for h in self.hosts:
            if out and out[-1][0].kind == h.kind and out[-1][0].count == h.count:
                out[-1].append(h)
            else:
                out.append([h])
        return [tuple(run) for run in out]


def _cells(row: Sequence[str], widths: Sequence[int]) -> list[str]:
    """Left-aligns the two name columns, right-aligns the numbers."""
    return [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]


def _fmt(value: float | None, scale: float) -> str:
    if value is None:
        return "?"
    return f"{value / scale:.4g}"


def _total_flops(inventory: Inventory) -> float | None:
    if any(h.kind.peak_bf16_flops is None for h in inventory.hosts):
        return None
    return sum(h.kind.peak_bf16_flops * h.count for h in inventory.hosts)
