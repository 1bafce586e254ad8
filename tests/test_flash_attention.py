"""Tests of the Pallas flash attention kernel (interpret mode on CPU) against the reference.

Each dimension is swept with the others at a base value (batch 1, 128 queries and keys,
8 heads, 2 kv heads, head_dim 64, causal, no segments, default tiles), plus a few combined
cases. float32 outputs and gradients must match the float32 reference within 1e-5 of the
reference's largest magnitude (plus 1e-6 of the output's, for gradients that cancel to ~0);
bfloat16 within 2e-2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# `models.kernels.flash_attention` the package attribute is the re-exported function; import
# names from the module itself.
from models.kernels.flash_attention import (
    _tile_counts,
    flash_attention,
    flash_attention_reference,
)
from models.kernels.flash_blocks import BlockSizes, _round_up

BASE = dict(batch=1, q_len=128, kv_len=128, heads=8, kv_heads=2, head_dim=64, causal=True, segments=0, blocks=None)
SMALL = BlockSizes(16, 16, 16, 16, 16, 16)
MIXED = BlockSizes(block_q=64, block_kv=32, block_q_dq=32, block_kv_dq=128, block_q_dkv=128, block_kv_dkv=16)


def _case(**overrides):
    return {**BASE, **overrides}


def _segment_ids(rng: np.random.Generator, batch: int, length: int, count: int) -> np.ndarray:
    """Packs each row into `count` contiguous segments with random boundaries."""
    ids = np.zeros((batch, length), np.int32)
    for row in ids:
        cuts = np.sort(rng.choice(np.arange(1, length), size=min(count, length) - 1, replace=False))
        for cut in cuts:
            row[cut:] += 1
    return ids


def _inputs(case, dtype=jnp.float32, seed=0):
    """q, k, v, cotangent and segment-id kwargs for a case."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    b, t, s = case["batch"], case["q_len"], case["kv_len"]
    q = jax.random.normal(keys[0], (b, t, case["heads"], case["head_dim"]), dtype)
    k = jax.random.normal(keys[1], (b, s, case["kv_heads"], case["head_dim"]), dtype)
    v = jax.random.normal(keys[2], (b, s, case["kv_heads"], case["head_dim"]), dtype)
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    kwargs = {"causal": case["causal"]}
    if case["segments"]:
        rng = np.random.default_rng(seed)
        q_ids = _segment_ids(rng, b, t, case["segments"])
        kv_ids = q_ids if s == t else _segment_ids(rng, b, s, case["segments"])
        kwargs.update(q_segment_ids=jnp.asarray(q_ids), kv_segment_ids=jnp.asarray(kv_ids))
    return q, k, v, d_out, kwargs


@functools.partial(jax.jit, static_argnums=(0,))
def _value_and_grads(fn, q, k, v, d_out):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(d_out.astype(out.dtype)))


