"""The clock: predicted seconds of one step on one device (`step_time`).

Compute, from the shapes (`compute_seconds`): each matrix product of the step by its ``m, n, k`` on the
kind (`sharding.costmodel.gemm.gemm_seconds`: tiles in waves over the SMs at the kind's measured matmul
ceiling, or its memory bandwidth when its arithmetic intensity is low), a fused attention kernel's products at
its measured fraction of peak (`Hardware.attention_fraction`), both at the fraction of those burst rates the
tensor cores hold under sustained load (`Hardware.sustained_fraction`), the elementwise work at the memory
bandwidth (`ELEMENTWISE_BYTES_PER_FLOP`); nothing in it is fitted to training runs. ``--efficiency`` instead prices
all the step's work at one fraction of peak. The optimizer's memory traffic at the memory bandwidth. Each collective by an alpha-beta model of its link class (within a host or across
hosts, `sharding.costmodel.collectives.link_classes`): ring algorithms (`Comm.wire_bytes`, `Comm.steps`),
Thakur, Rabenseifner and Gropp (IJHPCA 2005), section 4, with the latencies and the ring/tree choice of
NCCL's own model (`NCCL_LATENCY`, `comm_seconds`). `Hardware` holds what one device and its links can do;
`hardware_for` reads it from a `sharding.devices.DeviceKind`. The whole clock is held against published
training runs by ``bench/published.py`` (``bench/RESULTS.md``).

Units: seconds, FLOP/s, bytes/s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from sharding.costmodel.collectives import Comm
from sharding.costmodel.cost import Cost
from sharding.costmodel.flops import Flops
from sharding.costmodel.gemm import Gemm, gemm_seconds
from sharding.devices import kinds

#: Bytes of device memory an elementwise FLOP (as XLA counts them: 1 per element per op) moves: one
#: bfloat16 element read or written. Elementwise work is memory-bound (norms, activations, softmax, rotary,
#: the loss: about one FLOP per element loaded), so the clock prices it at the memory bandwidth, not at the
#: matrix units' peak (a roofline: an H100 does 295 FLOPs per byte of HBM traffic at peak).
ELEMENTWISE_BYTES_PER_FLOP = 2.0

#: Fraction of the datasheet's HBM bandwidth that streaming kernels (copies, elementwise ops, the optimizer)
#: reach: device-to-device copies measure about 90% of it on A100 and H100 (NVIDIA's nvbandwidth and
#: BabelStream-style copy benchmarks; the HBM's refresh and page turns take the rest).
MEMORY_FRACTION = 0.9


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
      efficiency: None: the step priced from its shapes (`compute_seconds`); a number: all the step's work at
        that fraction of peak (``--efficiency``).
      sm_count: Streaming multiprocessors (a product's waves of tiles).
      gemm_tile: ``(tile_m, tile_n)`` of the kind's large bf16 products (cuBLAS's: 256 x 128 on A100,
        128 x 256 on H100 by its kernel names; one thread block per SM).
      gemm_fraction: Fraction of peak the best large product reaches (`sharding.devices.GEMM_BENCHMARKS`).
      attention_fraction: Fraction of peak a flash attention kernel reaches, forward and backward.
      sustained_fraction: Fraction of those burst rates the tensor cores hold under a step's sustained load (the
        power limit's clock, `sharding.devices.SUSTAINED_FRACTION`); scales the products and the fused
        attention, not the memory-bound work.
      memory_fraction: Fraction of ``memory_bandwidth`` streaming kernels reach (`MEMORY_FRACTION`).
      base_latency: Seconds every collective call pays once (launch and synchronisation).
      tree_intra_latency: Seconds per tree level inside a host (all-reduce by tree).
      tree_inter_latency: Seconds per tree level across hosts.
      elementwise_bytes: Bytes of memory traffic per elementwise FLOP, priced at ``memory_bandwidth``
        (`ELEMENTWISE_BYTES_PER_FLOP`, with an efficiency fitted for it); None: elementwise FLOPs run at
        ``efficiency x peak`` like the products (one efficiency for all the step's work).
      overlap_slowdown: Fraction of a hidden collective's seconds added to the compute beside it
        (`overlap`); `hardware_for` sets `OVERLAP_SLOWDOWN`, a `Hardware` built by hand has none.

    The latencies are NCCL's own model of its Simple protocol (the one it runs for the megabyte messages
    of a training step), `NCCL_LATENCY`.
    """

    peak_flops: float
    memory_bytes: float
    memory_bandwidth: float
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float = 5e-6
    inter_latency: float = 15e-6
    efficiency: float | None = 0.5
    base_latency: float = 0.0
    tree_intra_latency: float | None = None
    tree_inter_latency: float | None = None
    elementwise_bytes: float | None = None
    overlap_slowdown: float = 0.0
    sm_count: int = 108
    gemm_tile: tuple[int, int] = (128, 256)
    gemm_fraction: float = 0.8
    attention_fraction: float = 0.55
    sustained_fraction: float = 1.0
    memory_fraction: float = 1.0


