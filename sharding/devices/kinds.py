"""Device kinds: the datasheet figures of each accelerator, and how names map to them.

What one chip can do (peak dense bf16 FLOP/s, memory, memory bandwidth, the link to its host peers),
as data with the document each figure comes from (`KINDS`); the names a user may write for a kind
(`ALIASES`, `get_kind`); the ``device_kind`` strings JAX reports (`kind_from_device_kind_string`);
and the default network between hosts (`DEFAULT_INTER_HOST_BANDWIDTH`).

Units everywhere: FLOP/s, bytes, bytes/s. Decimal prefixes for rates: 1 GB/s = 1e9 bytes/s,
1 TB/s = 1e12 bytes/s, 1 Gb/s = 1e9 bits/s = 0.125e9 bytes/s. Memory capacities are binary: a datasheet's
"80GB" of HBM is 80 GiB (`GIB`; DRAM dies come in powers of two: five 16 GiB stacks), which is what the
device reports (CUDA's deviceQuery on an A100 "40GB": 42,405,855,232 bytes, 39.5 GiB usable of 40 GiB).

Bandwidth conventions:

* ``DeviceKind.intra_host_bandwidth``: bytes/s one device can send to its peers on the
  same host, one direction (NVLink where the part has it, else PCIe). Datasheets quote
  NVLink and PCIe as the sum of both directions; the table stores half of that.
* ``Inventory.inter_host_bandwidth`` (`sharding.devices.inventory`): bytes/s one *host* can send
  to other hosts, one direction, through all its network adapters together. The default is one
  InfiniBand NDR port (400 Gb/s = 50e9 bytes/s). A DGX-style host with one 400 Gb/s
  adapter per GPU has 8 x 50e9 = 400e9 bytes/s; say so with ``@3200Gbps``.

This module imports nothing of the project and calls no JAX at import time.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

GB = 1e9  # bytes; datasheets' rates (GB/s) are decimal
GIB = float(2**30)  # bytes; datasheets' memory capacities ("80GB" of HBM) are binary
TB = 1e12
TFLOPS = 1e12

#: One InfiniBand NDR port per host, 400 Gb/s per direction = 50e9 bytes/s.
#: Source: NVIDIA ConnectX-7 adapter cards user manual, "Introduction" (single-port
#: OSFP, NDR 400Gb/s), https://docs.nvidia.com/networking/display/ConnectX7VPI/Introduction
DEFAULT_INTER_HOST_BANDWIDTH = 400e9 / 8

_FIGURES = ("peak_bf16_flops", "memory_bytes", "memory_bandwidth", "intra_host_bandwidth")


def _is_positive_number(value: Any) -> bool:
    """A finite number > 0 (bools excluded)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0


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
        sm_count: Streaming multiprocessors (the waves of a matrix product's tiles,
            `sharding.costmodel.gemm`); ``None`` when unknown (the clock assumes `DEFAULT_SM_COUNT`).
        gemm_fraction: Fraction of ``peak_bf16_flops`` the best-shaped large bf16 matrix product reaches on
            this kind, measured (`GEMM_BENCHMARKS`); ``None`` where no measurement is cited (the clock assumes
            `DEFAULT_GEMM_FRACTION`).
        attention_fraction: Fraction of ``peak_bf16_flops`` a fused (flash) attention kernel's forward and
            backward reach, measured (`ATTENTION_BENCHMARKS`); ``None``: `DEFAULT_ATTENTION_FRACTION`.
        sustained_fraction: Fraction of the burst rates above (``gemm_fraction``, ``attention_fraction``:
            benchmarks at the boost clock) the tensor cores hold under sustained full load, where the power
            limit lowers the clock (`SUSTAINED_FRACTION`, a ratio of measured throughputs);
            ``None``: `DEFAULT_SUSTAINED_FRACTION` (no measurement).
        efficiency_source: Where ``gemm_fraction``, ``attention_fraction`` and ``sustained_fraction`` come from.
        peak_fp32_flops: Without bfloat16 (``bfloat16`` False): the float32 peak, FLOP/s, the planner's clock
            for it (planned in float32, the dtype the kind has and the model runs); None where not needed.
        bfloat16: Whether the kind computes in bfloat16 at ``peak_bf16_flops`` (False for V100, whose
            ``peak_bf16_flops`` is its float16 tensor-core figure).

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
    sm_count: int | None = None
    gemm_fraction: float | None = None
    attention_fraction: float | None = None
    sustained_fraction: float | None = None
    efficiency_source: str = ""
    peak_fp32_flops: float | None = None
    bfloat16: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("DeviceKind.name must not be empty")
        for field in _FIGURES:
            value = getattr(self, field)
            if value is not None and not _is_positive_number(value):
                raise ValueError(f"DeviceKind {self.name!r}: {field} must be a positive number or None, got {value!r}")
        for field in ("gemm_fraction", "attention_fraction", "sustained_fraction"):
            value = getattr(self, field)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"DeviceKind {self.name!r}: {field} must be in (0, 1], got {value!r}")
        if self.sm_count is not None and not _is_positive_int(self.sm_count):
            raise ValueError(f"DeviceKind {self.name!r}: sm_count must be a positive integer, got {self.sm_count!r}")

    @property
    def is_known(self) -> bool:
        """True when every figure is known (not ``None``)."""
        return not self.missing_figures

    @property
    def missing_figures(self) -> tuple[str, ...]:
        """The names of the figures that are unknown (``None``), in the field order."""
        return tuple(f for f in _FIGURES if getattr(self, f) is None)


