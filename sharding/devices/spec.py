"""Device inventory: what each accelerator can do and how the hosts are linked.

The base of the heterogeneous-cluster planner. It answers, for every global device,
"what kind of chip is this" (peak bf16 FLOP/s, memory, memory bandwidth, link to its
host peers) and, for the cluster, "which devices share a host" (fast links inside a
host, slow network between hosts).

Units everywhere: FLOP/s, bytes, bytes/s. Decimal prefixes: 1 GB = 1e9 bytes,
1 TB/s = 1e12 bytes/s, 1 Gb/s = 1e9 bits/s = 0.125e9 bytes/s.

Sources of an inventory:

* ``parse_cluster("h100:8,a100:8@400Gbps")``: one host per item, from a flag.
* ``load_inventory("cluster.json")``: a JSON (or YAML) file; see :func:`load_inventory`.
* ``inventory_from_flag(value)``: a path to an existing file, else a cluster spec.
* ``detect_inventory()``: from ``jax.devices()``, one host per process.
* ``simulate_inventory("h100:4,a100:4", jax.devices())``: pretend the simulated CPU
  devices are GPUs of the given kinds, for tests and planner dry runs.

Bandwidth conventions:

* ``DeviceKind.intra_host_bandwidth``: bytes/s one device can send to its peers on the
  same host, one direction (NVLink where the part has it, else PCIe). Datasheets quote
  NVLink and PCIe as the sum of both directions; the table stores half of that.
* ``Inventory.inter_host_bandwidth``: bytes/s one *host* can send to other hosts, one
  direction, through all its network adapters together. The default is one
  InfiniBand NDR port (400 Gb/s = 50e9 bytes/s). A DGX-style host with one 400 Gb/s
  adapter per GPU has 8 x 50e9 = 400e9 bytes/s; say so with ``@3200Gbps``.

This module imports nothing of the project and calls no JAX at import time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "DEFAULT_INTER_HOST_BANDWIDTH",
    "KINDS",
    "ALIASES",
    "DeviceKind",
    "Host",
    "Inventory",
    "get_kind",
    "known_kind_names",
    "kind_from_device_kind_string",
    "peak_flops",
    "parse_bandwidth",
    "parse_cluster",
    "load_inventory",
    "inventory_to_dict",
    "save_inventory",
    "inventory_from_flag",
    "detect_inventory",
    "simulate_inventory",
]

GB = 1e9  # bytes; datasheets use decimal gigabytes
TB = 1e12
TFLOPS = 1e12

#: One InfiniBand NDR port per host, 400 Gb/s per direction = 50e9 bytes/s.
#: Source: NVIDIA ConnectX-7 adapter cards user manual, "Introduction" (single-port
#: OSFP, NDR 400Gb/s), https://docs.nvidia.com/networking/display/ConnectX7VPI/Introduction
DEFAULT_INTER_HOST_BANDWIDTH = 400e9 / 8

_FIGURES = ("peak_bf16_flops", "memory_bytes", "memory_bandwidth", "intra_host_bandwidth")


def _is_positive_number(value: Any) -> bool:
    """A finite number > 0 (bools excluded)."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    """One kind of accelerator and its datasheet figures.

    Attributes:
        name: Canonical key, lower case, e.g. ``"h100_sxm"``.
        label: Human name, e.g. ``"NVIDIA H100 SXM5 80GB"``.
        peak_bf16_flops: Dense (no sparsity) bf16 tensor-core peak, FLOP/s; ``None``
            when unknown (e.g. a detected CPU).
        memory_bytes: Device memory, bytes; ``None`` when unknown.
        memory_bandwidth: Device memory bandwidth, bytes/s; ``None`` when unknown.
        intra_host_bandwidth: Bytes/s this device can send to peers on its host, one
            direction (NVLink or PCIe, see ``source``); ``None`` when unknown.
        source: Where the figures come from (document title and URL).

    Raises:
        ValueError: On an empty name or a figure that is not positive.
    """

    name: str
    label: str
    peak_bf16_flops: float | None
    memory_bytes: float | None
    memory_bandwidth: float | None
    intra_host_bandwidth: float | None
    source: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("DeviceKind.name must not be empty")
        for field in _FIGURES:
            value = getattr(self, field)
            if value is not None and not _is_positive_number(value):
                raise ValueError(
                    f"DeviceKind {self.name!r}: {field} must be a positive number or None, "
                    f"got {value!r}"
                )

    @property
    def is_known(self) -> bool:
        """True when every figure is known (not ``None``)."""
        return all(getattr(self, f) is not None for f in _FIGURES)


def _kind(name, label, tflops, memory_gb, memory_tb_s, intra_gb_s_bidirectional, source):
    """Builds a table entry from datasheet units (TFLOP/s, GB, TB/s, GB/s both ways)."""
    return DeviceKind(
        name=name,
        label=label,
        peak_bf16_flops=tflops * TFLOPS,
        memory_bytes=memory_gb * GB,
        memory_bandwidth=memory_tb_s * TB,
        intra_host_bandwidth=intra_gb_s_bidirectional * GB / 2,
        source=source,
    )


_H100_DATASHEET = (
    "NVIDIA H100 Tensor Core GPU Datasheet (H100 SXM / H100 PCIe columns), "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
)
_A100_DATASHEET = (
    "NVIDIA A100 Tensor Core GPU Datasheet, "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)

# Every peak is the datasheet's dense figure. Where the datasheet prints only the
# "with sparsity" number (Hopper), the entry divides it by 2, as the datasheet's footnote
# says ("one-half lower without sparsity"). Intra-host figures are the datasheet's
# bidirectional totals; _kind halves them.
_TABLE = (
    _kind(
        "h200_sxm", "NVIDIA H200 SXM 141GB",
        1979 / 2, 141, 4.8,
        900,  # NVLink 4: 900 GB/s total both directions -> 450e9 B/s each way
        "NVIDIA H200 Tensor Core GPU product page and datasheet (H200 SXM column), "
        "https://www.nvidia.com/en-us/data-center/h200/",
    ),
    _kind(
        "h100_sxm", "NVIDIA H100 SXM5 80GB",
        1979 / 2, 80, 3.35,
        900,  # NVLink 4: 900 GB/s total both directions -> 450e9 B/s each way
        _H100_DATASHEET,
    ),
    _kind(
        "h100_pcie", "NVIDIA H100 PCIe 80GB",
        1513 / 2, 80, 2.0,
        128,  # PCIe Gen5 x16: 128 GB/s both directions (the NVLink bridge joins pairs only)
        _H100_DATASHEET,
    ),
    _kind(
        "a100_80gb", "NVIDIA A100 SXM4 80GB",
        312, 80, 2.039,
        600,  # NVLink 3: 600 GB/s total both directions -> 300e9 B/s each way
        _A100_DATASHEET,
    ),
    _kind(
        "a100_40gb", "NVIDIA A100 SXM4 40GB",
        312, 40, 1.555,
        600,  # NVLink 3
        _A100_DATASHEET,
    ),
    _kind(
        "a100_80gb_pcie", "NVIDIA A100 PCIe 80GB",
        312, 80, 1.935,
        64,  # PCIe Gen4 x16: 64 GB/s both directions
        _A100_DATASHEET,
    ),
    _kind(
        "a100_40gb_pcie", "NVIDIA A100 PCIe 40GB",
        312, 40, 1.555,
        64,  # PCIe Gen4 x16
        _A100_DATASHEET,
    ),
    _kind(
        "l40s", "NVIDIA L40S 48GB",
        362.05, 48, 0.864,
        64,  # "PCIe Gen4 x16: 64GB/s bidirectional"; no NVLink
        "NVIDIA L40S GPU datasheet, https://www.nvidia.com/en-us/data-center/l40s/",
    ),
    _kind(
        # NVIDIA publishes no A10G datasheet (an AWS-only part). Peak from Baseten's
        # A10 vs A10G comparison (the A10's 125 TFLOP/s does not apply); memory from
        # AWS. The A10G is a PCIe Gen4 x16 card: 64 GB/s both directions.
        "a10g", "NVIDIA A10G 24GB",
        70, 24, 0.6,
        64,
        "Baseten, NVIDIA A10 vs A10G for ML model inference, "
        "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/; "
        "Amazon EC2 G5 instances, https://aws.amazon.com/ec2/instance-types/g5/",
    ),
    _kind(
        # V100 has no bf16 tensor cores: this is the fp16 tensor-core peak (fp32
        # accumulate), the closest figure. bf16 itself runs far slower on V100.
        "v100_sxm2_32gb", "NVIDIA Tesla V100 SXM2 32GB",
        125, 32, 0.9,
        300,  # NVLink 2: 300 GB/s total both directions -> 150e9 B/s each way
        "NVIDIA Tesla V100 product page and datasheet (V100 for NVLink column), "
        "https://www.nvidia.com/en-us/data-center/v100/",
    ),
    _kind(
        # GeForce: no NVLink, and peer-to-peer over PCIe is disabled by the driver, so
        # real peer traffic is slower than this PCIe 4.0 x16 line rate (~32 GB/s each way).
        "rtx4090", "NVIDIA GeForce RTX 4090 24GB",
        165.2, 24, 1.008,  # "Peak BF16 Tensor TFLOPS with FP32 Accumulate": 165.2
        64,
        "NVIDIA Ada GPU Architecture whitepaper, appendix A (GeForce RTX 4090), "
        "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
    ),
)

#: Canonical name -> DeviceKind.
KINDS: Mapping[str, DeviceKind] = {k.name: k for k in _TABLE}

#: Extra names -> canonical name (already normalised: lower case, ``_`` for ``-``).
ALIASES: Mapping[str, str] = {
    "h200": "h200_sxm",
    "h100": "h100_sxm",
    "h100_sxm5": "h100_sxm",
    "a100": "a100_80gb",
    "a100_sxm": "a100_80gb",
    "a100_80gb_sxm": "a100_80gb",
    "a100_40gb_sxm": "a100_40gb",
    "v100": "v100_sxm2_32gb",
    "v100_32gb": "v100_sxm2_32gb",
    "4090": "rtx4090",
    "rtx_4090": "rtx4090",
}


def _normalise(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def known_kind_names() -> list[str]:
    """Every name :func:`get_kind` accepts: canonical names, then aliases, sorted."""
    return sorted(KINDS) + sorted(ALIASES)


def get_kind(name: str) -> DeviceKind:
    """Looks up a device kind by canonical name or alias.

    Case-insensitive; ``-`` and ``_`` are equivalent (``"A100-40GB"`` works).

    Args:
        name: Kind name, e.g. ``"h100"``, ``"a100_40gb"``, ``"4090"``.

    Returns:
        The table entry.

    Raises:
        ValueError: For an unknown name; the message lists the known names.
    """
    key = _normalise(name)
    key = ALIASES.get(key, key)
    if key in KINDS:
        return KINDS[key]
    raise ValueError(
        f"unknown device kind {name!r}; known kinds: {', '.join(known_kind_names())}"
    )


# --- JAX device_kind strings -------------------------------------------------------

# (kind, tokens that must all appear, tokens that must not appear), first match wins.
# Tokens come from the lower-cased string split on anything not a letter or digit:
# "NVIDIA A100-SXM4-80GB" -> {"nvidia", "a100", "sxm4", "80gb"}.
_DEVICE_KIND_RULES: tuple[tuple[str, frozenset, frozenset], ...] = tuple(
    (kind, frozenset(need), frozenset(avoid))
    for kind, need, avoid in (
        ("h200_sxm", {"h200"}, {"nvl"}),  # H200 NVL is a PCIe part: not the SXM figures
        ("h100_pcie", {"h100", "pcie"}, set()),
        ("h100_sxm", {"h100"}, {"nvl", "pcie"}),  # "NVIDIA H100 80GB HBM3"
        ("a100_80gb_pcie", {"a100", "80gb", "pcie"}, set()),
        ("a100_40gb_pcie", {"a100", "40gb", "pcie"}, set()),
        ("a100_80gb", {"a100", "80gb"}, {"pcie"}),
        ("a100_40gb", {"a100", "40gb"}, {"pcie"}),
        ("l40s", {"l40s"}, set()),
        ("a10g", {"a10g"}, set()),
        ("v100_sxm2_32gb", {"v100", "32gb"}, {"pcie"}),
        ("rtx4090", {"4090"}, {"d", "laptop", "mobile"}),  # the 4090 D has fewer SMs
    )
)


def kind_from_device_kind_string(s: str) -> DeviceKind | None:
    """Maps a JAX ``device.device_kind`` string to a table kind.

    Examples: ``"NVIDIA H100 80GB HBM3"`` -> h100_sxm, ``"NVIDIA A100-SXM4-40GB"`` ->
    a100_40gb, ``"Tesla V100-SXM2-32GB"`` -> v100_sxm2_32gb. Variants whose figures
    differ from every table entry (``"NVIDIA H100 NVL"``, ``"Tesla V100-SXM2-16GB"``,
    ``"NVIDIA A10"``, ``"NVIDIA L40"``) give ``None`` rather than a wrong guess.

    Args:
        s: The device_kind string.

    Returns:
        The kind, or ``None`` when unknown (e.g. ``"cpu"``).
    """
    tokens = set(re.split(r"[^a-z0-9]+", s.lower())) - {""}
    for kind, need, avoid in _DEVICE_KIND_RULES:
        if need <= tokens and not (avoid & tokens):
            return KINDS[kind]
    return None


def peak_flops(device: Any, simulated: Mapping[int, DeviceKind] | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of one JAX device, for MFU.

    Args:
        device: A ``jax.Device`` (anything with ``device_kind``; ``id`` when
            ``simulated`` is given).
        simulated: Optional ``device.id -> DeviceKind`` from :func:`simulate_inventory`;
            takes precedence over the device's own kind.

    Returns:
        FLOP/s, or ``None`` when the kind is unknown (e.g. a CPU device).
    """
    if simulated is not None and getattr(device, "id", None) in simulated:
        return simulated[device.id].peak_bf16_flops
    kind = kind_from_device_kind_string(str(getattr(device, "device_kind", "")))
    return None if kind is None else kind.peak_bf16_flops