#: NCCL's latency model (seconds), Simple protocol: ``src/graph/tuning.cc``, ``ncclTopoTuneModel`` (NVIDIA/nccl,
#: its 2020 version, ``baseLat`` and ``hwLat``; Simple is what NCCL runs for megabyte messages): every call pays the ring's base latency; each ring step costs ``ring_nvlink``
#: inside a host over NVLink (``ring_pcie`` over PCIe) and ``ring_net`` across hosts; a tree all-reduce pays
#: ``tree_nvlink`` per step inside a host and ``tree_net`` per level across hosts (``log2`` of the hosts).
#: NCCL times both algorithms and runs the faster (``ncclTopoGetAlgoTime``), which is what `comm_seconds` does.
NCCL_LATENCY = {
    "base": 8.4e-6,
    "ring_nvlink": 3.4e-6,
    "ring_pcie": 5.7e-6,
    "ring_net": 9.6e-6,
    "tree_nvlink": 28e-6,
    "tree_pcie": 28e-6,
    "tree_net": 50e-6,
}

#: Fraction of a hidden collective's seconds that it adds to the compute running beside it (`overlap`). NCCL
#: runs its collectives as kernels on the SMs: an all-gather of a training step holds 24 of an H100's 132 SMs
#: while it runs (one thread block per channel; measured with Nsight Systems beside a one-wave GEMM, NVIDIA
#: developer forum, "Compute-communication overlap causes severe GEMM performance degradation because of tail
#: effect", 2025), so the products beside it run on about 18% fewer SMs, and share the memory bandwidth the
#: collective's copies use. Not derived from the published rows; their ratios with it are in bench/RESULTS.md
#: (bench/published.py).
OVERLAP_SLOWDOWN = 0.18

#: Intra-host links at or above this one-way bandwidth are NVLink (bytes/s): PCIe Gen5 x16 is 64e9.
_NVLINK_FROM = 100e9

#: Fraction of peak FLOP/s of ``--efficiency`` in reports where none is given (the clock itself prices the
#: shapes: `compute_seconds`).
DEFAULT_EFFICIENCY = 0.5


