"""The flash attention kernels themselves: FlashAttention-2's forward (Dao 2023, Algorithm 1) and its two
backward kernels (Algorithm 2: dq, then dk/dv), their `pl.pallas_call` wrappers and the ``jax.custom_vjp``
that joins them over padded inputs.

Part of `models.kernels.flash_attention`, which validates the inputs, pads them and holds the public
functions; einsum letters and layout as there: B batch, T query length, S key/value length, N query heads,
K key/value heads, G = N // K, H head_dim; queries ``[B, T, N, H]``, keys and values ``[B, S, K, H]``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

from .flash_blocks import _MAX_FLOOR, _Config

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


def _mesh_axis_type(x):
    """x's manual-axis type inside `shard_map` (its varying mesh axes), else None."""
    return getattr(jax.typeof(x), "mat", None)


def _struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """Output shape for pallas_call, varying over the same mesh axes as `like` (needed when
    called inside `shard_map` with check_vma)."""
    axis_type = _mesh_axis_type(like)
    if axis_type is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=axis_type)


def _pallas_call(kernel, cfg: _Config, *, grid, in_specs, out_specs, out_shape, name, tile):
    """pallas_call with the Triton GPU backend requested explicitly when not interpreting.

    ``cfg.interpret`` None chooses by the platform the call is lowered for (`jax.lax.platform_dependent`):
    the interpreter on CPU, Triton elsewhere. So a CUDA lowering made on a CPU-only machine
    (``jax.export.export(..., platforms=["cuda"])``) carries the Triton kernels, not the interpreter, and
    only the chosen branch is lowered.
    """

    def build(interpret: bool):
        kwargs: dict[str, Any] = {}
        if not interpret:
            kwargs["compiler_params"] = pallas_triton.CompilerParams(
                num_warps=4 if tile <= 64 * 64 else 8, num_stages=2
            )
        return pl.pallas_call(
            functools.partial(kernel, cfg=cfg),
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            interpret=interpret,
            name=name,
            **kwargs,
        )

    if cfg.interpret is not None:
        return build(cfg.interpret)
    interpreted, compiled = build(True), build(False)
    return lambda *args: jax.lax.platform_dependent(*args, cpu=interpreted, default=compiled)


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