# --- Inventory ---------------------------------------------------------------------


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
            raise ValueError(
                f"host {self.name!r}: count must be a positive integer, got {self.count!r}"
            )
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
            raise ValueError(
                f"inter_host_bandwidth must be a positive number of bytes/s, got {bw!r}"
            )

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
        """A fixed-width table of the hosts, their figures and the totals."""
        header = (
            "host", "kind", "devices", "bf16 TFLOP/s", "memory GB", "mem GB/s", "intra GB/s"
        )
        rows = [header] + [
            (
                h.name,
                h.kind.name,
                str(h.count),
                _fmt(h.kind.peak_bf16_flops, 1e12),
                _fmt(h.kind.memory_bytes, 1e9),
                _fmt(h.kind.memory_bandwidth, 1e9),
                _fmt(h.kind.intra_host_bandwidth, 1e9),
            )
            for h in self.hosts
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
        )
        return "\n".join(lines)


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


# --- Parsing -----------------------------------------------------------------------

_CLUSTER_EXAMPLE = "h100:8,a100:8@400Gbps"
_BANDWIDTH_RE = re.compile(
    r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKMGT])(b|B)(?:ps|/s)\s*$"
)
_PREFIX = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def parse_bandwidth(text: str) -> float:
    """Parses a bandwidth with units into bytes/s.

    A lower-case ``b`` means bits, an upper-case ``B`` bytes: ``"400Gbps"`` and
    ``"400Gb/s"`` give 50e9, ``"50GB/s"`` and ``"50GBps"`` give 50e9. Prefixes k, M,
    G, T are decimal.

    Args:
        text: E.g. ``"400Gbps"``, ``"3.2Tb/s"``, ``"50GB/s"``.

    Returns:
        Bytes/s.

    Raises:
        ValueError: When the text is not a positive number followed by a unit.
    """
    match = _BANDWIDTH_RE.match(text)
    value = float(match.group(1)) if match else 0.0
    if not match or value <= 0:
        raise ValueError(
            f"bad bandwidth {text!r}: expected a positive number and a unit, e.g. "
            "'400Gbps' (gigabits/s) or '50GB/s' (gigabytes/s)"
        )
    per_second = value * _PREFIX[match.group(2)]
    return per_second / 8 if match.group(3) == "b" else per_second