def _kind(name, label, tflops, memory_gb, memory_tb_s, intra_gb_s_bidirectional, source):
    """Builds a table entry from datasheet units (TFLOP/s, GB of memory meaning GiB, TB/s, GB/s both ways)."""
    return DeviceKind(
        name=name,
        label=label,
        peak_bf16_flops=tflops * TFLOPS,
        memory_bytes=memory_gb * GIB,
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
        "h200_sxm",
        "NVIDIA H200 SXM 141GB",
        1979 / 2,
        141,
        4.8,
        900,  # NVLink 4: 900 GB/s total both directions -> 450e9 B/s each way
        "NVIDIA H200 Tensor Core GPU product page and datasheet (H200 SXM column), "
        "https://www.nvidia.com/en-us/data-center/h200/",
    ),
    _kind(
        "h100_sxm",
        "NVIDIA H100 SXM5 80GB",
        1979 / 2,
        80,
        3.35,
        900,  # NVLink 4: 900 GB/s total both directions -> 450e9 B/s each way
        _H100_DATASHEET,
    ),
    _kind(
        "h100_pcie",
        "NVIDIA H100 PCIe 80GB",
        1513 / 2,
        80,
        2.0,
        128,  # PCIe Gen5 x16: 128 GB/s both directions (the NVLink bridge joins pairs only)
        _H100_DATASHEET,
    ),
    _kind(
        "a100_80gb",
        "NVIDIA A100 SXM4 80GB",
        312,
        80,
        2.039,
        600,  # NVLink 3: 600 GB/s total both directions -> 300e9 B/s each way
        _A100_DATASHEET,
    ),
    _kind(
        "a100_40gb",
        "NVIDIA A100 SXM4 40GB",
        312,
        40,
        1.555,
        600,  # NVLink 3
        _A100_DATASHEET,
    ),
    _kind(
        "a100_80gb_pcie",
        "NVIDIA A100 PCIe 80GB",
        312,
        80,
        1.935,
        64,  # PCIe Gen4 x16: 64 GB/s both directions
        _A100_DATASHEET,
    ),
    _kind(
        "a100_40gb_pcie",
        "NVIDIA A100 PCIe 40GB",
        312,
        40,
        1.555,
        64,  # PCIe Gen4 x16
        _A100_DATASHEET,
    ),
    _kind(
        "l40s",
        "NVIDIA L40S 48GB",
        362.05,
        48,
        0.864,
        64,  # "PCIe Gen4 x16: 64GB/s bidirectional"; no NVLink
        "NVIDIA L40S GPU datasheet, https://www.nvidia.com/en-us/data-center/l40s/",
    ),
    _kind(
        # NVIDIA publishes no A10G datasheet (an AWS-only part). Peak from Baseten's
        # A10 vs A10G comparison (the A10's 125 TFLOP/s does not apply); memory from
        # AWS. The A10G is a PCIe Gen4 x16 card: 64 GB/s both directions.
        "a10g",
        "NVIDIA A10G 24GB",
        70,
        24,
        0.6,
        64,
        "Baseten, NVIDIA A10 vs A10G for ML model inference, "
        "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/; "
        "Amazon EC2 G5 instances, https://aws.amazon.com/ec2/instance-types/g5/",
    ),
    dataclasses.replace(
        _kind(
            # V100 has no bf16 tensor cores: this is the fp16 tensor-core peak (fp32
            # accumulate), the closest figure. bf16 itself runs far slower on V100, so the
            # planner plans it in float32 at the datasheet's single-precision 15.7 TFLOP/s.
            "v100_sxm2_32gb",
            "NVIDIA Tesla V100 SXM2 32GB",
            125,
            32,
            0.9,
            300,  # NVLink 2: 300 GB/s total both directions -> 150e9 B/s each way
            "NVIDIA Tesla V100 product page and datasheet (V100 for NVLink column), "
            "https://www.nvidia.com/en-us/data-center/v100/",
        ),
        peak_fp32_flops=15.7 * TFLOPS,
        bfloat16=False,
    ),
    _kind(
        # GeForce: no NVLink, and peer-to-peer over PCIe is disabled by the driver, so
        # real peer traffic is slower than this PCIe 4.0 x16 line rate (~32 GB/s each way).
        "rtx4090",
        "NVIDIA GeForce RTX 4090 24GB",
        165.2,
        24,
        1.008,  # "Peak BF16 Tensor TFLOPS with FP32 Accumulate": 165.2
        64,
        "NVIDIA Ada GPU Architecture whitepaper, appendix A (GeForce RTX 4090), "
        "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
    ),
)

