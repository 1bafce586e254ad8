"""FlashAttention-2 in Pallas: forward and backward, causal, grouped-query, packed documents.

Source: Tri Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning" (2023). The forward pass is Algorithm 1 (online softmax over key/value tiles,
one program per query tile, saving the log-sum-exp); the backward pass is Algorithm 2,
split into one kernel for dq (one program per query tile, looping over key tiles) and one
for dk/dv (one program per key tile, looping over query tiles), both recomputing the
probabilities from the saved log-sum-exp, with delta = rowsum(dO * O) precomputed
(Section 3.1.2). No `[q_length, kv_length]` array exists anywhere, forward or backward.

Einsum letters: B batch, T query length, S key/value length, N query heads, K key/value
heads, G = N // K query heads per key/value head, H head_dim.

Layout: queries `[B, T, N, H]`, keys and values `[B, S, K, H]`, as in the rest of meshwork;
the kernels read this layout directly (no transposes). Grouped-query attention maps query
head n to key/value head n // G in the BlockSpec index maps, so keys and values are never
repeated in memory.

Where it runs: with `interpret=True` (the default on a CPU backend) through the Pallas
interpreter; otherwise lowered with Pallas's Triton GPU backend, requested explicitly with
`jax.experimental.pallas.triton.CompilerParams` (jax >= 0.10 otherwise picks Mosaic GPU for a
plain `pl.pallas_call`; jax 0.12 warns that the Triton backend is deprecated). The kernels
keep to the portable Pallas subset: `pl.pallas_call`, `pl.BlockSpec`, `pl.program_id`, ref
indexing with `pl.ds`, `jax.lax.fori_loop`, whole-tile jnp ops and `lax.dot_general`.
float32 inputs use full-precision (IEEE, no TF32) dots; bfloat16 inputs use bfloat16
tensor-core dots with float32 accumulation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

# Running-max floor. Masked scores are -inf and the running max starts at this finite value,
# so exp(score - max) is exactly 0 for masked scores and never exp(-inf - -inf) = NaN.
_MAX_FLOOR = -1e30
# Smallest tile edge: Triton's tensor-core dots need M, N, K >= 16.
_MIN_BLOCK = 16
_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _is_power_of_two(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _next_power_of_two(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the three kernels, in tokens.

    Each must be a power of two and at least 16 (the Triton GPU lowering needs power-of-two
    tensor shapes and tensor-core dots of at least 16 x 16). A block larger than the
    (power-of-two rounded) sequence is clamped down to it, so short sequences are not padded
    to a full block. The field defaults are tuned for bfloat16 on an H200 (head_dim 128,
    causal); `BlockSizes.default_for(dtype)` is what `flash_attention` uses when given none.

    Attributes:
      block_q: query rows per forward program.
      block_kv: keys per forward inner-loop step.
      block_q_dq: query rows per dq program.
      block_kv_dq: keys per dq inner-loop step.
      block_q_dkv: query rows per dk/dv inner-loop step.
      block_kv_dkv: keys per dk/dv program.

    Raises:
      ValueError: at construction, naming the field, if a size is not an int, is not a power
        of two, or is below 16.
    """

    block_q: int = 128
    block_kv: int = 128
    block_q_dq: int = 64
    block_kv_dq: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"BlockSizes.{field.name} must be an int, got {value!r} ({type(value).__name__}).")
            if value < _MIN_BLOCK or not _is_power_of_two(value):
                raise ValueError(
                    f"BlockSizes.{field.name} must be a power of two >= {_MIN_BLOCK} "
                    f"(the GPU lowering needs power-of-two tiles of at least 16), got {value}."
                )

    @classmethod
    def default_for(cls, dtype) -> BlockSizes:
        """Default tiles for an input dtype `dtype`.

        bfloat16: the field defaults. float32: 64 x 64 forward tiles too, since float32 tiles
        take twice the registers and shared memory of bfloat16 ones and Triton compiles the
        full-precision (non-tensor-core) float32 dots slowly at larger tiles.
        """
        if jnp.dtype(dtype) == jnp.float32:
            return cls(block_q=64, block_kv=64)
        return cls()


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static (hashable) description of one attention call, after padding and clamping."""

    causal: bool
    sm_scale: float
    q_length: int  # T, real.
    kv_length: int  # S, real.
    q_padded: int  # T rounded up to every query block.
    kv_padded: int  # S rounded up to every key block.
    groups: int  # G = N // K.
    has_segments: bool
    block_q: int
    block_kv: int
    block_q_dq: int
    block_kv_dq: int
    block_q_dkv: int
    block_kv_dkv: int
    interpret: bool
    count_tiles: bool = False  # Debug: also return the number of tiles each program computed.
    # Valid lengths given at run time (`[2]` int32: real query rows, real keys): rows and keys at or past
    # them are padding, masked in every tile, and tiles holding only padding are not computed.
    has_lengths: bool = False

    def input_count(self, arrays: int) -> int:
        """Kernel inputs: ``arrays`` tensors, then segment ids and valid lengths where present."""
        return arrays + 2 * self.has_segments + 2 * self.has_lengths

    @property
    def causal_offset(self) -> int:
        """Query i may attend key j iff j <= i + causal_offset (last query sees last key)."""
        return self.kv_length - self.q_length

    @property
    def mask_kv_padding(self) -> bool:
        """Whether padded keys need masking. Causal masking already hides them from every
        real query row (j > i + S - T >= S for j >= S), so only non-causal calls need it."""
        return self.kv_padded != self.kv_length and not self.causal


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------


_EXPECTED_LAYOUT = {
    "q": "[batch, q_length, heads, head_dim]",
    "k": "[batch, kv_length, kv_heads, head_dim]",
    "v": "[batch, kv_length, kv_heads, head_dim]",
}


def _check_arrays(q, k, v) -> None:
    """Raises ValueError unless q, k, v have fitting ranks, shapes and dtypes."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 {_EXPECTED_LAYOUT[name]}, got shape {tuple(x.shape)}.")
        if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be float32 or bfloat16, got {x.dtype}.")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}.")
    batch, q_length, heads, head_dim = q.shape
    kv_batch, kv_length, kv_heads, kv_head_dim = k.shape
    if kv_batch != batch:
        raise ValueError(f"q and k must have the same batch size, got {batch} and {kv_batch}.")
    if kv_head_dim != head_dim:
        raise ValueError(f"q and k must have the same head_dim, got {head_dim} and {kv_head_dim}.")
    if min(q_length, kv_length, heads, kv_heads, head_dim) < 1:
        raise ValueError(f"Empty dimension: q shape {tuple(q.shape)}, k shape {tuple(k.shape)}.")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}) for grouped-query attention.")