def hardware_for(
    kind: Any,
    devices_per_host: int,
    inter_host_bandwidth: float,
    efficiency: float | None = None,
    dtype: str = "bfloat16",
) -> Hardware:
    """`Hardware` from a `sharding.devices.DeviceKind` and its host.

    Compute: from the shapes (`compute_seconds`) with the kind's SMs, measured matmul and attention fractions
    and sustained fraction (`sharding.devices.GEMM_BENCHMARKS`, `ATTENTION_BENCHMARKS`, `SUSTAINED_FRACTION`;
    `sharding.devices.kinds.DEFAULT_GEMM_FRACTION` and its neighbours where a kind has none); ``efficiency``
    when given (``--efficiency``) prices all the step's work at that fraction of peak instead.

    Latencies: NCCL's model (`NCCL_LATENCY`), NVLink or PCIe by the kind's intra-host bandwidth.

    Peak: ``peak_bf16_flops``, but in ``float32`` on a kind without bfloat16 (V100) its ``peak_fp32_flops``.

    Raises:
      ValueError: When the kind's figures are unknown (e.g. a detected CPU).
    """
    if not getattr(kind, "is_known", False):
        raise ValueError(
            f"device kind {getattr(kind, 'name', kind)!r} has unknown figures; "
            f"describe the cluster (the run's cluster or simulate_cluster) with a known kind, e.g. h100:8"
        )
    link = "nvlink" if kind.intra_host_bandwidth >= _NVLINK_FROM else "pcie"
    fp32 = dtype == "float32" and not getattr(kind, "bfloat16", True) and getattr(kind, "peak_fp32_flops", None)
    hopper = kind.peak_bf16_flops > 500e12  # Hopper's cuBLAS kernels tile 128 x 256, Ampere's 256 x 128
    return Hardware(
        peak_flops=kind.peak_fp32_flops if fp32 else kind.peak_bf16_flops,
        memory_bytes=kind.memory_bytes,
        memory_bandwidth=kind.memory_bandwidth,
        intra_bandwidth=kind.intra_host_bandwidth,
        inter_bandwidth=inter_host_bandwidth / max(devices_per_host, 1),
        intra_latency=NCCL_LATENCY[f"ring_{link}"],
        inter_latency=NCCL_LATENCY["ring_net"],
        efficiency=efficiency,
        elementwise_bytes=ELEMENTWISE_BYTES_PER_FLOP if efficiency is None else None,
        base_latency=NCCL_LATENCY["base"],
        tree_intra_latency=NCCL_LATENCY[f"tree_{link}"],
        tree_inter_latency=NCCL_LATENCY["tree_net"],
        overlap_slowdown=OVERLAP_SLOWDOWN,
        sm_count=getattr(kind, "sm_count", None) or kinds.DEFAULT_SM_COUNT,
        gemm_tile=(128, 256) if hopper else (256, 128),
        gemm_fraction=getattr(kind, "gemm_fraction", None) or kinds.DEFAULT_GEMM_FRACTION,
        attention_fraction=getattr(kind, "attention_fraction", None) or kinds.DEFAULT_ATTENTION_FRACTION,
        sustained_fraction=getattr(kind, "sustained_fraction", None) or kinds.DEFAULT_SUSTAINED_FRACTION,
        memory_fraction=MEMORY_FRACTION,
    )


def compute_seconds(cost: Cost, hw: Hardware, memo: dict | None = None) -> float:
    """Seconds of the step's computation on one device.

    With ``hw.efficiency`` set: all the step's FLOPs at that fraction of ``hw.peak_flops``. Otherwise from the
    shapes: the products of ``cost.gemms`` one by one (`sharding.costmodel.gemm.gemm_seconds`); the
    matrix-product FLOPs they leave out (a fused attention kernel's score and value products) at
    ``attention_fraction`` of peak, both at ``sustained_fraction`` of their burst rate; the elementwise work at
    ``elementwise_bytes`` per FLOP over
    ``memory_bandwidth x memory_fraction`` (the optimizer's arithmetic is fused into its memory traffic,
    `StepTime.optimizer`). A `Cost` without its products (``gemms`` empty, one built by hand) has its weight
    products priced at ``gemm_fraction`` of peak.

    ``memo``: a dict the caller keeps for one ``hw`` (`step_time`'s), holding each product shape's seconds so a
    search that prices many costs of the same shapes computes each once; the sum is the same either way.
    """
    flops = cost.flops
    if hw.efficiency is not None:
        return flops.total / (hw.peak_flops * hw.efficiency)
    if memo is None:
        products = sum(gemm_seconds(g, hw) * g.count for g in cost.gemms)
    else:
        products = sum(_memoised(memo, ("gemm", g.m, g.n, g.k), gemm_seconds, g, hw) * g.count for g in cost.gemms)
    covered = sum(g.flops * g.count for g in cost.gemms)
    fused = max(flops.matmul - covered, 0.0)
    if not cost.gemms:  # a `Cost` without its shapes: the weight products at the kind's matmul ceiling
        fused = flops.attention
        products = (flops.matmul - flops.attention) / (hw.peak_flops * hw.gemm_fraction * hw.sustained_fraction)
    bandwidth = hw.memory_bandwidth * hw.memory_fraction
    elementwise = flops.elementwise * (hw.elementwise_bytes or ELEMENTWISE_BYTES_PER_FLOP)
    attention = hw.peak_flops * hw.attention_fraction * hw.sustained_fraction
    return products + fused / attention + elementwise / bandwidth