def parse_cluster(spec: str, inter_host_bandwidth: float | None = None) -> Inventory:
    """Parses a cluster spec into an inventory, one host per item.

    Grammar: ``ITEM[,ITEM...][@BANDWIDTH]`` where ``ITEM`` is ``KIND:COUNT`` (one host
    of COUNT devices) or ``KIND:COUNTxHOSTS`` (HOSTS such hosts), ``KIND`` any name
    :func:`get_kind` accepts, and ``BANDWIDTH`` the per-host inter-host bandwidth with
    units (see :func:`parse_bandwidth`). Hosts are named ``host0``, ``host1``, ...

    Examples: ``"h100:8,a100:8"``, ``"h100:8x4@3200Gbps"``, ``"4090:2"``.

    Args:
        spec: The spec.
        inter_host_bandwidth: Bytes/s per host; used when the spec has no ``@`` part.
            Defaults to :data:`DEFAULT_INTER_HOST_BANDWIDTH`.

    Returns:
        The inventory.

    Raises:
        ValueError: On an empty spec, a malformed item, an unknown kind (the message
            lists the known kinds), a count or host repeat <= 0, a bad bandwidth, or a
            bandwidth given both in the spec and as an argument. Messages name the bad
            item and show a valid example.
    """
    body, bandwidth = _split_bandwidth(spec, inter_host_bandwidth)
    hosts: list[Host] = []
    for item in body.split(","):
        kind, count, repeat = _parse_item(item, spec)
        for _ in range(repeat):
            hosts.append(Host(kind=kind, count=count, name=f"host{len(hosts)}"))
    return Inventory(hosts=tuple(hosts), inter_host_bandwidth=bandwidth)