class _Static:
    """Callable hashed by identity, for jit's static argument."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)


def _flash_and_reference(case, dtype=jnp.float32, seed=0):
    """(out, dq, dk, dv) of flash on dtype inputs and of the reference on their float32 copy."""
    q, k, v, d_out, kwargs = _inputs(case, dtype, seed)
    flash = _Static(lambda q, k, v: flash_attention(q, k, v, block_sizes=case["blocks"], **kwargs))
    reference = _Static(lambda q, k, v: flash_attention_reference(q, k, v, **kwargs))
    got = _value_and_grads(flash, q, k, v, d_out)
    want = _value_and_grads(reference, *(x.astype(jnp.float32) for x in (q, k, v)), d_out)
    return got, want


def _assert_close(got, want, rtol, names=("out", "dq", "dk", "dv")):
    """max |a - b| <= rtol * max |b| + atol for each array, with atol = rtol / 10 * max |out|.

    The small absolute term matters only for a gradient that is (close to) zero by
    cancellation, e.g. dq with a single key, where the kernel's delta = rowsum(dO * O) and
    the reference's softmax backward round differently at the 1e-7 level.
    """
    atol = rtol / 10 * float(np.max(np.abs(np.asarray(want[0], np.float32))))
    for name, a, b in zip(names, got, want):
        a = np.asarray(a, np.float32)
        b = np.asarray(b, np.float32)
        assert a.shape == b.shape, f"{name}: shape {a.shape} != {b.shape}"
        assert np.all(np.isfinite(a)), f"{name}: non-finite values"
        bound = rtol * float(np.max(np.abs(b))) + atol
        err = float(np.max(np.abs(a - b)))
        assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e} (rtol {rtol:g})"


def _check(case, dtype=jnp.float32, rtol=1e-5, seed=0):
    got, want = _flash_and_reference(case, dtype, seed)
    assert got[0].dtype == dtype
    _assert_close(got, want, rtol)


# ---------------------------------------------------------------------------------------
# Against the reference: one dimension at a time, then combined cases.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "q_len, kv_len",
    [(1, 1), (7, 7), (1000, 1000), (7, 128), (128, 7), (1, 1000), (1000, 130)],
)
def test_lengths(q_len, kv_len):
    _check(_case(q_len=q_len, kv_len=kv_len))


def test_long_length():
    _check(_case(q_len=2048, kv_len=2048, heads=2, kv_heads=1, blocks=BlockSizes()))


@pytest.mark.parametrize("kv_heads", [8, 2, 1])
def test_kv_heads(kv_heads):
    _check(_case(kv_heads=kv_heads))


@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_head_dim(head_dim):
    _check(_case(head_dim=head_dim))


@pytest.mark.parametrize("causal", [True, False])
def test_causal(causal):
    _check(_case(causal=causal, q_len=200, kv_len=200))


@pytest.mark.parametrize("segments, causal", [(1, True), (3, False), (5, True)])
def test_segments(segments, causal):
    _check(_case(segments=segments, causal=causal, q_len=300, kv_len=300))


@pytest.mark.parametrize("blocks", [SMALL, MIXED, BlockSizes()], ids=["small", "mixed", "default"])
def test_block_sizes(blocks):
    _check(_case(blocks=blocks, q_len=300, kv_len=200, segments=3))


def test_batch():
    _check(_case(batch=3, q_len=100, kv_len=100, segments=4))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(q_len=1000, kv_len=1000, kv_heads=1, head_dim=128, segments=5, blocks=MIXED),
        dict(q_len=2048, kv_len=1000, heads=2, kv_heads=2, causal=False, segments=2),
        dict(q_len=130, kv_len=2048, heads=4, kv_heads=1, head_dim=128, blocks=SMALL),
    ],
    ids=["gqa1-h128-segs-mixed", "long-noncausal-segs", "mqa-short-q-long-kv"],
)
def test_combined(overrides):
    _check(_case(**overrides))


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(q_len=1000, kv_len=1000, causal=False, segments=3, head_dim=128)],
    ids=["base", "long-segs"],
)
def test_bfloat16(overrides):
    _check(_case(**overrides), dtype=jnp.bfloat16, rtol=2e-2)


def test_custom_sm_scale():
    q, k, v, _, kwargs = _inputs(_case())
    got = flash_attention(q, k, v, sm_scale=0.3, **kwargs)
    want = flash_attention_reference(q, k, v, sm_scale=0.3, **kwargs)
    _assert_close([got], [want], 1e-5, names=("out",))


# ---------------------------------------------------------------------------------------
# Rows that attend nothing
# ---------------------------------------------------------------------------------------


def test_fully_masked_rows_are_zero_with_zero_gradients():
    """Queries whose segment has no keys, and causal rows before the first key (T > S)."""
    case = _case(q_len=100, kv_len=60, causal=True)
    q, k, v, d_out, _ = _inputs(case)
    q_ids = jnp.where(jnp.arange(100) < 90, 0, 7)[None].astype(jnp.int32)  # 7: no such key.
    kv_ids = jnp.zeros((1, 60), jnp.int32)

    def flash(q, k, v):
        return flash_attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, causal=True)

    def reference(q, k, v):
        return flash_attention_reference(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, causal=True)

    got = _value_and_grads(_Static(flash), q, k, v, d_out)
    want = _value_and_grads(_Static(reference), q, k, v, d_out)
    _assert_close(got, want, 1e-5)
    out, dq = np.asarray(got[0]), np.asarray(got[1])
    # Causal with T - S = 40: rows 0..39 see no key; rows 90..99 have no segment partner.
    for rows in (slice(0, 40), slice(90, 100)):
        assert np.all(out[:, rows] == 0.0)
        assert np.all(dq[:, rows] == 0.0)
    assert np.all(np.abs(out[:, 40:90]).max(axis=(0, 2, 3)) > 0)


# ---------------------------------------------------------------------------------------
# Causal tile skipping
# ---------------------------------------------------------------------------------------


def _visible_tiles(
    rows: int, cols: int, block_rows: int, block_cols: int, offset: int, transpose: bool = False
) -> np.ndarray:
    """Brute force: for each (row tile, col tile), whether any query i sees any key j,
    j <= i + offset, over the padded rows and columns the kernel works on."""
    i = np.arange(rows)[:, None]
    j = np.arange(cols)[None, :]
    visible = j <= i + offset
    tiles = visible.reshape(rows // block_rows, block_rows, cols // block_cols, block_cols)
    tiles = tiles.any(axis=(1, 3))
    return tiles.T if transpose else tiles


@pytest.mark.parametrize("q_len, kv_len", [(256, 256), (64, 256), (256, 64), (200, 120)])
def test_causal_tiles_above_the_diagonal_are_skipped(q_len, kv_len):
    blocks = BlockSizes(32, 16, 16, 32, 32, 16)
    case = _case(q_len=q_len, kv_len=kv_len, heads=4, kv_heads=2, head_dim=16)
    q, k, v, _, _ = _inputs(case)
    counts = _tile_counts(q, k, v, causal=True, block_sizes=blocks)
    q_pad, kv_pad = _round_up(q_len, 32), _round_up(kv_len, 32)
    offset = kv_len - q_len
    groups = case["heads"] // case["kv_heads"]

    fwd = _visible_tiles(q_pad, kv_pad, 32, 16, offset).sum(axis=1)  # per query tile
    dq = _visible_tiles(q_pad, kv_pad, 16, 32, offset).sum(axis=1)
    dkv = _visible_tiles(q_pad, kv_pad, 32, 16, offset).sum(axis=0) * groups  # per key tile
    for name, want, heads in (("forward", fwd, 4), ("dq", dq, 4), ("dkv", dkv, 2)):
        got = np.asarray(counts[name])
        np.testing.assert_array_equal(got, np.broadcast_to(want, (1, heads, want.size)), name)
    # The skipping is real: fewer tiles than the full grid.
    assert fwd.sum() < (q_pad // 32) * (kv_pad // 16)


def test_non_causal_computes_every_tile():
    case = _case(q_len=64, kv_len=96, heads=2, kv_heads=1, head_dim=16)
    q, k, v, _, _ = _inputs(case)
    counts = _tile_counts(q, k, v, causal=False, block_sizes=SMALL)
    assert np.all(np.asarray(counts["forward"]) == 96 // 16)
    assert np.all(np.asarray(counts["dq"]) == 96 // 16)
    assert np.all(np.asarray(counts["dkv"]) == 2 * 64 // 16)


# ---------------------------------------------------------------------------------------
# Validation errors
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_q=0), "BlockSizes.block_q must be a power of two >= 16"),
        (dict(block_kv=48), r"BlockSizes.block_kv must be a power of two >= 16 .*, got 48"),
        (dict(block_q_dq=8), r"BlockSizes.block_q_dq must be a power of two >= 16 .*, got 8"),
        (dict(block_kv_dkv=-64), "BlockSizes.block_kv_dkv must be a power of two"),
        (dict(block_q_dkv=64.0), "BlockSizes.block_q_dkv must be an int"),
        (dict(block_kv_dq=True), "BlockSizes.block_kv_dq must be an int"),
    ],
)
def test_bad_block_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockSizes(**kwargs)


def _zeros(*shape, dtype=np.float32):
    """A numpy array: validation needs only shapes and dtypes, and no JAX runs at import."""
    return np.zeros(shape, dtype)


@pytest.mark.parametrize(
    "q, k, v, kwargs, message",
    [
        (
            _zeros(1, 8, 6, 16),
            _zeros(1, 8, 4, 16),
            _zeros(1, 8, 4, 16),
            {},
            r"heads \(6\) must be a multiple of kv_heads \(4\)",
        ),
        (_zeros(8, 6, 16), _zeros(1, 8, 2, 16), _zeros(1, 8, 2, 16), {}, "q must have rank 4"),
        (_zeros(1, 8, 4, 16), _zeros(1, 8, 2, 16, 1), _zeros(1, 8, 2, 16), {}, "k must have rank 4"),
        (_zeros(1, 8, 4, 16), _zeros(1, 8, 2, 16), _zeros(1, 9, 2, 16), {}, "k and v must have the same shape"),
        (_zeros(2, 8, 4, 16), _zeros(1, 8, 2, 16), _zeros(1, 8, 2, 16), {}, "same batch size, got 2 and 1"),
        (_zeros(1, 8, 4, 32), _zeros(1, 8, 2, 16), _zeros(1, 8, 2, 16), {}, "same head_dim, got 32 and 16"),
        (
            _zeros(1, 8, 4, 16),
            _zeros(1, 8, 2, 16, dtype=jnp.bfloat16),
            _zeros(1, 8, 2, 16, dtype=jnp.bfloat16),
            {},
            "must have one dtype",
        ),
        (
            _zeros(1, 8, 4, 16, dtype=np.float16),
            _zeros(1, 8, 2, 16, dtype=np.float16),
            _zeros(1, 8, 2, 16, dtype=np.float16),
            {},
            "q must be float32 or bfloat16",
        ),
        (
            _zeros(1, 8, 4, 16),
            _zeros(1, 8, 2, 16),
            _zeros(1, 8, 2, 16),
            dict(q_segment_ids=_zeros(1, 8, dtype=np.int32)),
            "q_segment_ids was given without kv_segment_ids",
        ),
        (
            _zeros(1, 8, 4, 16),
            _zeros(1, 8, 2, 16),
            _zeros(1, 8, 2, 16),
            dict(kv_segment_ids=_zeros(1, 8, dtype=np.int32)),
            "kv_segment_ids was given without q_segment_ids",
        ),
        (
            _zeros(1, 8, 4, 16),
            _zeros(1, 5, 2, 16),
            _zeros(1, 5, 2, 16),
            dict(q_segment_ids=_zeros(1, 8, dtype=np.int32), kv_segment_ids=_zeros(1, 8, dtype=np.int32)),
            r"kv_segment_ids must have shape \[batch, length\] = \(1, 5\), got \(1, 8\)",
        ),
        (
            _zeros(1, 8, 4, 16),
            _zeros(1, 8, 2, 16),
            _zeros(1, 8, 2, 16),
            dict(q_segment_ids=_zeros(1, 8), kv_segment_ids=_zeros(1, 8)),
            "q_segment_ids must be an integer array",
        ),
        (
            _zeros(1, 8, 4, 16),
            _zeros(1, 8, 2, 16),
            _zeros(1, 8, 2, 16),
            dict(block_sizes=(64, 64)),
            "block_sizes must be a BlockSizes",
        ),
    ],
    ids=[
        "gqa-heads",
        "q-rank",
        "k-rank",
        "kv-shape",
        "batch",
        "head-dim",
        "dtype-mix",
        "dtype-f16",
        "kv-ids-missing",
        "q-ids-missing",
        "ids-shape",
        "ids-dtype",
        "block-sizes-type",
    ],
)
def test_validation_errors(q, k, v, kwargs, message):
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v, **kwargs)
    if "block_sizes" not in kwargs:  # The reference validates the same way.
        with pytest.raises(ValueError, match=message):
            flash_attention_reference(q, k, v, **kwargs)


# ---------------------------------------------------------------------------------------
# Use inside shard_map (per-device local arrays, no collectives)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_inside_shard_map(causal):
    """A pure per-device function: under shard_map (check_vma on), batch split over devices."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Auto,))
    case = _case(batch=len(devices), q_len=40, kv_len=40, heads=2, kv_heads=1, head_dim=16, segments=2)
    q, k, v, d_out, kwargs = _inputs(case)
    seg = P("data", None)
    qkv = P("data", None, None, None)

    def local(q, k, v, q_ids, kv_ids):
        return flash_attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, causal=causal)

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv, seg, seg), out_specs=qkv))
    ids = (kwargs["q_segment_ids"], kwargs["kv_segment_ids"])
    got = _value_and_grads(_Static(lambda q, k, v: sharded(q, k, v, *ids)), q, k, v, d_out)
    want = _value_and_grads(
        _Static(
            lambda q, k, v: flash_attention_reference(
                q, k, v, q_segment_ids=ids[0], kv_segment_ids=ids[1], causal=causal
            )
        ),
        q,
        k,
        v,
        d_out,
    )
    _assert_close(got, want, 1e-5)