def compute_floor(flops: Flops, gemms: Sequence[Gemm], hw: Hardware, memo: dict | None = None) -> float:
    """A lower bound on `compute_seconds` of any `Cost` whose FLOPs are at least ``flops`` field by field and
    whose products hold each of ``gemms``' shapes at least as often (`sharding.costmodel.cost.stage_floor`'s
    work, times the layers a stage computes).

    `compute_seconds`' own terms, each no larger: with ``hw.efficiency`` all the FLOPs at that fraction of
    peak; else the products one by one (`gemm_seconds`, positive per execution) and the elementwise work at
    the memory bandwidth, leaving out the products no `Gemm` covers (a fused kernel's, priced at
    ``attention_fraction``: whether a cost's FLOPs exceed its products' by more than these is not known here).

    Args:
      flops: The FLOPs (`Flops`).
      gemms: The products (`Gemm`).
      hw: The device (`Hardware`).
      memo: As `compute_seconds` takes it (the same figures with or without).

    Returns:
      Seconds.
    """
    if hw.efficiency is not None:
        return flops.total / (hw.peak_flops * hw.efficiency)
    if memo is None:
        products = sum(gemm_seconds(g, hw) * g.count for g in gemms)
    else:
        products = sum(_memoised(memo, ("gemm", g.m, g.n, g.k), gemm_seconds, g, hw) * g.count for g in gemms)
    elementwise = flops.elementwise * (hw.elementwise_bytes or ELEMENTWISE_BYTES_PER_FLOP)
    return products + elementwise / (hw.memory_bandwidth * hw.memory_fraction)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step on one device.

    Attributes:
      compute: The step's products, attention and elementwise work (`compute_seconds`).
      optimizer: The update's memory traffic (read gradient, parameter, moments; write them).
      exposed_comm: Collectives on the critical path (tensor, sequence, stage).
      overlapped_comm: Collectives that can overlap compute (weight gathers, gradient reductions), all of them.
      total: ``compute + overlap_exposed + contention + exposed_comm + optimizer``.
      by_kind: Seconds per collective kind.
      overlap_exposed: The part of ``overlapped_comm`` no compute hides (`overlap`): the layer loop's first
        weight gather and last gradient reduction, what a layer's traffic outlasts its compute by, and the rest
        beyond the step's compute.
      contention: Compute lost to the collectives running beside it (`OVERLAP_SLOWDOWN` of the hidden part).
    """

    compute: float
    optimizer: float
    exposed_comm: float
    overlapped_comm: float
    total: float
    by_kind: dict[str, float]
    overlap_exposed: float = 0.0
    contention: float = 0.0


def comm_seconds(comm: Comm, hw: Hardware, links: Mapping[str, str], shares: Mapping[str, int] | None = None) -> float:
    """Time of one collective's executions per step, as NCCL runs it (alpha-beta per algorithm).

    Bytes: every rank sends the ring's wire bytes (`Comm.wire_bytes`, the bus bandwidth's bytes: nccl-tests'
    ``doc/PERFORMANCE.md``, busbw = algbw x (n-1)/n for all-gather and reduce-scatter, 2(n-1)/n for all-reduce,
    "the speed of the hardware bottleneck") over the intra-host link. A group that crosses hosts runs its ring
    through its ``g`` ranks on each host and leaves the host once per ring: each of NCCL's rings (channels)
    crosses between hosts on its own NIC and NVLink spreads the traffic over them (NCCL's maintainers,
    NVIDIA/nccl issue 601: "we can use NVLink to split the operations in N parts then balance the traffic onto
    the N NICs"), so every edge of the ring, network ones included, carries the wire bytes once, and the
    host's network is shared by the ``devices_per_host / g`` groups a host holds, not by its devices: a ring's
    network bandwidth is ``g x`` `Hardware.inter_bandwidth` (the host's network over its devices), capped by
    the intra-host link its other edges use. With one rank per host (``g = 1``) that is the device's own share
    of the network. The tree all-reduce moves its bytes at the same bandwidth; an all-to-all and a
    collective-permute (every rank to its own peers) get the device's share only.

    Latency, as NCCL's model counts it (`NCCL_LATENCY`): a group with ``g`` of its ``n`` ranks on each host
    runs its ring through all of them, so ``n/g - 1`` of the ring's ``n - 1``
    steps (twice both for an all-reduce) cross the network and the rest stay inside hosts. An all-reduce may
    instead run as a tree (NCCL's double binary tree: ``2 ((g-1) alpha_intra + log2(hosts) alpha_inter)``,
    twice the result's bytes), whichever is faster, as NCCL chooses: the tree's latency grows with the
    logarithm of the hosts, not with the ranks.

    Args:
      comm: The collective.
      hw: The device (`Hardware`; NCCL's latencies, `NCCL_LATENCY`).
      links: Mesh axis -> ``intra``/``inter`` (`link_classes`).
      shares: Mesh axis -> positions inside one host (`host_shares`); None: groups that cross hosts hold one
        device per host (every ring step crosses the network).

    Returns:
      Seconds per step (``comm.count`` executions).
    """
    return comm.count * _execution_seconds(comm, hw, links, shares)


def _execution_seconds(
    comm: Comm, hw: Hardware, links: Mapping[str, str], shares: Mapping[str, int] | None = None
) -> float:
    """Seconds of one execution of ``comm`` (`comm_seconds` over ``comm.count``): it depends on the collective's
    kind, axes, group and bytes only, never its count, so a step's repeated collectives share it."""
    n = comm.group
    if n <= 1:
        return 0.0
    inter = any(links.get(a) == "inter" for a in comm.axes)
    if not inter:
        alpha = hw.base_latency + comm.steps() * hw.intra_latency
        return alpha + comm.wire_bytes() / hw.intra_bandwidth
    local = math.prod(shares.get(a, 1) for a in comm.axes) if shares else 1
    local = max(1, min(local, n))
    hosts = max(n // local, 1)
    bandwidth = hw.inter_bandwidth
    if comm.kind == "collective-permute":
        return hw.base_latency + hw.inter_latency + comm.wire_bytes() / bandwidth
    if comm.kind != "all-to-all":  # a ring through the host's g ranks: the host's network over its groups
        bandwidth = min(bandwidth * local, hw.intra_bandwidth)
    crossing = (2 if comm.kind == "all-reduce" else 1) * (hosts - 1)
    ring = hw.base_latency + (comm.steps() - crossing) * hw.intra_latency + crossing * hw.inter_latency
    seconds = ring + comm.wire_bytes() / bandwidth
    if comm.kind == "all-reduce" and hw.tree_inter_latency is not None:
        tree = 2 * ((local - 1) * hw.tree_intra_latency + math.log2(hosts) * hw.tree_inter_latency)
        seconds = min(seconds, tree + 2 * comm.result_bytes / bandwidth)
    return seconds


def _memoised(memo: dict, key: tuple, fn, *args) -> float:
    """``memo[key]``, computed by ``fn(*args)`` the first time."""
    value = memo.get(key)
    if value is None:
        value = memo[key] = fn(*args)
    return value


def overlap(
    cost: Cost,
    compute: float,
    loop_gathers: float,
    loop_reductions: float,
    other: float,
    slowdown: float,
    by_link: Mapping[str, tuple[float, float]] | None = None,
    runs: tuple[float, float] | None = None,
) -> tuple[float, float]:
    """``(exposed, contention)``: how much of the overlappable traffic no compute hides, and the compute the
    hidden part costs, in seconds.

    The layer loop (per-layer FSDP weight gathers and gradient reductions, ``Comm.layer_loop``) runs as the
    schedulers that hide it run it: XLA's latency-hiding scheduler on GPU (collectives asynchronous on their
    own stream), like PyTorch FSDP's prefetch (PyTorch's FSDP notes: "the 1st all-gather will not be able to
    overlap with anything") and Megatron-FSDP's (``SchedulePolicy``: "prefetches one successor"), starts a
    layer's weight gather during the previous layer's compute, so each gather hides behind one layer's compute
    only, and a gradient reduction behind the next layer's backward. With ``N`` layer executions per step
    (forward), per execution a forward gather ``G``, the backward pass's gathers ``G'`` (one per recomputation
    of the forward, none when the gathered weights are kept), a reduction ``R``, forward compute ``F`` and
    backward compute (recomputation included) ``B``:

        exposed = G + R + (N - 1) (max(0, G - F) + max(0, G' + R - B))

    the first gather waiting with nothing before it, the last reduction with nothing after it, and each
    layer's traffic beyond its own compute. The rest of the overlappable traffic (gathers and reductions
    outside the loop, the loop's hidden part) hides behind the step's compute as far as it lasts; what is
    left over is exposed too. The hidden part slows the compute beside it by ``slowdown`` of its length
    (`OVERLAP_SLOWDOWN`: NCCL's kernels occupy some of the SMs and memory bandwidth the products use).

    Traffic on different links runs at once: a host's NVLink and its network adapters are separate wires, and
    collectives of different groups (a tensor-parallel all-reduce inside the host, a data-parallel reduction
    across hosts) run as separate NCCL kernels on their own streams, each at its own link's speed. So the
    traffic left over beyond the compute is what the busiest link class carries beyond it, not the sum of
    both classes' (``by_link``; the loop's exposed part shared between the classes as their loop traffic is).

    Args:
      cost: The device's `Cost` (its FLOPs split forward and backward).
      compute: Seconds of compute of the step.
      loop_gathers: Seconds of the loop's weight gathers (forward and backward together).
      loop_reductions: Seconds of the loop's gradient reductions.
      other: Seconds of the other overlappable collectives.
      slowdown: Fraction of its own length a hidden collective adds to the compute beside it.
      by_link: Link class (``intra``, ``inter``; `link_classes`) -> ``(loop seconds, other seconds)`` of its
        overlappable collectives, which sum to ``loop_gathers + loop_reductions`` and ``other``; None: one class
        carries all of it.
      runs: The most executions of one layer-loop gather and of one layer-loop reduction (`CommTotals`); None:
        read from ``cost.comms``.
    """
    exposed = 0.0
    if loop_gathers or loop_reductions:
        if runs is None:
            n_g = max((c.count for c in cost.comms if c.layer_loop and c.kind == "all-gather"), default=0)
            n_r = max((c.count for c in cost.comms if c.layer_loop and c.kind != "all-gather"), default=0)
        else:
            n_g, n_r = runs
        executions = max(n_r or n_g / 2, 1)
        flops = cost.flops
        in_loop = flops.layers + flops.attention
        total = max(flops.total, 1.0)
        forward = compute * in_loop / 3 / total / executions
        backward = compute * (2 * in_loop / 3 + flops.recompute) / total / executions
        g = loop_gathers / n_g if n_g else 0.0  # one gather of one layer's weights
        g_back = g * max(n_g / executions - 1, 0.0)  # the backward pass's gathers of one layer (recomputes)
        r = loop_reductions / executions
        exposed = g + r + (executions - 1) * (max(0.0, g - forward) + max(0.0, g_back + r - backward))
        exposed = min(exposed, loop_gathers + loop_reductions)
    hidden = loop_gathers + loop_reductions + other - exposed
    loop = loop_gathers + loop_reductions
    if by_link:  # each class's hidden traffic: its own, less its share of the loop's exposed part
        busiest = max(ld + od - (exposed * ld / loop if loop else 0.0) for ld, od in by_link.values())
    else:
        busiest = hidden
    spill = max(0.0, busiest - compute)
    return exposed + spill, slowdown * (hidden - spill)


def step_time(
    cost: Cost,
    hw: Hardware,
    links: Mapping[str, str],
    shares: Mapping[str, int] | None = None,
    overlaps: tuple[str, ...] = (),
    memo: dict | None = None,
) -> StepTime:
    """Step time of one device from its `Cost`.

    What overlaps with what: weight gathers and gradient reductions (`Comm.overlappable`) run beside the
    compute (`overlap`); tensor-parallel activations, pipeline sends and the reductions a pipeline runs after
    its loop wait on the compute and the compute on them, as meshwork's program runs them. ``overlaps`` names
    mesh axes whose critical-path collectives a run hides as well (a published run's own program:
    Megatron-core's ``--tp-comm-overlap`` splits each tensor-parallel product into chunks whose all-gather or
    reduce-scatter runs beside the next chunk's product; ``--overlap-grad-reduce`` starts each bucket's
    reduction as its gradients are ready; its interleaved 1F1B posts the stage sends beside the next
    microbatch's compute): those are priced as hidden behind the compute, with its contention.

    Args:
      cost: From `estimate` or `device_cost` (``backend="gpu"``).
      hw: The device (`Hardware`).
      links: Mesh axis -> ``intra``/``inter`` (`link_classes`).
      shares: Mesh axis -> positions inside one host (`host_shares`), for collectives across hosts
        (`comm_seconds`); None: one device per host.
      overlaps: Mesh axes whose collectives the run overlaps with compute although meshwork's program does not.
      memo: None, or a dict the caller keeps for one ``(hw, links, shares)``: the seconds of one execution of
        each collective (by kind, axes, group and bytes) and of each product shape, computed once for a search
        that prices many costs of one mesh on one kind. The figures are the same with or without it.

    Returns:
      The `StepTime` (seconds).
    """
    totals = comm_totals(cost.comms, hw, links, shares, overlaps, memo)
    return step_time_from(cost, hw, compute_seconds(cost, hw, memo), totals)


@dataclasses.dataclass(frozen=True)
class CommTotals:
    """The running sums `step_time` keeps over a cost's collectives, in their order (`comm_totals`): seconds
    on the critical path, overlappable, of those the layer loop's gathers and its reductions, and per kind;
    the overlappable seconds per link class, in the loop and outside it (`overlap`'s ``by_link``); and the
    most executions of one layer-loop gather and of one layer-loop reduction (`overlap`'s ``runs``).
    Carried from one list of collectives into the next, they sum every collective in the same order as one
    list of both would, to the bit."""

    exposed: float = 0.0
    overlapped: float = 0.0
    gathers: float = 0.0
    reductions: float = 0.0
    by_kind: tuple[tuple[str, float], ...] = ()
    by_link: tuple[tuple[str, tuple[float, float]], ...] = ()
    gather_runs: float = 0
    reduction_runs: float = 0


def comm_totals(
    comms: Sequence[Comm],
    hw: Hardware,
    links: Mapping[str, str],
    shares: Mapping[str, int] | None = None,
    overlaps: tuple[str, ...] = (),
    memo: dict | None = None,
    start: CommTotals | None = None,
) -> CommTotals:
    """``start`` (None: nothing yet) with ``comms`` added one by one, as `step_time` sums a cost's collectives.

    Args:
      comms: The collectives (`Comm`), in the cost's order.
      hw, links, shares, overlaps, memo: As `step_time` takes them.
      start: The totals of the collectives before ``comms`` (a stage's split-independent part, to which a
        pipeline split's stored-row transfers are added: `sharding.costmodel.pipeline.StageBase`).

    Returns:
      The `CommTotals` (seconds).
    """
    start = start or CommTotals()
    exposed, overlapped, gathers, reductions = start.exposed, start.overlapped, start.gathers, start.reductions
    by_kind: dict[str, float] = dict(start.by_kind)
    by_link: dict[str, tuple[float, float]] = dict(start.by_link)  # link class -> (loop, other) seconds
    gather_runs, reduction_runs = start.gather_runs, start.reduction_runs
    for c in comms:
        if c.layer_loop and c.kind == "all-gather":
            gather_runs = max(gather_runs, c.count)
        elif c.layer_loop:
            reduction_runs = max(reduction_runs, c.count)
        if memo is None:
            seconds = comm_seconds(c, hw, links, shares)
        else:
            key = (c.kind, c.axes, c.group, c.result_bytes)
            seconds = c.count * _memoised(memo, key, _execution_seconds, c, hw, links, shares)
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + seconds
        if not c.overlappable and not any(a in overlaps for a in c.axes):
            exposed += seconds
            continue
        overlapped += seconds
        link = "inter" if any(links.get(a) == "inter" for a in c.axes) else "intra"
        in_loop, outside = by_link.get(link, (0.0, 0.0))
        by_link[link] = (in_loop + seconds, outside) if c.layer_loop else (in_loop, outside + seconds)
        if c.layer_loop and c.kind == "all-gather":
            gathers += seconds
        elif c.layer_loop:
            reductions += seconds
    return CommTotals(
        exposed,
        overlapped,
        gathers,
        reductions,
        tuple(by_kind.items()),
        tuple(by_link.items()),
        gather_runs,
        reduction_runs,
    )


def step_time_from(cost: Cost, hw: Hardware, compute: float, totals: CommTotals) -> StepTime:
    """`step_time` from its parts: ``cost``'s compute seconds (`compute_seconds`) and the totals of its
    collectives (`comm_totals`). Of ``cost`` it reads the parameters' bytes (the optimizer) and the FLOPs
    (`overlap`), never its collectives: a cost kept without them gives the same figures.

    Returns:
      The `StepTime` (seconds).
    """
    optimizer = 7 * cost.memory.parameters / (hw.memory_bandwidth * hw.memory_fraction)  # read 4, write 3
    other = totals.overlapped - totals.gathers - totals.reductions
    unhidden, contention = overlap(
        cost,
        compute,
        totals.gathers,
        totals.reductions,
        other,
        hw.overlap_slowdown,
        dict(totals.by_link),
        (totals.gather_runs, totals.reduction_runs),
    )
    total = compute + unhidden + contention + totals.exposed + optimizer
    return StepTime(
        compute, optimizer, totals.exposed, totals.overlapped, total, dict(totals.by_kind), unhidden, contention
    )