def _split_bandwidth(spec: str, inter_host_bandwidth: float | None) -> tuple[str, float]:
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty cluster spec {spec!r}; expected e.g. {_CLUSTER_EXAMPLE!r}")
    body, at, bw_text = spec.partition("@")
    if not at:
        if inter_host_bandwidth is None:
            return body, DEFAULT_INTER_HOST_BANDWIDTH
        return body, inter_host_bandwidth
    if inter_host_bandwidth is not None:
        raise ValueError(
            f"cluster spec {spec!r} gives a bandwidth after '@' and inter_host_bandwidth was "
            "also passed; give one of them"
        )
    try:
        return body, parse_bandwidth(bw_text)
    except ValueError as err:
        raise ValueError(f"cluster spec {spec!r}: {err}; e.g. {_CLUSTER_EXAMPLE!r}") from None


def _parse_item(item: str, spec: str) -> tuple[DeviceKind, int, int]:
    where = f"cluster spec {spec!r}, item {item.strip()!r}"
    name, colon, count_text = item.strip().partition(":")
    if not name or not colon:
        raise ValueError(f"{where}: expected KIND:COUNT, e.g. {_CLUSTER_EXAMPLE!r}")
    try:
        kind = get_kind(name)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    count_part, _, repeat_part = count_text.strip().lower().partition("x")
    count = _positive_int(count_part, f"{where}: device count", "h100:8")
    repeat = _positive_int(repeat_part, f"{where}: host repeat", "h100:8x2") if repeat_part else 1
    return kind, count, repeat


