"""Matrix products priced from their shapes: `Gemm` (one product, ``[m, k] x [k, n]``, and how often a step
runs it), `step_gemms` (the products of one device's step, from the model's description and the layout) and
`gemm_seconds` (the time of one product on a device kind).

How a GPU runs a product (the model `gemm_seconds` follows; CUTLASS's documentation, "Efficient GEMM in
CUDA", and NVIDIA's "Matrix Multiplication Background User's Guide", sections "Tile quantization" and "Wave
quantization"): the output ``[m, n]`` is cut into tiles of ``tile_m x tile_n`` (`Hardware.gemm_tile`), one
thread block per tile, one tile per SM at a time; the tiles run in waves of `Hardware.sm_count`. A tile
always costs a whole tile's ``2 tile_m tile_n k`` FLOPs (tile quantisation: a 130-row product pays for 256),
and the last wave costs a whole wave even when it holds one tile (wave quantisation). Each SM runs at its
share of the kind's tensor-core peak times the fraction large, well-shaped products reach on it
(`Hardware.gemm_fraction`: the best measured matmul over the datasheet peak, a burst at the boost clock)
times the fraction of that rate its tensor cores hold once a step's sustained load has brought the clock
down to what the power limit allows (`Hardware.sustained_fraction`, a measured ratio of throughputs). A
product whose arithmetic intensity (FLOPs per byte of ``A``, ``B`` and ``C`` in the compute dtype) is below
the device's FLOP/s-to-bandwidth ratio waits on HBM instead: its time is the larger of the two (a roofline, Williams,
Waterman and Patterson, CACM 2009). A product with fewer tiles than SMs has its ``k`` split over the idle SMs
(split-K, CUTLASS's ``GemmSplitKParallel`` and cuBLAS's heuristics for such shapes), in slices of at least
`SPLIT_K_MIN`. Every product also pays one kernel launch (`GEMM_LAUNCH_SECONDS`).

Units: elements, FLOPs, seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

from sharding import axes as ax
from sharding.costmodel.stream import gradient_shares

#: Seconds every product costs beyond its work: the kernel's launch and its prologue/epilogue (a thread block
#: loads its first tiles before the tensor cores start, and writes its results after they stop). About 5
#: microseconds: the launch latency NVIDIA's CUDA Best Practices Guide gives for a kernel (order of
#: microseconds), plus one tile's pipeline fill; it matters only for products of a few hundred microseconds
#: or less (thin tensor splits of small models).
GEMM_LAUNCH_SECONDS = 5e-6

#: The shortest slice of ``k`` a split-K product gives one SM: a few of the main loop's 64-deep k-steps, so that
#: the partial sums' reduction stays small beside the slice's work.
SPLIT_K_MIN = 256


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One matrix product ``[m, k] x [k, n] -> [m, n]`` of a device's step.

    Attributes:
      m: Rows of the output (tokens for a forward product).
      n: Columns of the output.
      k: The contracted dimension.
      count: Executions per step (layers x microbatches x passes).
      what: What it computes (for reports), e.g. ``mlp.wi forward``.
    """

    m: float
    n: float
    k: float
    count: float
    what: str = ""

    @property
    def flops(self) -> float:
        """FLOPs per execution, ``2 m n k``."""
        return 2.0 * self.m * self.n * self.k