#: Streaming multiprocessors per kind (the whitepapers' full-product counts): A100 108 (NVIDIA A100 Tensor
#: Core GPU Architecture whitepaper, 2020, "108 SMs"), H100 SXM5 132 and H100 PCIe 114 (NVIDIA H100 Tensor
#: Core GPU Architecture whitepaper, 2022, Table 3), H200 132 (the same GH100 die), L40S 142 and RTX 4090 128
#: (NVIDIA Ada GPU Architecture whitepaper, appendix A), A10G 80 (GA102 as AWS ships it), V100 80 (NVIDIA
#: Tesla V100 GPU Architecture whitepaper, 2017).
SM_COUNTS: Mapping[str, int] = {
    "h200_sxm": 132,
    "h100_sxm": 132,
    "h100_pcie": 114,
    "a100_80gb": 108,
    "a100_40gb": 108,
    "a100_80gb_pcie": 108,
    "a100_40gb_pcie": 108,
    "l40s": 142,
    "a10g": 80,
    "v100_sxm2_32gb": 80,
    "rtx4090": 128,
}

_MAMF = (
    "Maximum Achievable Matmul FLOPS table, S. Bekman, ml-engineering, compute/accelerator/README.md "
    "(mamf-finder.py, bf16, best of a shape sweep): A100 SXM 267.9 of 312 TFLOP/s (85.9%), A100 PCIe 256.4 "
    "(82.2%), H100 SXM 792.1 of 989 (80.1%), GH200 821.0 (83.0%)"
)
_FLASH_A100 = (
    "Dao, FlashAttention-2 (arXiv 2307.08691), Fig. 4-6: forward + backward on A100 80GB, head width 128, "
    "causal, sequence 2k-16k: about 165-200 TFLOP/s (53-64% of 312)"
)
_FLASH_H100 = (
    "Shah et al., FlashAttention-3 (arXiv 2407.08608), section 4.1: forward up to 740 TFLOP/s (75% of an H100 "
    "SXM5's 989) and backward 1.5-1.75x FlashAttention-2's (about 450-550 TFLOP/s at head width 128); forward "
    "+ backward (backward 2.5x the forward's products) about 550 TFLOP/s, 55%; cuDNN's fused attention, "
    "which NeMo and JAX use on Hopper, is of the same class"
)

_MAMF_BURST = (
    "S. Bekman, ml-engineering, compute/accelerator/benchmarks/README.md, mamf-finder.py's MAMF measured as a "
    "burst at the boost clock after an idle gap (the median of a shape's 5 fastest iterations): H200 bf16, "
    "all 8 GPUs of a node, 852.1 of 989.5 TFLOP/s (86.1%); H100 SXM taken as the H200's (the same GH100 die at "
    "the same clocks and 700 W; the table above's H100 SXM 792.1-794.5 is its older protocol, a mean of 100 "
    "iterations after 50 of warm-up, partly at the clock the power limit settles to, so it is not combined "
    "with the sustained fraction below)"
)

#: Kind name -> (fraction of the bf16 peak the best large matrix product reaches in a short burst, source):
#: measured matmul ceilings, not fitted to training runs. Where the tile and wave quantisation of a real
#: step's products (`sharding.costmodel.gemm`) cost more, the clock charges it on top; where the kind holds
#: less under sustained load, `SUSTAINED_FRACTION` says how much less (measured in the same run as the burst
#: for GH100 kinds).
GEMM_BENCHMARKS: Mapping[str, tuple[float, str]] = {
    "a100_80gb": (0.859, _MAMF),
    "a100_40gb": (0.859, _MAMF),
    "a100_80gb_pcie": (0.822, _MAMF),
    "a100_40gb_pcie": (0.822, _MAMF),
    "h100_sxm": (0.861, _MAMF_BURST),
    "h200_sxm": (0.861, _MAMF_BURST),
}