def _positive_int(text: str, what: str, example: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value <= 0:
        raise ValueError(
            f"{what} must be a positive integer, got {text.strip()!r}; e.g. {example!r}"
        )
    return value


# --- Files -------------------------------------------------------------------------

_FILE_KEYS = {"hosts", "inter_host_bandwidth", "inter_host_bandwidth_gbps", "kinds"}
_HOST_KEYS = {"kind", "count", "name", "repeat"}
_KIND_KEYS = {"label", "source", *_FIGURES}
_FILE_EXAMPLE = '{"inter_host_bandwidth_gbps": 400, "hosts": [{"kind": "h100", "count": 8}]}'


def load_inventory(path: str | os.PathLike) -> Inventory:
    """Loads an inventory from a JSON file, or YAML when the name ends ``.yaml``/``.yml``.

    Format (JSON shown; YAML has the same structure)::

        {
          "inter_host_bandwidth_gbps": 400,          # optional; Gb/s (bits) per host
          "hosts": [
            {"kind": "h100", "count": 8},            # name defaults to host<i>
            {"kind": "a100", "count": 8, "name": "node-b", "repeat": 2}
          ],
          "kinds": {                                  # optional
            "a100": {"memory_bandwidth": 1.9e12},    # override figures of a table kind
            "mi300x": {"label": "AMD MI300X", "peak_bf16_flops": 1.307e15,
                       "memory_bytes": 192e9, "memory_bandwidth": 5.3e12,
                       "intra_host_bandwidth": 64e9, "source": "..."}  # a new kind
          }
        }

    Instead of ``inter_host_bandwidth_gbps``, ``"inter_host_bandwidth"`` takes bytes/s
    (a number) or a string with units (``"400Gbps"``). Figures in ``"kinds"`` are in
    FLOP/s, bytes and bytes/s; a new kind's missing figures are unknown (``None``).
    A host with ``"repeat": n`` stands for n hosts named ``name-0 .. name-(n-1)``.

    Args:
        path: The file.

    Returns:
        The inventory.

    Raises:
        FileNotFoundError: When the file does not exist.
        ImportError: For a YAML file when pyyaml is not installed.
        ValueError: On malformed content; the message names the file and the field.
    """
    path = os.fspath(path)
    data = _read_document(path)
    where = path
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object at the top, e.g. {_FILE_EXAMPLE}")
    _check_keys(data, _FILE_KEYS, where)
    kinds = _file_kinds(data.get("kinds", {}), f"{where}: kinds", where)
    hosts = _file_hosts(data.get("hosts"), kinds, where)
    bandwidth = _file_bandwidth(data, where)
    try:
        return Inventory(hosts=tuple(hosts), inter_host_bandwidth=bandwidth)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _read_document(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.lower().endswith((".yaml", ".yml")):
        try:
            import yaml  # lazy: pyyaml is optional
        except ImportError:
            raise ImportError(
                f"{path}: reading YAML needs pyyaml; write the inventory as JSON "
                "or `pip install pyyaml`"
            ) from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: not valid YAML: {err}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None


def _check_keys(obj: Mapping, allowed: set[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )


def _file_kinds(section: Any, where: str, path: str) -> dict[str, DeviceKind]:
    """Table kinds with the file's overrides applied, plus the file's new kinds."""
    if not isinstance(section, dict):
        raise ValueError(f"{where}: expected an object of kind name -> figures")
    kinds: dict[str, DeviceKind] = {}
    for name, fields in section.items():
        name = str(name)  # YAML reads a key such as 4090 as a number
        field_where = f"{where}.{name}"
        if not isinstance(fields, dict):
            raise ValueError(f"{field_where}: expected an object of figures")
        _check_keys(fields, _KIND_KEYS, field_where)
        for field in _FIGURES:
            _check_figure(fields.get(field), f"{field_where}.{field}")
        key = ALIASES.get(_normalise(name), _normalise(name))
        if key in KINDS:
            kind = dataclasses.replace(KINDS[key], **fields)
        else:
            kind = _new_kind(key, fields, path)
        kinds[kind.name] = kind
    return kinds


def _new_kind(name: str, fields: Mapping, path: str) -> DeviceKind:
    return DeviceKind(
        name=name,
        label=str(fields.get("label", name)),
        source=str(fields.get("source", f"inventory file {path}")),
        **{f: fields.get(f) for f in _FIGURES},
    )


def _check_figure(value: Any, where: str) -> None:
    """A figure in a file: null (unknown) or a positive number."""
    if value is None:
        return
    if not _is_positive_number(value):
        raise ValueError(f"{where}: must be a positive number or null, got {value!r}")


def _file_hosts(section: Any, kinds: Mapping[str, DeviceKind], path: str) -> list[Host]:
    if not isinstance(section, list) or not section:
        raise ValueError(f"{path}: hosts: expected a non-empty list, e.g. {_FILE_EXAMPLE}")
    hosts: list[Host] = []
    for i, entry in enumerate(section):
        where = f"{path}: hosts[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f'{where}: expected an object like {{"kind": "h100", "count": 8}}')
        _check_keys(entry, _HOST_KEYS, where)
        kind = _host_kind(entry.get("kind"), kinds, where)
        count = _file_positive_int(entry.get("count"), f"{where}.count")
        repeat = _file_positive_int(entry.get("repeat", 1), f"{where}.repeat")
        name = entry.get("name", None)
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"{where}.name: expected a non-empty string, got {name!r}")
        for r in range(repeat):
            host_name = (name if repeat == 1 else f"{name}-{r}") if name else f"host{len(hosts)}"
            hosts.append(Host(kind=kind, count=count, name=host_name))
    return hosts


def _host_kind(name: Any, kinds: Mapping[str, DeviceKind], where: str) -> DeviceKind:
    if isinstance(name, int) and not isinstance(name, bool):
        name = str(name)  # YAML reads `kind: 4090` as a number
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.kind: expected a kind name such as 'h100', got {name!r}")
    key = _normalise(name)
    key = ALIASES.get(key, key)
    if key in kinds:
        return kinds[key]
    try:
        return get_kind(name)
    except ValueError as err:
        raise ValueError(f"{where}.kind: {err} (or define it under \"kinds\")") from None


def _file_positive_int(value: Any, where: str) -> int:
    if not _is_positive_int(value):
        raise ValueError(f"{where}: must be a positive integer, got {value!r}")
    return value


def _file_bandwidth(data: Mapping, where: str) -> float:
    """Bytes/s per host from ``inter_host_bandwidth_gbps`` or ``inter_host_bandwidth``."""
    if "inter_host_bandwidth" in data and "inter_host_bandwidth_gbps" in data:
        raise ValueError(
            f"{where}: give inter_host_bandwidth or inter_host_bandwidth_gbps, not both"
        )
    if "inter_host_bandwidth_gbps" in data:
        gbps = data["inter_host_bandwidth_gbps"]
        if not _is_positive_number(gbps):
            raise ValueError(
                f"{where}: inter_host_bandwidth_gbps: must be a positive number of "
                f"gigabits/s, got {gbps!r}"
            )
        return gbps * 1e9 / 8
    value = data.get("inter_host_bandwidth", DEFAULT_INTER_HOST_BANDWIDTH)
    if isinstance(value, str):
        try:
            return parse_bandwidth(value)
        except ValueError as err:
            raise ValueError(f"{where}: inter_host_bandwidth: {err}") from None
    if not _is_positive_number(value):
        raise ValueError(
            f"{where}: inter_host_bandwidth: must be a positive number of bytes/s "
            f"or a string such as '400Gbps', got {value!r}"
        )
    return float(value)


def inventory_to_dict(inventory: Inventory) -> dict[str, Any]:
    """The file form of an inventory; :func:`load_inventory` reads it back equal.

    Kinds that differ from the table (or are not in it) are written under ``"kinds"``.

    Args:
        inventory: The inventory.

    Returns:
        A JSON-serialisable dict.

    Raises:
        ValueError: When two different kinds share a name (the file format keys kinds
            by name).
    """
    kinds: dict[str, Any] = {}
    by_name: dict[str, DeviceKind] = {}
    for kind in inventory.kinds_present:
        if by_name.setdefault(kind.name, kind) != kind:
            raise ValueError(
                f"cannot write an inventory with two different kinds named {kind.name!r}"
            )
        if KINDS.get(kind.name) == kind:
            continue
        base = KINDS.get(kind.name)
        fields = {f: getattr(kind, f) for f in ("label", "source", *_FIGURES)}
        if base is not None:
            fields = {f: v for f, v in fields.items() if getattr(base, f) != v}
        kinds[kind.name] = fields
    data: dict[str, Any] = {
        "inter_host_bandwidth": inventory.inter_host_bandwidth,
        "hosts": [
            {"kind": h.kind.name, "count": h.count, "name": h.name} for h in inventory.hosts
        ],
    }
    if kinds:
        data["kinds"] = kinds
    return data


def save_inventory(inventory: Inventory, path: str | os.PathLike) -> None:
    """Writes an inventory as JSON (see :func:`inventory_to_dict`).

    Raises:
        ValueError: As :func:`inventory_to_dict`.
    """
    with open(path, "w", encoding="utf-8") as f:
        json.dump(inventory_to_dict(inventory), f, indent=2)
        f.write("\n")


def inventory_from_flag(value: str, inter_host_bandwidth: float | None = None) -> Inventory:
    """Reads a ``--cluster`` flag: a path to an existing file, else a cluster spec.

    Args:
        value: A file path (JSON/YAML) or a spec such as ``"h100:8,a100:8"``.
        inter_host_bandwidth: Bytes/s per host for a spec without ``@``; ignored for
            a file (files carry their own).

    Returns:
        The inventory.

    Raises:
        FileNotFoundError: When the value names a ``.json``/``.yaml``/``.yml`` file
            that does not exist.
        ImportError, ValueError: As :func:`load_inventory` and :func:`parse_cluster`.
    """
    if os.path.isfile(value):
        return load_inventory(value)
    if value.strip().lower().endswith((".json", ".yaml", ".yml")):
        raise FileNotFoundError(f"inventory file not found: {value!r}")
    return parse_cluster(value, inter_host_bandwidth)


# --- Detection and simulation ------------------------------------------------------


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
        return available // len(cpu), (f"the host's available memory ({available / 2**30:.1f} GiB, /proc/meminfo) "
                                        f"shared by {len(cpu)} CPU devices")
    return None, "device memory unknown"


def simulate_inventory(
    spec: str, devices: Sequence[Any]
) -> tuple[Inventory, dict[int, DeviceKind]]:
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