def _check_segment_ids(q_segment_ids, kv_segment_ids, batch, q_length, kv_length) -> None:
    """Raises ValueError unless both or neither are given, integer, `[batch, length]`."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        given, missing = "q_segment_ids", "kv_segment_ids"
        if q_segment_ids is None:
            given, missing = missing, given
        raise ValueError(f"{given} was given without {missing}: pass both or neither.")
    if q_segment_ids is None:
        return
    for name, ids, length in (
        ("q_segment_ids", q_segment_ids, q_length),
        ("kv_segment_ids", kv_segment_ids, kv_length),
    ):
        if tuple(ids.shape) != (batch, length):
            raise ValueError(f"{name} must have shape [batch, length] = {(batch, length)}, got {tuple(ids.shape)}.")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {ids.dtype}.")


def _check_inputs(q, k, v, q_segment_ids, kv_segment_ids) -> None:
    """Raises ValueError with a readable message if the arguments do not fit together."""
    _check_arrays(q, k, v)
    _check_segment_ids(q_segment_ids, kv_segment_ids, q.shape[0], q.shape[1], k.shape[1])


def _clamp_block(block: int, length: int) -> int:
    """Shrinks a block to the power-of-two rounded length (at least 16)."""
    return min(block, max(_MIN_BLOCK, _next_power_of_two(length)))


def _make_config(
    q, k, *, causal, sm_scale, block_sizes, interpret, has_segments, count_tiles=False, has_lengths=False
) -> _Config:
    q_length, kv_length = q.shape[1], k.shape[1]
    qb = {f: _clamp_block(getattr(block_sizes, f), q_length) for f in ("block_q", "block_q_dq", "block_q_dkv")}
    kb = {f: _clamp_block(getattr(block_sizes, f), kv_length) for f in ("block_kv", "block_kv_dq", "block_kv_dkv")}
    return _Config(
        causal=bool(causal),
        sm_scale=float(sm_scale),
        q_length=q_length,
        kv_length=kv_length,
        # Block sizes are powers of two, so the largest is a multiple of the others.
        q_padded=_round_up(q_length, max(qb.values())),
        kv_padded=_round_up(kv_length, max(kb.values())),
        groups=q.shape[2] // k.shape[2],
        has_segments=has_segments,
        interpret=bool(interpret),
        count_tiles=count_tiles,
        has_lengths=has_lengths,
        **qb,
        **kb,
    )


# --------------------------------------------------------------------------------------
# Tile helpers shared by the kernels
# --------------------------------------------------------------------------------------


def _dot(a, b, contract: tuple[int, int]):
    """2-D dot with float32 accumulation; full float32 precision for float32 inputs."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _dot_nt(a, b):
    """a @ b.T: `[m, h] x [n, h] -> [m, n]`."""
    return _dot(a, b, (1, 1))


def _dot_nn(a, b):
    """a @ b: `[m, n] x [n, h] -> [m, h]`."""
    return _dot(a, b, (1, 0))


def _and(a, b):
    return b if a is None else jnp.logical_and(a, b)


def _tile_mask(cfg: _Config, q_idx, k_idx, q_seg, kv_seg, causal: bool, valid=None):
    """Which (query, key) pairs of a tile may attend; None when all may.

    Args:
      cfg: the call's config.
      q_idx, k_idx: int32 query and key positions, shaped to broadcast against each other
        (`[bq, 1]` and `[1, bk]`, or transposed).
      q_seg, kv_seg: segment ids with the same shapes as q_idx, k_idx, or None.
      causal: whether this tile may cross the causal diagonal.
      valid: the valid lengths `[2]` int32 (real query rows, real keys), or None.
    """
    mask = None
    if causal:
        mask = k_idx <= q_idx + cfg.causal_offset
    if cfg.mask_kv_padding:
        mask = _and(mask, k_idx < cfg.kv_length)
    if q_seg is not None:
        mask = _and(mask, q_seg == kv_seg)
    if valid is not None:
        q_valid, kv_valid = (lax.index_in_dim(valid, i, keepdims=False) for i in (0, 1))
        mask = _and(mask, (q_idx < q_valid) & (k_idx < kv_valid))
    return mask


def _lengths_of(valid):
    return None if valid is None else valid[0]


def _cdiv(a, b: int):
    return (a + b - 1) // b


def _split_refs(refs, cfg: _Config, arrays: int):
    """``(arrays' refs, q_seg_ref, kv_seg_ref, valid, outputs' refs)`` of a kernel's refs; ``valid`` is None, or
    with valid lengths ``(lengths [2], (first, end))``: the lengths and this program's tile range.

    Inside `shard_map` the Pallas interpreter runs the kernel's top level op by op and refuses an op that mixes
    device-varying values (the lengths) with invariant ones (program ids, constants); inside loops it does not
    look. So the range comes precomputed per program (`_tile_ranges`), the lengths are read whole, and both are
    only sliced at the top level; every comparison with them happens in the loops.
    """
    refs = list(refs)
    head, seg_refs = refs[:arrays], refs[arrays : arrays + 2 * cfg.has_segments]
    q_seg_ref, kv_seg_ref = seg_refs if cfg.has_segments else (None, None)
    valid = None
    if cfg.has_lengths:
        at = arrays + 2 * cfg.has_segments
        lengths, ranges = refs[at][...], refs[at + 1][...].reshape(2)
        valid = (lengths, (lax.index_in_dim(ranges, 0, keepdims=False), lax.index_in_dim(ranges, 1, keepdims=False)))
    return head, q_seg_ref, kv_seg_ref, valid, refs[cfg.input_count(arrays) :]