#: Kind name -> (fraction of the bf16 peak a flash attention kernel's forward + backward reaches, source).
ATTENTION_BENCHMARKS: Mapping[str, tuple[float, str]] = {
    "a100_80gb": (0.58, _FLASH_A100),
    "a100_40gb": (0.58, _FLASH_A100),
    "h100_sxm": (0.55, _FLASH_H100),
    "h200_sxm": (0.55, _FLASH_H100 + "; H200 taken as the H100's (same die)"),
}

_MSMF_H200 = (
    "S. Bekman, ml-engineering, compute/accelerator/benchmarks/README.md, mamf-finder.py's two headlines from "
    "one run: MAMF (the best burst at the boost clock, `GEMM_BENCHMARKS`) and MSMF (the best rate a shape holds "
    "over a 4 s window once the clock has settled under full load). H200 bf16, all 8 GPUs of a node computing "
    "at once (n=40): MSMF 755.5 against MAMF 852.1 TFLOP/s, 0.887; one GPU with idle siblings 744.8 / 848.4, "
    "0.878; an earlier protocol of the same benchmark 698.6 / 823.9, 0.848. A ratio of throughputs, not of "
    "clocks: the settled clock (1,850-1,938 MHz against the 1,980 MHz boost) is part of it, and the shape that "
    "holds best at the power limit is not the one that bursts best. H100 SXM taken as the H200's (the same "
    "GH100 die at the same 700 W limit); H100 PCIe (the same die at 350 W, its datasheet peak at its own "
    "1,755 MHz boost) likewise, an upper bound: a lower power limit settles no higher"
)

#: Kind name -> (fraction of its burst matmul rate (`GEMM_BENCHMARKS`) a kind's tensor cores hold under
#: sustained full load, source). A training step keeps the tensor cores busy for seconds; a GH100 then runs at
#: the clock its power limit allows, below the boost clock the bursts ran at. The fraction applies to every
#: tensor-core kernel (products and fused attention alike; `ATTENTION_BENCHMARKS`' figure is a benchmark's
#: too); memory-bound work (elementwise, the optimizer) is priced at the memory bandwidth and does not take
#: it. Measured, not fitted to training runs; the published figures span 0.848-0.951 (bench/RESULTS.md gives
#: the clock's error over that span).
SUSTAINED_FRACTION: Mapping[str, tuple[float, str]] = {
    "h100_sxm": (0.887, _MSMF_H200),
    "h200_sxm": (0.887, _MSMF_H200),
    "h100_pcie": (0.887, _MSMF_H200),
}

#: Assumed where a kind has no measurement cited: the fraction of peak a large matmul reaches (the low end
#: of the measured ceilings above), a flash attention kernel's (FlashAttention-2's on A100), the SMs, and no
#: loss under sustained load (no measurement for A100: its SC'21 rows without pipelines read 0.94-1.04
#: without one, its pipelined and ZeRO-3 rows 0.39-0.86, bench/RESULTS.md).
DEFAULT_GEMM_FRACTION = 0.80
DEFAULT_ATTENTION_FRACTION = 0.55
DEFAULT_SUSTAINED_FRACTION = 1.0
DEFAULT_SM_COUNT = 108


def _measured(kind: DeviceKind) -> DeviceKind:
    """``kind`` with its SM count and measured fractions (`SM_COUNTS`, `GEMM_BENCHMARKS`,
    `ATTENTION_BENCHMARKS`, `SUSTAINED_FRACTION`)."""
    gemm = GEMM_BENCHMARKS.get(kind.name)
    attention = ATTENTION_BENCHMARKS.get(kind.name)
    sustained = SUSTAINED_FRACTION.get(kind.name)
    sources = "; ".join(dict.fromkeys(x[1] for x in (gemm, attention, sustained) if x))
    return dataclasses.replace(
        kind,
        sm_count=SM_COUNTS.get(kind.name),
        gemm_fraction=gemm[0] if gemm else None,
        attention_fraction=attention[0] if attention else None,
        sustained_fraction=sustained[0] if sustained else None,
        efficiency_source=sources,
    )


#: Canonical name -> DeviceKind.
KINDS: Mapping[str, DeviceKind] = {k.name: _measured(k) for k in _TABLE}

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
    raise ValueError(f"unknown device kind {name!r}; known kinds: {', '.join(known_kind_names())}")


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