def gemm_seconds(g: Gemm, hw: Any, dtype_bytes: int = 2) -> float:
    """Seconds of one execution of ``g`` on the device ``hw`` (`sharding.costmodel.Hardware`).

    ``max(compute, memory) + GEMM_LAUNCH_SECONDS`` where compute is the waves of whole tiles at each SM's
    share of ``peak_flops x gemm_fraction x sustained_fraction`` and memory the bytes of ``A``, ``B`` and ``C``
    (``dtype_bytes`` each) at ``memory_bandwidth x memory_fraction`` (module docstring).

    Example (a hand check, tests/test_clock.py): an ``[8192, 8192] x [8192, 8192]`` bfloat16 product on an
    H100 SXM (132 SMs, tiles of 128 x 256): ``64 x 32 = 2,048`` tiles, 16 waves (15.5 rounded up), each
    ``2 x 128 x 256 x 8192`` FLOPs per SM at ``989e12 x 0.861 x 0.887 / 132`` FLOP/s.
    """
    if g.m <= 0 or g.n <= 0 or g.k <= 0:
        return 0.0
    tile_m, tile_n = hw.gemm_tile
    tiles = math.ceil(g.m / tile_m) * math.ceil(g.n / tile_n)
    waves = math.ceil(tiles / hw.sm_count)
    # fewer tiles than SMs: the library splits k over the idle SMs (split-K), in slices of at least SPLIT_K_MIN
    split = max(1, min(hw.sm_count // tiles, int(g.k // SPLIT_K_MIN))) if tiles < hw.sm_count else 1
    per_sm = hw.peak_flops * hw.gemm_fraction * hw.sustained_fraction / hw.sm_count
    compute = waves * 2.0 * tile_m * tile_n * (g.k / split) / per_sm
    memory = dtype_bytes * (g.m * g.k + g.k * g.n + g.m * g.n) / (hw.memory_bandwidth * hw.memory_fraction)
    return max(compute, memory) + GEMM_LAUNCH_SECONDS


def _compute_split(splits: Mapping[str, tuple[str, ...]], mesh: Mapping[str, int], logical: str | None) -> int:
    """How many ways the work of a logical axis is split (weights gathered over the axes that may split a batch
    do not split it, whatever the rules map ``batch`` to: `sharding.costmodel.flops._per_token_flops`)."""
    if logical is None:
        return 1
    return math.prod(mesh[a] for a in splits.get(logical, ()) if a not in ax.BATCH_MESH_AXES)


def step_gemms(
    model: Any,
    splits: Mapping[str, tuple[str, ...]],
    mesh: Mapping[str, int],
    tokens: float,
    layer_runs: float,
    forward_passes: Mapping[bool, float],
    head_tokens: float,
    head_runs: float,
    stream: int = 1,
    head_stream: int = 1,
) -> tuple[Gemm, ...]:
    """The weight products of one device's step: forward, input gradient and weight gradient of each of the
    model's products (`sharding.modeldesc.Product`), and of the output projection.

    Shapes per execution, for a product of a weight ``[in, out]`` split ``in / a`` and ``out / b`` by the
    layout's non-batch axes: forward ``[t, in/a] x [in/a, out/b]``; input gradient ``[t, out/b] x
    [out/b, in/a]``; weight gradient ``[in/a, t] x [t, out/b]`` (the tokens ``t`` contracted: a product with
    few tokens per microbatch is a thin-``k`` product there). Where the residual stream is split ``n`` ways
    along ``embed`` (``stream``) the backward products take the split
    (`sharding.costmodel.stream.gradient_shares`): the weight gradient is ``[in/(a n), t] x [t, out/b]``
    (``embed`` the input) or ``[in/a, t] x [t, out/(b n)]`` (the output), and a product that contracts ``embed``
    has its input gradient ``[t, out/b] x [out/b, in/(a n)]``. A mixture of experts' product (``share`` < 1)
    runs on ``share x t`` rows per execution (the routed tokens, as if balanced).

    Args:
      model: The `sharding.modeldesc.ModelDescription`.
      splits: Logical axis -> mesh axes that split it (`sharding.costmodel.layout._model_splits`).
      mesh: Axis -> size.
      tokens: Token positions of one microbatch on this device (``_Shape.tok``).
      layer_runs: Layer executions per step (layers x microbatches; a pipeline's applications).
      forward_passes: ``recomputed`` flag -> forward executions per layer execution of products with that
        flag (1 without remat; 2 where the backward pass recomputes them).
      head_tokens: Tokens of one execution of the output projection.
      head_runs: Executions of the output projection per step.
      stream: The devices the residual stream is split over along ``embed``
        (`sharding.costmodel.stream.backward_split`); 1 where it is whole.
      head_stream: The same for the output projection's weight gradient
        (`sharding.costmodel.stream.head_backward_split`).

    Returns:
      The products (`Gemm`), with their executions per step.
    """
    out: list[Gemm] = []
    products, (v, h, head_share) = _local_shapes(model, splits, mesh, stream, head_stream)
    for k_in, n_out, share, recomputed, name, (d_in, w_in, w_out) in products:
        rows = tokens * share
        out.append(Gemm(rows, n_out, k_in, layer_runs * forward_passes[recomputed], f"{name} forward"))
        out.append(Gemm(rows, k_in * d_in, n_out, layer_runs, f"{name} input gradient"))
        out.append(Gemm(k_in * w_in, n_out * w_out, rows, layer_runs, f"{name} weight gradient"))
    if head_runs > 0:
        out.append(Gemm(head_tokens, v, h, head_runs, "logits forward"))
        out.append(Gemm(head_tokens, h, v, head_runs, "logits input gradient"))
        out.append(Gemm(h * head_share, v, head_tokens, head_runs, "logits weight gradient"))
    return tuple(g for g in out if g.count > 0)


def _local_shapes(
    model: Any, splits: Mapping[str, tuple[str, ...]], mesh: Mapping[str, int], stream: int = 1, head_stream: int = 1
) -> tuple:
    """``(products, (v, h, head))``: each product's local ``(in / a, out / b, share, recomputed, path, shares)``
    (``shares``: the input gradient's ``in`` share, the weight gradient's ``in`` and ``out`` shares on a stream
    split ``stream`` ways), the output projection's local vocabulary and width and its weight gradient's width
    share (``head_stream``), kept per model, splits, mesh and stream (`_shapes_of`): a search prices thousands
    of costs of one layout that differ only in tokens and executions."""
    return _shapes_of(model, tuple((k, tuple(v)) for k, v in splits.items()), tuple(mesh.items()), stream, head_stream)


@functools.lru_cache(maxsize=4096)
def _shapes_of(model: Any, split_items: tuple, mesh_items: tuple, stream: int, head_stream: int) -> tuple:
    splits, mesh = dict(split_items), dict(mesh_items)
    products = []
    for p in model.products:
        a = math.prod(_compute_split(splits, mesh, x) for x in p.in_axes)
        b = math.prod(_compute_split(splits, mesh, x) for x in p.out_axes)
        d_in, w = gradient_shares(p, stream)
        w_in, w_out = (w, 1.0) if ax.EMBED in p.in_axes else (1.0, w)
        products.append((p.in_size / a, p.out_size / b, p.share, p.recomputed, p.weight.path, (d_in, w_in, w_out)))
    logits = model.logits
    b = math.prod(_compute_split(splits, mesh, x) for x in logits.out_axes)
    return tuple(products), (logits.out_size / b, logits.in_size, gradient_shares(logits, head_stream, head=True)[1])


def attention_gemms(
    model: Any, splits: Mapping[str, tuple[str, ...]], mesh: Mapping[str, int], s: Any, runs: float, again: float
) -> tuple[Gemm, ...]:
    """The score and value products of an attention that materialises its scores (the reference einsum), per
    sequence and local head: forward ``Q K^T`` ``[t, d] x [d, k]`` and ``P V`` ``[t, k] x [k, d]``; backward
    ``dO V^T`` (``[t, d] x [d, k]``), ``P^T dO``, ``dS K`` and ``dS^T Q`` (each ``[., k or t] x [., d]``).
    With a head width ``d`` of 64-128 these are thin-``k`` products whose scores outweigh their inputs: their
    arithmetic intensity is about ``d`` FLOPs per byte, below an H100's ridge, so they run at the memory
    bandwidth (`gemm_seconds`).

    Args:
      model: The `sharding.modeldesc.ModelDescription`.
      splits: Logical axis -> mesh axes that split it.
      mesh: Axis -> size.
      s: The device's `sharding.costmodel.layout._Shape` (``rows``, ``tok``, ``seq``, ``keys``).
      runs: Layer executions per step.
      again: Extra forward executions per layer execution (remat, a pipeline's backward pass).
    """
    geometry = model.attention
    heads = geometry.num_heads / max(_compute_split(splits, mesh, geometry.heads_axis), 1)
    rows = max(s.rows, 1e-9)
    t = s.tok / rows
    keys = s.seq if s.keys is None else s.keys
    d = geometry.head_dim
    count = runs * rows * heads
    return (
        Gemm(t, keys, d, count * (2.0 + again), "attention scores (Q K^T, dO V^T)"),
        Gemm(t, d, keys, count * (4.0 + again), "attention values and gradients (P V, dS K, ...)"),
    )