def _tile_ranges(cfg: _Config, lengths, block_q: int, block_kv: int, per: str):
    """Each program's tile range `[2, programs]` int32 (first, end) with valid lengths `[2]`: the causal range
    (`_kv_tile_range` or `_q_tile_range`) cut to the tiles holding a real row or key, empty for a program
    whose own tile holds only padding. ``per``: ``"q"`` (forward, dq: key tiles per query tile) or ``"kv"``
    (dk/dv: query tiles per key tile)."""
    if per == "q":
        starts = jnp.arange(cfg.q_padded // block_q, dtype=jnp.int32) * block_q
        _, end = _kv_tile_range(cfg, starts, block_q, block_kv)
        end = jnp.where(starts < lengths[0], jnp.minimum(end, _cdiv(lengths[1], block_kv)), 0)
        first = jnp.zeros_like(end)
    else:
        starts = jnp.arange(cfg.kv_padded // block_kv, dtype=jnp.int32) * block_kv
        first, _, end = _q_tile_range(cfg, starts, block_q, block_kv)
        end = jnp.where(starts < lengths[1], jnp.minimum(end, _cdiv(lengths[0], block_q)), 0)
        first = jnp.minimum(first, end)
    return jnp.stack([jnp.broadcast_to(first, starts.shape), end]).astype(jnp.int32)


def _kv_tile_range(cfg: _Config, q_start, block_q: int, block_kv: int):
    """Key tiles a query tile needs: `[0, full)` unmasked, `[full, end)` crossing the diagonal.

    Key tiles past `end` lie entirely above the causal diagonal and are never computed.
    `q_start` may be traced (from `pl.program_id`); all operands stay non-negative so integer
    division is floor division on every backend.
    """
    num_tiles = cfg.kv_padded // block_kv
    if not cfg.causal:
        return num_tiles, num_tiles
    offset = cfg.causal_offset
    # Last key visible to the tile's last row: q_start + block_q - 1 + offset.
    visible_keys = jnp.clip(q_start + block_q + offset, 0, num_tiles * block_kv)
    end = (visible_keys + block_kv - 1) // block_kv
    # A key tile is fully visible to the tile's first row iff its last key <= q_start + offset.
    full = jnp.minimum(jnp.maximum(q_start + offset + 1, 0) // block_kv, end)
    return full, end


def _q_tile_range(cfg: _Config, kv_start, block_q: int, block_kv: int):
    """Query tiles a key tile is seen by: `[start, full)` crossing the diagonal, `[full, end)`
    unmasked. Query tiles before `start` lie entirely above the diagonal and are skipped."""
    num_tiles = cfg.q_padded // block_q
    if not cfg.causal:
        return 0, 0, num_tiles
    offset = cfg.causal_offset
    # First row that sees key kv_start is kv_start - offset.
    start = jnp.minimum(jnp.maximum(kv_start - offset, 0) // block_q, num_tiles)
    # A query tile sees the whole key tile iff its first row + offset >= last key.
    full = jnp.maximum(kv_start + block_kv - 1 - offset, 0) + block_q - 1
    full = jnp.clip(full // block_q, start, num_tiles)
    return start, full, num_tiles


def _fori_loop(lower, upper, body, carry, zero):
    """`lax.fori_loop` over [lower, upper) that always traces to a while loop.

    With static bounds `lax.fori_loop` emits a scan, and the Pallas interpreter inside
    `shard_map` (check_vma=True) rejects scans that carry kernel refs ("Scan carry input and
    output got mismatched varying manual axes", jax 0.10-0.12). Adding `zero`, a traced 0
    (`pl.program_id(0) * 0`, taken at the kernel's top level), makes the bounds dynamic;
    Triton lowers either form to the same `scf.for`.
    """
    return lax.fori_loop(lower + zero, upper + zero, body, carry)


def _arange(n: int):
    return jnp.arange(n, dtype=jnp.int32)


def _heavy_first(program: Any, num_programs: int) -> Any:
    """Query tile of a forward/dq program: the last (with the most causal work) first, so
    the long programs start early and short ones fill the tail."""
    return num_programs - 1 - program


# --------------------------------------------------------------------------------------
# Forward kernel (Algorithm 1)
# --------------------------------------------------------------------------------------


def _forward_kernel(*refs, cfg: _Config):
    """One program: one query tile of one (batch, head); loops over the visible key tiles."""
    (q_ref, k_ref, v_ref), q_seg_ref, kv_seg_ref, valid, outs = _split_refs(refs, cfg, 3)
    o_ref, lse_ref = outs[:2]
    count_ref = outs[-1] if cfg.count_tiles else None
    bq, bk = cfg.block_q, cfg.block_kv

    q_start = _heavy_first(pl.program_id(0), cfg.q_padded // bq) * bq
    zero = pl.program_id(0) * 0  # Traced zero for _fori_loop.
    q = q_ref[...]  # [bq, H]
    q_idx = (q_start + _arange(bq))[:, None]
    q_seg = q_seg_ref[...][:, None] if cfg.has_segments else None

    def tile(j, carry, masked):
        m, l, acc, count = carry
        k_start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(k_start, bk), :]  # [bk, H]
        v = v_ref[pl.ds(k_start, bk), :]
        s = _dot_nt(q, k) * cfg.sm_scale  # [bq, bk] float32
        kv_seg = kv_seg_ref[pl.ds(k_start, bk)][None, :] if cfg.has_segments else None
        mask = _tile_mask(cfg, q_idx, (k_start + _arange(bk))[None, :], q_seg, kv_seg, masked, _lengths_of(valid))
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot_nn(p.astype(v.dtype), v)
        return m_new, l, acc, count + 1

    head_dim = q_ref.shape[-1]
    carry = (
        jnp.full((bq,), _MAX_FLOOR, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
        jnp.zeros((bq, head_dim), jnp.float32),
        jnp.int32(0),
    )
    full, end = _kv_tile_range(cfg, q_start, bq, bk)
    if valid is not None:  # every tile masked; tiles of padding only are skipped (`_tile_ranges`)
        carry = lax.fori_loop(*valid[1], functools.partial(tile, masked=cfg.causal), carry)
    else:
        # Unmasked tiles first, then the ones crossing the diagonal; tiles past `end` are skipped.
        carry = _fori_loop(0, full, functools.partial(tile, masked=False), carry, zero)
        if cfg.causal:
            carry = _fori_loop(full, end, functools.partial(tile, masked=True), carry, zero)
    m, l, acc, count = carry
    has_keys = l > 0  # False for rows that attend nothing: output 0, lse +inf.
    l_safe = jnp.where(has_keys, l, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has_keys, m + jnp.log(l_safe), jnp.inf)
    if count_ref is not None:
        count_ref[...] = jnp.full((1,), count, jnp.int32)


# --------------------------------------------------------------------------------------
# Backward kernels (Algorithm 2)
# --------------------------------------------------------------------------------------


def _dq_kernel(*refs, cfg: _Config):
    """One program: dq of one query tile of one (batch, head); loops over visible key tiles."""
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), q_seg_ref, kv_seg_ref, valid, outs = _split_refs(refs, cfg, 6)
    dq_ref = outs[0]
    count_ref = outs[-1] if cfg.count_tiles else None
    bq, bk = cfg.block_q_dq, cfg.block_kv_dq

    q_start = _heavy_first(pl.program_id(0), cfg.q_padded // bq) * bq
    zero = pl.program_id(0) * 0  # Traced zero for _fori_loop.
    q = q_ref[...]  # [bq, H]
    do = do_ref[...]  # [bq, H]
    lse = lse_ref[...][:, None]  # [bq, 1]
    delta = delta_ref[...][:, None]
    q_idx = (q_start + _arange(bq))[:, None]
    q_seg = q_seg_ref[...][:, None] if cfg.has_segments else None

    def tile(j, carry, masked):
        dq, count = carry
        k_start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(k_start, bk), :]
        v = v_ref[pl.ds(k_start, bk), :]
        p = jnp.exp(_dot_nt(q, k) * cfg.sm_scale - lse)  # [bq, bk]
        kv_seg = kv_seg_ref[pl.ds(k_start, bk)][None, :] if cfg.has_segments else None
        mask = _tile_mask(cfg, q_idx, (k_start + _arange(bk))[None, :], q_seg, kv_seg, masked, _lengths_of(valid))
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        dp = _dot_nt(do, v)  # [bq, bk]
        ds = p * (dp - delta)
        return dq + _dot_nn(ds.astype(k.dtype), k), count + 1

    carry = (jnp.zeros(q.shape, jnp.float32), jnp.int32(0))
    full, end = _kv_tile_range(cfg, q_start, bq, bk)
    if valid is not None:  # as the forward kernel
        carry = lax.fori_loop(*valid[1], functools.partial(tile, masked=cfg.causal), carry)
    else:
        carry = _fori_loop(0, full, functools.partial(tile, masked=False), carry, zero)
        if cfg.causal:
            carry = _fori_loop(full, end, functools.partial(tile, masked=True), carry, zero)
    dq, count = carry
    dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)
    if count_ref is not None:
        count_ref[...] = jnp.full((1,), count, jnp.int32)


def _dkv_kernel(*refs, cfg: _Config):
    """One program: dk, dv of one key tile of one (batch, kv head); loops over the G query
    heads of its group and their visible query tiles. Works on transposed scores `[bk, bq]`."""
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), q_seg_ref, kv_seg_ref, valid, outs = _split_refs(refs, cfg, 6)
    dk_ref, dv_ref = outs[:2]
    count_ref = outs[-1] if cfg.count_tiles else None
    bq, bk = cfg.block_q_dkv, cfg.block_kv_dkv

    k_start = pl.program_id(0) * bk  # Low key tiles, seen by the most query tiles, first.
    zero = pl.program_id(0) * 0  # Traced zero for _fori_loop.
    k = k_ref[...]  # [bk, H]
    v = v_ref[...]
    k_idx = (k_start + _arange(bk))[:, None]
    kv_seg = kv_seg_ref[...][:, None] if cfg.has_segments else None

    def tile(i, carry, masked, g):
        dk, dv, count = carry
        q_start = pl.multiple_of(i * bq, bq)
        q = q_ref[pl.ds(q_start, bq), g, :]  # [bq, H]
        do = do_ref[pl.ds(q_start, bq), g, :]
        lse = lse_ref[g, pl.ds(q_start, bq)][None, :]  # [1, bq]
        delta = delta_ref[g, pl.ds(q_start, bq)][None, :]
        p_t = jnp.exp(_dot_nt(k, q) * cfg.sm_scale - lse)  # [bk, bq]
        q_seg = q_seg_ref[pl.ds(q_start, bq)][None, :] if cfg.has_segments else None
        mask = _tile_mask(cfg, (q_start + _arange(bq))[None, :], k_idx, q_seg, kv_seg, masked, _lengths_of(valid))
        if mask is not None:
            p_t = jnp.where(mask, p_t, 0.0)
        dv = dv + _dot_nn(p_t.astype(do.dtype), do)
        ds_t = p_t * (_dot_nt(v, do) - delta)  # [bk, bq]
        dk = dk + _dot_nn(ds_t.astype(q.dtype), q)
        return dk, dv, count + 1

    start, full, end = _q_tile_range(cfg, k_start, bq, bk)

    def head(g, carry):
        body = functools.partial(tile, g=g)
        if valid is not None:  # every tile masked; tiles of padding only skipped (`_tile_ranges`)
            return lax.fori_loop(*valid[1], functools.partial(body, masked=cfg.causal), carry)
        if cfg.causal:
            carry = _fori_loop(start, full, functools.partial(body, masked=True), carry, zero)
        return _fori_loop(full, end, functools.partial(body, masked=False), carry, zero)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv, count = _fori_loop(0, cfg.groups, head, (zeros, zeros, jnp.int32(0)), zero)
    dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    if count_ref is not None:
        count_ref[...] = jnp.full((1,), count, jnp.int32)


# --------------------------------------------------------------------------------------
# pallas_call wrappers
# --------------------------------------------------------------------------------------


def _pallas_call(kernel, cfg: _Config, *, grid, in_specs, out_specs, out_shape, name, tile):
    """pallas_call with the Triton GPU backend requested explicitly when not interpreting."""
    kwargs: dict[str, Any] = {}
    if not cfg.interpret:
        from jax.experimental.pallas import triton as pallas_triton  # GPU only.

        kwargs["compiler_params"] = pallas_triton.CompilerParams(num_warps=4 if tile <= 64 * 64 else 8, num_stages=2)
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=cfg.interpret,
        name=name,
        **kwargs,
    )


def _count_spec_and_shape(cfg: _Config, grid, block_index):
    """Debug tile counts `[B, heads, tiles]`, one int32 per program."""
    if not cfg.count_tiles:
        return [], []
    num_blocks, batch, heads = grid
    spec = pl.BlockSpec((None, None, 1), lambda i, b, h: (b, h, block_index(i)))
    return [spec], [jax.ShapeDtypeStruct((batch, heads, num_blocks), jnp.int32)]  # Debug only.


def _segment_specs(cfg: _Config, q_block: int | None, kv_block: int | None, block_index):
    """Specs for [B, T] and [B, S] segment ids: a tile (block given) or the whole row."""
    if not cfg.has_segments:
        return []
    if q_block is None:
        q_spec = pl.BlockSpec((None, cfg.q_padded), lambda i, b, h: (b, 0))
    else:
        q_spec = pl.BlockSpec((None, q_block), lambda i, b, h: (b, block_index(i)))
    if kv_block is None:
        kv_spec = pl.BlockSpec((None, cfg.kv_padded), lambda i, b, h: (b, 0))
    else:
        kv_spec = pl.BlockSpec((None, kv_block), lambda i, b, h: (b, block_index(i)))
    return [q_spec, kv_spec]


def _segments(q_seg, kv_seg):
    return [q_seg, kv_seg] if q_seg is not None else []


def _length_specs(cfg: _Config, block_index):
    """Specs of the valid lengths `[2]` int32 (whole in every program) and the tile ranges `[2, programs]`
    (`_tile_ranges`: each program its own column), where given."""
    if not cfg.has_lengths:
        return []
    return [pl.BlockSpec((2,), lambda *_: (0,)), pl.BlockSpec((2, 1), lambda i, b, h: (0, block_index(i)))]


def _lengths(cfg: _Config, lengths, block_q: int, block_kv: int, per: str):
    """The valid lengths and the programs' tile ranges, as `_length_specs` reads them."""
    return [] if lengths is None else [lengths, _tile_ranges(cfg, lengths, block_q, block_kv, per)]


def _forward(q, k, v, q_seg, kv_seg, cfg: _Config, lengths=None):
    """Runs the forward kernel on padded inputs.

    Returns:
      out `[B, Tp, N, Hp]` in q's dtype, lse `[B, N, Tp]` float32 (+inf for rows that attend
      nothing), and, with cfg.count_tiles, tiles computed per program `[B, N, Tp // block_q]`.
    """
    batch, q_len, heads, head_dim = q.shape
    bq, g = cfg.block_q, cfg.groups
    grid = (q_len // bq, batch, heads)
    block = functools.partial(_heavy_first, num_programs=grid[0])
    q_spec = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, n: (b, block(i), n, 0))
    kv_spec = pl.BlockSpec((None, cfg.kv_padded, None, head_dim), lambda i, b, n: (b, 0, n // g, 0))
    lse_spec = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, block(i)))
    count_specs, count_shapes = _count_spec_and_shape(cfg, grid, block)
    return _pallas_call(
        _forward_kernel,
        cfg,
        grid=grid,
        in_specs=[q_spec, kv_spec, kv_spec] + _segment_specs(cfg, bq, None, block) + _length_specs(cfg, block),
        out_specs=[q_spec, lse_spec] + count_specs,
        out_shape=[
            _struct(q.shape, q.dtype, like=q),
            _struct((batch, heads, q_len), jnp.float32, like=q),
        ]
        + count_shapes,
        name="flash_attention_forward",
        tile=bq * cfg.block_kv,
    )(q, k, v, *_segments(q_seg, kv_seg), *_lengths(cfg, lengths, bq, cfg.block_kv, "q"))


def _backward_dq(q, k, v, do, lse, delta, q_seg, kv_seg, cfg: _Config, lengths=None):
    """dq `[B, Tp, N, Hp]` (and tile counts `[B, N, Tp // block_q_dq]` with cfg.count_tiles)."""
    batch, q_len, heads, head_dim = q.shape
    bq, g = cfg.block_q_dq, cfg.groups
    grid = (q_len // bq, batch, heads)
    block = functools.partial(_heavy_first, num_programs=grid[0])
    q_spec = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, n: (b, block(i), n, 0))
    kv_spec = pl.BlockSpec((None, cfg.kv_padded, None, head_dim), lambda i, b, n: (b, 0, n // g, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, block(i)))
    count_specs, count_shapes = _count_spec_and_shape(cfg, grid, block)
    return _pallas_call(
        _dq_kernel,
        cfg,
        grid=grid,
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
        + _segment_specs(cfg, bq, None, block)
        + _length_specs(cfg, block),
        out_specs=[q_spec] + count_specs,
        out_shape=[_struct(q.shape, q.dtype, like=q)] + count_shapes,
        name="flash_attention_dq",
        tile=bq * cfg.block_kv_dq,
    )(q, k, v, do, lse, delta, *_segments(q_seg, kv_seg), *_lengths(cfg, lengths, bq, cfg.block_kv_dq, "q"))


def _backward_dkv(q, k, v, do, lse, delta, q_seg, kv_seg, cfg: _Config, lengths=None):
    """dk, dv `[B, Sp, K, Hp]` (and tile counts `[B, K, Sp // block_kv_dkv]`)."""
    batch, kv_len, kv_heads, head_dim = k.shape
    bk, g = cfg.block_kv_dkv, cfg.groups
    grid = (kv_len // bk, batch, kv_heads)
    # A program sees all G query heads of its kv head h: query heads h*G .. h*G + G - 1.
    q_spec = pl.BlockSpec((None, cfg.q_padded, g, head_dim), lambda j, b, h: (b, 0, h, 0))
    kv_spec = pl.BlockSpec((None, bk, None, head_dim), lambda j, b, h: (b, j, h, 0))
    row_spec = pl.BlockSpec((None, g, cfg.q_padded), lambda j, b, h: (b, h, 0))
    count_specs, count_shapes = _count_spec_and_shape(cfg, grid, lambda j: j)
    return _pallas_call(
        _dkv_kernel,
        cfg,
        grid=grid,
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
        + _segment_specs(cfg, None, bk, lambda j: j)
        + _length_specs(cfg, lambda j: j),
        out_specs=[kv_spec, kv_spec] + count_specs,
        out_shape=[_struct(k.shape, k.dtype, like=k), _struct(v.shape, v.dtype, like=v)] + count_shapes,
        name="flash_attention_dkv",
        tile=bk * cfg.block_q_dkv,
    )(q, k, v, do, lse, delta, *_segments(q_seg, kv_seg), *_lengths(cfg, lengths, cfg.block_q_dkv, bk, "kv"))


def _row_delta(out, d_out):
    """delta = rowsum(dO * O) `[B, N, Tp]` float32 (FlashAttention-2, Algorithm 2, line 4)."""
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)
    return jnp.transpose(delta, (0, 2, 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash_padded(q, k, v, q_seg, kv_seg, cfg: _Config):
    return _forward(q, k, v, q_seg, kv_seg, cfg)[0]


def _flash_padded_fwd(q, k, v, q_seg, kv_seg, cfg: _Config):
    out, lse = _forward(q, k, v, q_seg, kv_seg, cfg)[:2]
    return out, (q, k, v, q_seg, kv_seg, out, lse)


def _flash_padded_bwd(cfg: _Config, residuals, d_out):
    q, k, v, q_seg, kv_seg, out, lse = residuals
    delta = _row_delta(out, d_out)
    dq = _backward_dq(q, k, v, d_out, lse, delta, q_seg, kv_seg, cfg)[0]
    dk, dv = _backward_dkv(q, k, v, d_out, lse, delta, q_seg, kv_seg, cfg)[:2]
    return dq, dk, dv, None, None


_flash_padded.defvjp(_flash_padded_fwd, _flash_padded_bwd)


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def _pad_axis(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _mesh_axis_type(x):
    """x's manual-axis type inside `shard_map` (its varying mesh axes), else None."""
    return getattr(jax.typeof(x), "mat", None)


def _vary_alike(*arrays):
    """Inside `shard_map` (with check_vma), makes all arrays vary over the union of their
    varying mesh axes (`lax.pcast`), so the kernels' outputs can carry one type. A no-op for
    the usual case of equally sharded inputs, and outside `shard_map`."""
    present = [x for x in arrays if x is not None]
    types = [_mesh_axis_type(x) for x in present]
    if any(t is None for t in types):
        return arrays
    union = frozenset().union(*(t.varying for t in types))
    return tuple(
        x
        if x is None or _mesh_axis_type(x).varying == union
        else lax.pcast(x, tuple(sorted(union - _mesh_axis_type(x).varying)), to="varying")
        for x in arrays
    )


def _struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """Output shape for pallas_call, varying over the same mesh axes as `like` (needed when
    called inside `shard_map` with check_vma)."""
    axis_type = _mesh_axis_type(like)
    if axis_type is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=axis_type)


def _valid_lengths(q, k, q_valid_length, kv_valid_length):
    """The kernels' valid lengths `[2]` int32 (a missing one: the whole length), or None when neither is given."""
    if q_valid_length is None and kv_valid_length is None:
        return None
    q_valid = q.shape[1] if q_valid_length is None else q_valid_length
    kv_valid = k.shape[1] if kv_valid_length is None else kv_valid_length
    return jnp.stack([jnp.asarray(q_valid, jnp.int32), jnp.asarray(kv_valid, jnp.int32)])


def _prepare(
    q,
    k,
    v,
    q_segment_ids,
    kv_segment_ids,
    *,
    causal,
    sm_scale,
    block_sizes,
    interpret,
    count_tiles=False,
    q_valid_length=None,
    kv_valid_length=None,
):
    """Validates, builds the static config, and pads lengths and head_dim; also returns the valid lengths
    (`_valid_lengths`) last."""
    _check_inputs(q, k, v, q_segment_ids, kv_segment_ids)
    lengths = _valid_lengths(q, k, q_valid_length, kv_valid_length)
    if block_sizes is None:
        block_sizes = BlockSizes.default_for(q.dtype)
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}.")
    head_dim = q.shape[-1]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    has_segments = q_segment_ids is not None
    cfg = _make_config(
        q,
        k,
        causal=causal,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        interpret=interpret,
        has_segments=has_segments,
        count_tiles=count_tiles,
        has_lengths=lengths is not None,
    )
    # Triton loads need a power-of-two head_dim; zero columns change neither q.k nor p.v.
    head_padded = max(_MIN_BLOCK, _next_power_of_two(head_dim))
    q = _pad_axis(_pad_axis(q, 1, cfg.q_padded), 3, head_padded)
    k = _pad_axis(_pad_axis(k, 1, cfg.kv_padded), 3, head_padded)
    v = _pad_axis(_pad_axis(v, 1, cfg.kv_padded), 3, head_padded)
    if has_segments:
        # Padded query rows are sliced off and padded keys are masked (see _Config), so the
        # pad value does not matter.
        q_segment_ids = _pad_axis(q_segment_ids.astype(jnp.int32), 1, cfg.q_padded)
        kv_segment_ids = _pad_axis(kv_segment_ids.astype(jnp.int32), 1, cfg.kv_padded)
    q, k, v, q_segment_ids, kv_segment_ids, lengths = _vary_alike(q, k, v, q_segment_ids, kv_segment_ids, lengths)
    return q, k, v, q_segment_ids, kv_segment_ids, cfg, lengths


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = False,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Multi-head attention with FlashAttention-2 Pallas kernels, differentiable.

    softmax(sm_scale * q k^T + mask) v, computed tile by tile (Dao 2023, Algorithm 1), with a
    custom VJP whose dq and dk/dv kernels recompute the probabilities from the saved
    log-sum-exp (Algorithm 2). Memory is linear in the lengths. A pure per-device function
    (no collectives, no global state): call it inside `shard_map` on local arrays.

    Args:
      q: queries `[batch, q_length, heads, head_dim]`, float32 or bfloat16.
      k: keys `[batch, kv_length, kv_heads, head_dim]`, same dtype; `heads` must be a
        multiple of `kv_heads` (grouped-query / multi-query attention: query head n uses
        kv head n // (heads // kv_heads); keys are not repeated in memory).
      v: values, same shape and dtype as k.
      q_segment_ids: int `[batch, q_length]`; a query attends only keys of its segment.
      kv_segment_ids: int `[batch, kv_length]`; give both segment ids or neither.
      causal: query i may attend key j iff j <= i + kv_length - q_length (the last query is
        aligned with the last key). Key tiles entirely above the diagonal are skipped.
      sm_scale: score scale; default 1 / sqrt(head_dim).
      block_sizes: tile sizes, default `BlockSizes.default_for(q.dtype)`. Lengths need not be
        multiples: inputs are padded inside and the padding is masked and sliced off.
      interpret: run the Pallas interpreter; None means True on a CPU default backend, else
        False (Triton GPU lowering).

    Returns:
      `[batch, q_length, heads, head_dim]` in q's dtype (float32 accumulation). A query row
      that may attend no key outputs 0 and gets zero gradients.

    Raises:
      ValueError: on wrong ranks, mismatched shapes or dtypes, heads not a multiple of
        kv_heads, only one of the segment ids, or bad block sizes.
    """
    q_length, head_dim = q.shape[1], q.shape[-1]
    q_p, k_p, v_p, q_seg, kv_seg, cfg, _ = _prepare(
        q,
        k,
        v,
        q_segment_ids,
        kv_segment_ids,
        causal=causal,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    out = _flash_padded(q_p, k_p, v_p, q_seg, kv_seg, cfg)
    return out[:, :q_length, :, :head_dim]


def flash_attention_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = False,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    q_valid_length: jax.Array | int | None = None,
    kv_valid_length: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The forward kernel alone: the output and its log-sum-exp, for blockwise callers.

    Runs the same kernel as `flash_attention` (Dao 2023, Algorithm 1) and also returns the
    log-sum-exp of each query row's scores, so a caller that splits the keys into blocks
    (ring attention, Liu et al. 2023) can merge partial outputs: with `(o_a, lse_a)` and
    `(o_b, lse_b)` from two disjoint key blocks, the output over both is
    `(exp(lse_a) o_a + exp(lse_b) o_b) / (exp(lse_a) + exp(lse_b))`. Not differentiable:
    pair it with `flash_attention_backward`.

    Args:
      q: queries `[batch, q_length, heads, head_dim]`, float32 or bfloat16.
      k, v: keys and values `[batch, kv_length, kv_heads, head_dim]`, same dtype.
      q_segment_ids, kv_segment_ids: int `[batch, q_length]`, `[batch, kv_length]`, or None.
      causal, sm_scale, block_sizes, interpret: as `flash_attention`.
      q_valid_length, kv_valid_length: int32 scalars (may be traced: per device inside
        `shard_map`), or None for the whole length: query rows and keys at or past them are
        padding. Padding rows attend nothing and padding keys are attended by no row, and a
        tile holding only padding is not computed (uneven sequence shards pad equal-shaped
        blocks). The causal mask still counts padded positions.

    Returns:
      `(out, lse)`: out `[batch, q_length, heads, head_dim]` in q's dtype (0 for rows that
      attend no key); lse `[batch, heads, q_length]` float32, the natural log of
      `sum_j exp(sm_scale * q.k_j)` over the keys the row may attend, -inf for rows that
      attend none.

    Raises:
      ValueError: as `flash_attention`.
    """
    q_length, head_dim = q.shape[1], q.shape[-1]
    q_p, k_p, v_p, q_seg, kv_seg, cfg, lengths = _prepare(
        q,
        k,
        v,
        q_segment_ids,
        kv_segment_ids,
        causal=causal,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        interpret=interpret,
        q_valid_length=q_valid_length,
        kv_valid_length=kv_valid_length,
    )
    out, lse = _forward(q_p, k_p, v_p, q_seg, kv_seg, cfg, lengths)[:2]
    lse = lse[:, :, :q_length]
    # The kernel marks empty rows +inf (so exp(s - lse) = 0 in its backward); log 0 is -inf.
    lse = jnp.where(lse == jnp.inf, -jnp.inf, lse)
    return out[:, :q_length, :, :head_dim], lse


def flash_attention_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = False,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    q_valid_length: jax.Array | int | None = None,
    kv_valid_length: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The backward kernels alone: gradients through one key/value block of a softmax row.

    Runs the dq and dk/dv kernels of `flash_attention` (Dao 2023, Algorithm 2) with the
    probabilities recomputed as `exp(sm_scale * q.k - lse)` and `delta = rowsum(d_out * out)`.
    When `out` and `lse` belong to the whole row (all key blocks, merged) and `k`, `v` are
    one block of its keys, the results are that block's exact share of the gradients: dq
    summed over the blocks is the full dq, and dk, dv are the block's full gradients. With
    the output and log-sum-exp of `flash_attention_forward` on the same keys it is the
    ordinary backward pass.

    Args:
      q: queries `[batch, q_length, heads, head_dim]`, float32 or bfloat16.
      k, v: one block of keys and values `[batch, kv_length, kv_heads, head_dim]`.
      out: the row's attention output `[batch, q_length, heads, head_dim]`.
      lse: the row's log-sum-exp `[batch, heads, q_length]` float32 (-inf or +inf: the row
        attends no key and gets zero gradients).
      d_out: cotangent of `out`, `[batch, q_length, heads, head_dim]`.
      q_segment_ids, kv_segment_ids, causal, sm_scale, block_sizes, interpret: as
        `flash_attention`, describing this block's mask.
      q_valid_length, kv_valid_length: as `flash_attention_forward`; padding rows and keys
        get zero gradients.

    Returns:
      `(dq, dk, dv)` shaped and typed like q, k, v.

    Raises:
      ValueError: as `flash_attention`, or when out, d_out or lse do not fit q.
    """
    batch, q_length, heads, head_dim = q.shape
    kv_length = k.shape[1]
    for name, x in (("out", out), ("d_out", d_out)):
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}.")
    if tuple(lse.shape) != (batch, heads, q_length):
        raise ValueError(
            f"lse must have shape [batch, heads, q_length] = {(batch, heads, q_length)}, got {tuple(lse.shape)}."
        )
    q_p, k_p, v_p, q_seg, kv_seg, cfg, lengths = _prepare(
        q,
        k,
        v,
        q_segment_ids,
        kv_segment_ids,
        causal=causal,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        interpret=interpret,
        q_valid_length=q_valid_length,
        kv_valid_length=kv_valid_length,
    )
    head_padded = q_p.shape[-1]
    out_p = _pad_axis(_pad_axis(out.astype(q.dtype), 1, cfg.q_padded), 3, head_padded)
    do_p = _pad_axis(_pad_axis(d_out.astype(q.dtype), 1, cfg.q_padded), 3, head_padded)
    # +inf makes exp(s - lse) exactly 0: empty rows and padded rows contribute nothing.
    lse = jnp.where(jnp.isfinite(lse), lse.astype(jnp.float32), jnp.inf)
    lse_p = _pad_axis(lse, 2, cfg.q_padded, value=jnp.inf)
    q_p, k_p, v_p, q_seg, kv_seg, out_p, do_p, lse_p, lengths = _vary_alike(
        q_p, k_p, v_p, q_seg, kv_seg, out_p, do_p, lse_p, lengths
    )
    delta = _row_delta(out_p, do_p)
    dq = _backward_dq(q_p, k_p, v_p, do_p, lse_p, delta, q_seg, kv_seg, cfg, lengths)[0]
    dk, dv = _backward_dkv(q_p, k_p, v_p, do_p, lse_p, delta, q_seg, kv_seg, cfg, lengths)[:2]
    return (dq[:, :q_length, :, :head_dim], dk[:, :kv_length, :, :head_dim], dv[:, :kv_length, :, :head_dim])


def forward_tile_count(
    q_length: int,
    kv_length: int,
    *,
    causal: bool,
    block_sizes: BlockSizes | None = None,
    dtype=jnp.float32,
    q_valid_length: int | None = None,
    kv_valid_length: int | None = None,
) -> int:
    """Key/value tiles the forward kernel computes for one (batch, head), without running it.

    Sums, over the (padded) query tiles, the key-tile range each forward program loops over
    (`_kv_tile_range`, the kernel's own skipping rule: tiles entirely above the causal
    diagonal are not computed; with valid lengths `_tile_ranges`, which also skips tiles of
    padding only). Equal to `_tile_counts(...)["forward"]` summed over the query tiles of one
    (batch, head); for work-balance counts without device work.

    Args:
      q_length, kv_length: T and S, tokens.
      causal: the kernel's causal flag (last query aligned with the last key).
      block_sizes: as `flash_attention`; default `BlockSizes.default_for(dtype)`.
      dtype: the input dtype that picks the default tiles.
      q_valid_length, kv_valid_length: real query rows and keys (the rest padding), as
        `flash_attention_forward` takes them; None: every row or key is real.

    Returns:
      The number of `block_q x block_kv` tiles, an int.
    """
    if block_sizes is None:
        block_sizes = BlockSizes.default_for(dtype)
    q = jax.ShapeDtypeStruct((1, q_length, 1, _MIN_BLOCK), dtype)
    k = jax.ShapeDtypeStruct((1, kv_length, 1, _MIN_BLOCK), dtype)
    cfg = _make_config(q, k, causal=causal, sm_scale=1.0, block_sizes=block_sizes, interpret=True, has_segments=False)
    bq, bk = cfg.block_q, cfg.block_kv
    if q_valid_length is not None or kv_valid_length is not None:
        lengths = [q_length if q_valid_length is None else q_valid_length]
        lengths.append(kv_length if kv_valid_length is None else kv_valid_length)
        first, end = np.asarray(_tile_ranges(cfg, jnp.asarray(lengths, jnp.int32), bq, bk, "q"))
        return int(np.sum(end - first))
    total = 0
    for tile in range(cfg.q_padded // bq):
        _, end = _kv_tile_range(cfg, tile * bq, bq, bk)
        total += int(end)
    return total


def _tile_counts(
    q,
    k,
    v,
    *,
    causal=False,
    block_sizes=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    interpret=None,
    q_valid_length=None,
    kv_valid_length=None,
) -> dict[str, jax.Array]:
    """Debug: the number of tiles each program of each kernel computed.

    Runs the same kernels with a counter in their loop carry. Returns a dict with "forward"
    `[B, N, Tp // block_q]`, "dq" `[B, N, Tp // block_q_dq]` and "dkv"
    `[B, K, Sp // block_kv_dkv]` (summed over the G query heads) int32 counts.
    """
    q_p, k_p, v_p, q_seg, kv_seg, cfg, lengths = _prepare(
        q,
        k,
        v,
        q_segment_ids,
        kv_segment_ids,
        causal=causal,
        sm_scale=None,
        block_sizes=block_sizes,
        interpret=interpret,
        count_tiles=True,
        q_valid_length=q_valid_length,
        kv_valid_length=kv_valid_length,
    )
    out, lse, forward = _forward(q_p, k_p, v_p, q_seg, kv_seg, cfg, lengths)
    delta = _row_delta(out, out)
    dq = _backward_dq(q_p, k_p, v_p, out, lse, delta, q_seg, kv_seg, cfg, lengths)[1]
    dkv = _backward_dkv(q_p, k_p, v_p, out, lse, delta, q_seg, kv_seg, cfg, lengths)[2]
    return {"forward": forward, "dq": dq, "dkv": dkv}


def flash_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = False,
    sm_scale: float | None = None,
) -> jax.Array:
    """Plain attention with the same semantics as `flash_attention`, in float32.

    Materialises the `[batch, kv_heads, G, q_length, kv_length]` scores: for tests and small
    inputs only. Uses `einsum` with `Precision.HIGHEST`, a mask and softmax; rows that may
    attend no key output 0 (and get zero gradients).

    Args:
      q: `[batch, q_length, heads, head_dim]`, float32 or bfloat16.
      k, v: `[batch, kv_length, kv_heads, head_dim]`.
      q_segment_ids, kv_segment_ids: int `[batch, q_length]`, `[batch, kv_length]`, or None.
      causal: query i may attend key j iff j <= i + kv_length - q_length.
      sm_scale: default 1 / sqrt(head_dim).

    Returns:
      `[batch, q_length, heads, head_dim]` in q's dtype.

    Raises:
      ValueError: as `flash_attention`.
    """
    _check_inputs(q, k, v, q_segment_ids, kv_segment_ids)
    batch, q_length, heads, head_dim = q.shape
    kv_length, kv_heads = k.shape[1], k.shape[2]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    hi = lax.Precision.HIGHEST
    groups = heads // kv_heads
    q_grouped = q.astype(jnp.float32).reshape(batch, q_length, kv_heads, groups, head_dim)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q_grouped, k.astype(jnp.float32), precision=hi)
    scores = scores * sm_scale
    mask = None
    if causal:
        q_idx = jnp.arange(q_length)[:, None]
        k_idx = jnp.arange(kv_length)[None, :]
        mask = k_idx <= q_idx + (kv_length - q_length)  # [T, S]
    if q_segment_ids is not None:
        same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]  # [B, T, S]
        mask = _and(mask, same[:, None, None])
    if mask is not None:
        scores = jnp.where(mask, scores, _MAX_FLOOR)
    probs = jax.nn.softmax(scores, axis=-1)
    if mask is not None:
        probs = jnp.where(mask, probs, 0.0)  # Rows with no visible key: 0, not uniform.
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v.astype(jnp.float32), precision=hi)
    return out.reshape(batch, q_length, heads, head_dim).astype(q.dtype)
