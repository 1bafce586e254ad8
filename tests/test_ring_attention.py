"""Ring and all-to-all (Ulysses) attention against one-device reference attention.

Each kernel runs under `jax.shard_map` over a 1-D `sequence` mesh of P of the 8 simulated
CPU devices (Pallas in interpret mode), on inputs laid out as the data pipeline lays them
(`zigzag_permutation`), and its output is put back in natural order. Outputs and the
gradients of `sum(out * d_out)` with respect to q, k and v must match
`flash_attention_reference` (float32) within 1e-5 of the reference's largest magnitude.

Interpret mode is slow, so each dimension is swept with the others at a base value
(P = 4, causal, zigzag, no segment ids, 4 heads over 2 KV heads), plus a few combined cases.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from models.kernels.flash_attention import (
    _tile_counts,
    flash_attention_backward,
    flash_attention_forward,
    flash_attention_reference,
    forward_tile_count,
)
from models.kernels.flash_blocks import BlockSizes
from models.kernels.ring_attention import ring_attention, ring_tile_counts, uneven_zigzag_layout, zigzag_permutation
from models.kernels.ulysses_attention import kv_repeat, ulysses_attention
from models.kernels.usp_attention import usp_attention
from sharding.hlo import collectives, summarize

LENGTH, HEAD_DIM = 128, 32
BASE = dict(shards=4, causal=True, layout="zigzag", segments=False, heads=4, kv_heads=2)
TILES = BlockSizes(16, 16, 16, 16, 16, 16)  # several tiles per block even at P = 8


def _case(**overrides):
    return {**BASE, **overrides}


def _segment_ids(length: int, seed: int) -> np.ndarray:
    """[2, length] ids: row 0 packs 5 documents at random cuts, row 1 is one document."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, length), size=4, replace=False))
    row = np.searchsorted(cuts, np.arange(length), side="right").astype(np.int32)
    return np.stack([row, np.zeros(length, np.int32)])


def _inputs(case, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (2, LENGTH, case["heads"], HEAD_DIM), dtype)
    k = jax.random.normal(keys[1], (2, LENGTH, case["kv_heads"], HEAD_DIM), dtype)
    v = jax.random.normal(keys[2], (2, LENGTH, case["kv_heads"], HEAD_DIM), dtype)
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    segments = jnp.asarray(_segment_ids(LENGTH, seed)) if case["segments"] else None
    return q, k, v, d_out, segments


def _sequence_mesh(shards: int):
    return jax.make_mesh((shards,), ("sequence",), axis_types=(AxisType.Auto,), devices=jax.devices()[:shards])


def _context_parallel(kernel, case):
    """`f(q, k, v, segments)` on natural-order global arrays, run sequence-parallel."""
    shards, layout = case["shards"], case["layout"]
    perm = zigzag_permutation(LENGTH, shards) if layout == "zigzag" else np.arange(LENGTH)
    natural = np.argsort(perm)
    tokens, ids = P(None, "sequence", None, None), P(None, "sequence")

    def local(q, k, v, segments):
        return kernel(
            q,
            k,
            v,
            axis_name="sequence",
            q_segment_ids=segments,
            kv_segment_ids=segments,
            causal=case["causal"],
            layout=layout,
            block_sizes=TILES,
        )

    mesh = _sequence_mesh(shards)

    def run(q, k, v, segments):
        if segments is None:
            sharded = jax.shard_map(
                lambda q, k, v: local(q, k, v, None), mesh=mesh, in_specs=(tokens,) * 3, out_specs=tokens
            )
            return sharded(q[:, perm], k[:, perm], v[:, perm])[:, natural]
        sharded = jax.shard_map(local, mesh=mesh, in_specs=(tokens,) * 3 + (ids,), out_specs=tokens)
        return sharded(q[:, perm], k[:, perm], v[:, perm], segments[:, perm])[:, natural]

    return run


def _value_and_grads(fn, q, k, v, d_out, segments):
    def loss(q, k, v):
        out = fn(q, k, v, segments)
        return jnp.sum(out * d_out), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return (out, *grads)


def _reference(causal):
    def fn(q, k, v, segments):
        return flash_attention_reference(q, k, v, q_segment_ids=segments, kv_segment_ids=segments, causal=causal)

    return fn


def _assert_close(got, want, rtol=1e-5):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        err, scale = float(jnp.max(jnp.abs(a - b))), float(jnp.max(jnp.abs(b)))
        assert err <= rtol * scale, f"{name}: max error {err:.3g} > {rtol} x {scale:.3g}"


def _check(kernel, case, dtype=jnp.float32, rtol=1e-5):
    q, k, v, d_out, segments = _inputs(case, dtype=dtype)
    got = _value_and_grads(_context_parallel(kernel, case), q, k, v, d_out, segments)
    as_f32 = lambda x: x.astype(jnp.float32)
    want = _value_and_grads(_reference(case["causal"]), as_f32(q), as_f32(k), as_f32(v), d_out, segments)
    _assert_close(got, want, rtol)


# --------------------------------------------------------------------------------------
# Ring attention
# --------------------------------------------------------------------------------------

RING_CASES = [
    _case(),
    _case(shards=2),
    _case(shards=8),
    _case(causal=False),
    _case(layout="contiguous"),
    _case(segments=True),
    _case(kv_heads=4),
    # combined
    _case(shards=8, layout="contiguous", segments=True, heads=2, kv_heads=1),
    _case(shards=2, causal=False, segments=True, kv_heads=4),
]


@pytest.mark.parametrize(
    "case", RING_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if BASE[k] != v) or "base"
)
def test_ring_attention_matches_the_reference(case):
    _check(ring_attention, case)


def test_ring_attention_in_bfloat16():
    """bfloat16 inputs (float32 merge and gradient accumulation) against the float32
    reference on the same rounded inputs, within 2e-2 as the flash kernel's bfloat16 tests."""
    _check(ring_attention, _case(segments=True), dtype=jnp.bfloat16, rtol=2e-2)


def test_ring_transfers_each_key_value_block_p_minus_1_times_per_pass():
    """Collective-permute bytes of the compiled ring (Liu et al. 2023: one hop per step):
    forward, (P-1)/P of k and v; forward+backward adds (P-1)/P of k, v and of their float32
    gradients, less the backward's first k, v transfer where XLA reuses the forward's."""
    shards = 4
    case = _case(shards=shards)
    q, k, v, d_out, _ = _inputs(case)
    mesh = _sequence_mesh(shards)
    tokens = jax.sharding.NamedSharding(mesh, P(None, "sequence", None, None))
    q, k, v, d_out = (jax.device_put(x, tokens) for x in (q, k, v, d_out))
    ring = jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, axis_name="sequence", causal=True, layout="zigzag", block_sizes=TILES),
        mesh=mesh,
        in_specs=(tokens.spec,) * 3,
        out_specs=tokens.spec,
    )

    def permute_bytes(fn, *args):
        found = summarize(collectives(jax.jit(fn).lower(*args).compile().as_text()))
        return found.get("collective-permute", (0, 0))[1]

    kv_bytes = 2 * k.size * 4 // shards  # one device's k and v, float32
    assert permute_bytes(ring, q, k, v) == (shards - 1) * kv_bytes
    grad = jax.grad(lambda q, k, v, d_out: jnp.sum(ring(q, k, v) * d_out), argnums=(0, 1, 2))
    both = permute_bytes(grad, q, k, v, d_out)
    analytic = (shards - 1) * (kv_bytes + 2 * kv_bytes)
    assert analytic - kv_bytes <= both <= analytic


# --------------------------------------------------------------------------------------
# All-to-all (Ulysses) attention
# --------------------------------------------------------------------------------------

# All-to-all splits query heads over P: 8 heads over 4 KV heads at the base P = 4. With fewer KV
# heads than devices each KV head is repeated r = P / gcd(K, P) times (kv_heads 1, 2, 4 at P = 8).
ULYSSES_CASES = [
    _case(heads=8, kv_heads=4),
    _case(heads=8, kv_heads=4, shards=2),
    _case(heads=8, kv_heads=8, shards=8),
    _case(heads=8, kv_heads=4, causal=False, segments=True),
    _case(heads=8, kv_heads=4, layout="contiguous", segments=True),
    _case(heads=8, kv_heads=1, shards=8, segments=True),
    _case(heads=8, kv_heads=2, shards=8, segments=True),
    _case(heads=8, kv_heads=4, shards=8, segments=True, layout="contiguous"),
    _case(heads=4, kv_heads=2, shards=4, segments=True),
    _case(heads=12, kv_heads=6, shards=4),  # neither of K, P divides the other: r = 2, 12 heads over 4
]


@pytest.mark.parametrize(
    "case", ULYSSES_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if BASE[k] != v) or "base"
)
def test_ulysses_attention_matches_the_reference(case):
    _check(ulysses_attention, case)


@pytest.mark.parametrize(
    "kv_heads, shards, repeat", [(8, 8, 1), (16, 8, 1), (4, 8, 2), (2, 8, 4), (1, 8, 8), (6, 4, 2)]
)
def test_ulysses_repeats_kv_heads_to_the_least_multiple_of_p(kv_heads, shards, repeat):
    assert kv_repeat(kv_heads, shards) == repeat
    assert kv_heads * repeat == math.lcm(kv_heads, shards)


def test_ulysses_all_to_all_moves_one_kv_head_a_device_when_kv_heads_divide_p():
    """The compiled forward's all-to-all bytes with 1 KV head at P = 8: q, the output and k, v repeated
    to 8 heads, one head per device each: the lower bound (each device needs one KV head whole)."""
    case = _case(heads=8, kv_heads=1, shards=8)
    q, k, v, _, _ = _inputs(case)
    mesh = _sequence_mesh(8)
    tokens = P(None, "sequence", None, None)
    run = jax.shard_map(
        lambda q, k, v: ulysses_attention(q, k, v, axis_name="sequence", causal=True, block_sizes=TILES),
        mesh=mesh,
        in_specs=(tokens,) * 3,
        out_specs=tokens,
    )
    found = summarize(collectives(jax.jit(run).lower(q, k, v).compile().as_text()))
    local = q.size * 4 // 8  # one device's q (or output), float32: 8 heads of L/8 tokens
    assert found["all-to-all"][1] == 4 * local  # q, out, and k, v repeated to as many heads as q


def test_ulysses_refuses_query_heads_the_sequence_axis_cannot_split():
    case = _case(shards=8, heads=12, kv_heads=4)
    q, k, v, d_out, segments = _inputs(case)
    with pytest.raises(
        ValueError, match=r"heads \(12\).*not divisible by 8; use a sequence axis of 4.*or ring attention"
    ):
        _context_parallel(ulysses_attention, case)(q, k, v, segments)
    _check(ulysses_attention, _case(shards=4, heads=12, kv_heads=4))  # the size it names works


# --------------------------------------------------------------------------------------
# USP: all-to-all over the inner axis, ring over the outer
# --------------------------------------------------------------------------------------


def _usp(case, ring: int, inner: int):
    """`f(q, k, v, segments)` on natural-order global arrays, run over a context=R x sequence=U mesh."""
    layout = case["layout"]
    perm = zigzag_permutation(LENGTH, ring) if layout == "zigzag" else np.arange(LENGTH)  # zigzag over the ring
    natural = np.argsort(perm)
    mesh = jax.make_mesh((ring, inner), ("context", "sequence"), axis_types=(AxisType.Auto,) * 2)
    tokens, ids = P(None, ("context", "sequence"), None, None), P(None, ("context", "sequence"))

    def local(q, k, v, segments=None):
        return usp_attention(
            q,
            k,
            v,
            ring_axis="context",
            all_to_all_axis="sequence",
            q_segment_ids=segments,
            kv_segment_ids=segments,
            causal=case["causal"],
            layout=layout,
            block_sizes=TILES,
        )

    def run(q, k, v, segments):
        args = (q[:, perm], k[:, perm], v[:, perm])
        if segments is None:
            return jax.shard_map(local, mesh=mesh, in_specs=(tokens,) * 3, out_specs=tokens)(*args)[:, natural]
        sharded = jax.shard_map(local, mesh=mesh, in_specs=(tokens,) * 3 + (ids,), out_specs=tokens)
        return sharded(*args, segments[:, perm])[:, natural]

    return run


USP_CASES = [  # (ring R, all-to-all U, case)
    (2, 4, _case(heads=8, kv_heads=2, segments=True)),  # KV heads repeated to 4 for U = 4
    (4, 2, _case(heads=4, kv_heads=1, segments=True)),  # one KV head repeated to 2
    (4, 2, _case(heads=4, kv_heads=2, segments=True, layout="contiguous")),
    (2, 4, _case(heads=4, kv_heads=4, causal=False)),
]


@pytest.mark.parametrize(
    "ring, inner, case",
    USP_CASES,
    ids=lambda c: f"{c}" if isinstance(c, int) else "-".join(f"{k}={v}" for k, v in c.items() if BASE[k] != v),
)
def test_usp_attention_matches_the_reference(ring, inner, case):
    q, k, v, d_out, segments = _inputs(case)
    got = _value_and_grads(_usp(case, ring, inner), q, k, v, d_out, segments)
    want = _value_and_grads(_reference(case["causal"]), q, k, v, d_out, segments)
    _assert_close(got, want)


def test_usp_moves_all_to_all_inside_the_group_and_permutes_across_it():
    """The compiled forward over context=2 x sequence=4: all-to-alls of q, k, v and the output within
    a group of 4 (q's local size each, KV heads repeated from 2 to 4); one ring hop (R - 1 = 1) of the
    group's k and v blocks, L/2 tokens of one KV head each."""
    case = _case(heads=8, kv_heads=2)
    q, k, v, _, _ = _inputs(case)
    run = jax.jit(_usp(case, 2, 4))
    found = summarize(collectives(run.lower(q, k, v, None).compile().as_text()))
    local_q = q.size * 4 // 8
    assert found["all-to-all"][1] == 3 * local_q  # q, out, and k, v repeated to 4 heads: half of q's 8 each
    kv_block = 2 * (2 * LENGTH // 2 * 1 * HEAD_DIM * 4)  # k and v: batch 2, L/R tokens, 1 head, float32
    assert found["collective-permute"][1] == kv_block


# --------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------


def test_zigzag_permutation_gives_device_r_chunks_r_and_2p_minus_1_minus_r():
    perm = zigzag_permutation(16, 4)  # 8 chunks of 2 tokens
    shards = perm.reshape(4, 4)
    for r in range(4):
        chunks = sorted({int(i) // 2 for i in shards[r]})
        assert chunks == [r, 7 - r]
    assert sorted(perm.tolist()) == list(range(16))
    with pytest.raises(ValueError, match="multiple of 2 x"):
        zigzag_permutation(12, 4)


def test_forward_and_backward_merge_over_key_blocks():
    """Two key blocks' (out, lse) merged by log-sum-exp equal attention over both, and the
    backward entry point with the merged (out, lse) gives each block's exact gradients."""
    case = _case(segments=True)
    q, k, v, d_out, segments = _inputs(case)
    half = LENGTH // 2
    blocks = [(k[:, :half], v[:, :half], segments[:, :half]), (k[:, half:], v[:, half:], segments[:, half:])]
    forward = jax.jit(
        lambda q, k, v, q_ids, kv_ids: flash_attention_forward(
            q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, block_sizes=TILES
        )
    )
    backward = jax.jit(
        lambda q, k, v, out, lse, d_out, q_ids, kv_ids: flash_attention_backward(
            q, k, v, out, lse, d_out, q_segment_ids=q_ids, kv_segment_ids=kv_ids, block_sizes=TILES
        )
    )
    parts = [forward(q, kb, vb, segments, sb) for kb, vb, sb in blocks]
    (o_a, lse_a), (o_b, lse_b) = parts
    lse = jnp.logaddexp(lse_a, lse_b)
    weight = lambda part: jnp.nan_to_num(jnp.exp(part - lse)).transpose(0, 2, 1)[..., None]
    out = o_a * weight(lse_a) + o_b * weight(lse_b)

    def ref(q, k, v):
        return flash_attention_reference(q, k, v, q_segment_ids=segments, kv_segment_ids=segments)

    want, vjp = jax.vjp(ref, q, k, v)
    dq, dk, dv = vjp(d_out)
    grads = [backward(q, kb, vb, out, lse, d_out, segments, sb) for kb, vb, sb in blocks]
    got = (
        out,
        grads[0][0] + grads[1][0],
        jnp.concatenate([grads[0][1], grads[1][1]], axis=1),
        jnp.concatenate([grads[0][2], grads[1][2]], axis=1),
    )
    _assert_close(got, (want, dq, dk, dv))


def test_forward_tile_count_is_what_the_kernel_computes():
    q = jnp.zeros((1, 80, 1, 16))
    k = jnp.zeros((1, 48, 1, 16))
    for causal in (True, False):
        counts = jax.jit(lambda q, k: _tile_counts(q, k, k, causal=causal, block_sizes=TILES))(q, k)["forward"]
        assert forward_tile_count(80, 48, causal=causal, block_sizes=TILES) == int(counts.sum())


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_zigzag_balances_causal_work(shards):
    """Contiguous: the last device does about (2P-1)/P of the mean; zigzag: all equal."""
    length = 64 * 2 * shards * 4
    balance = {}
    for layout in ("contiguous", "zigzag"):
        counts = ring_tile_counts(length, shards, causal=True, layout=layout)
        balance[layout] = counts.max() / counts.mean()
    assert balance["zigzag"] == 1.0
    assert abs(balance["contiguous"] - (2 * shards - 1) / shards) < 0.05
    full = ring_tile_counts(length, 1, causal=True, layout="zigzag")[0]
    assert ring_tile_counts(length, shards, causal=True, layout="zigzag").sum() == pytest.approx(full, rel=0.02)


# --------------------------------------------------------------------------------------
# Uneven shards (devices of unequal speed)
# --------------------------------------------------------------------------------------

UNEVEN = (48, 8, 40, 32)  # real tokens per device of a ring of 4 over LENGTH = 128; blocks of 48


def _uneven(case, shares, local):
    """`f(q, k, v, segments, junk)` on natural-order arrays: laid out by `uneven_zigzag_layout` with ``junk``
    (random, finite) in the padding, run on the ring with ``shares``; returns (natural-order output, the
    padding rows' output)."""
    order = uneven_zigzag_layout(shares, local)
    pad = order < 0
    take = np.where(pad, 0, order)
    real = np.nonzero(~pad)[0]
    natural = real[np.argsort(order[real])]  # laid-out position of natural token i
    tokens, ids = P(None, "sequence", None, None), P(None, "sequence")
    mesh = _sequence_mesh(len(shares))

    def local_fn(q, k, v, segments):
        return ring_attention(
            q,
            k,
            v,
            axis_name="sequence",
            q_segment_ids=segments,
            kv_segment_ids=segments,
            causal=True,
            layout="zigzag",
            block_sizes=TILES,
            shares=shares,
        )

    sharded = jax.shard_map(local_fn, mesh=mesh, in_specs=(tokens,) * 3 + (ids,), out_specs=tokens)

    def run(q, k, v, segments, junk):
        lay = lambda x, j: jnp.where(pad[None, :, None, None], j, x[:, take])
        junk_q, junk_kv = junk
        laid_segments = jnp.where(pad[None], 7, segments[:, take])  # an id no real token has
        out = sharded(lay(q, junk_q), lay(k, junk_kv), lay(v, junk_kv), laid_segments)
        return out[:, natural], out[:, pad]

    return run


def test_uneven_shards_match_the_reference_and_padding_gets_nothing():
    """Ring attention on uneven shards (zigzag, GQA, packed documents, P = 4, blocks padded to the largest
    share) equals unsplit attention in float32 within 1e-5, outputs and the gradients of q, k and v; the
    padding rows output exactly 0 and the junk in the padding gets exactly zero gradient."""
    case = _case(segments=True)
    q, k, v, d_out, segments = _inputs(case)
    local = max(UNEVEN)
    keys = jax.random.split(jax.random.PRNGKey(9), 2)
    junk = (
        jax.random.normal(keys[0], (2, 4 * local, case["heads"], HEAD_DIM)),
        jax.random.normal(keys[1], (2, 4 * local, case["kv_heads"], HEAD_DIM)),
    )
    run = _uneven(case, UNEVEN, local)

    def loss(q, k, v, junk):
        out, padding = run(q, k, v, segments, junk)
        return jnp.sum(out * d_out), (out, padding)

    (_, (out, padding)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, junk)
    want = _value_and_grads(_reference(True), q, k, v, d_out, segments)
    _assert_close((out, *grads[:3]), want)
    assert float(jnp.max(jnp.abs(padding))) == 0.0
    assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(grads[3]))


def test_uneven_layout_keeps_the_zigzag_balance_per_device():
    """Each device's causal query-key pairs are shares[r] / 2 x (L + 1): in proportion to its real tokens;
    equal shares give `zigzag_permutation`."""
    order = uneven_zigzag_layout(UNEVEN, 48).reshape(4, 48)
    assert sorted(order[order >= 0].tolist()) == list(range(LENGTH))
    for r, share in enumerate(UNEVEN):
        tokens = order[r][order[r] >= 0]
        assert len(tokens) == share
        assert int(np.sum(tokens + 1)) == share // 2 * (LENGTH + 1)
    np.testing.assert_array_equal(uneven_zigzag_layout((32,) * 4, 32), zigzag_permutation(LENGTH, 4))
    with pytest.raises(ValueError, match="even number of tokens"):
        uneven_zigzag_layout((47, 9, 40, 32), 48)
    with pytest.raises(ValueError, match="at least the largest share"):
        uneven_zigzag_layout(UNEVEN, 40)


def test_valid_lengths_skip_tiles_of_padding_only():
    """With 20 real query rows and 40 real keys of 64 (tiles of 16), the forward and dq kernels compute 3 key
    tiles for the 2 query tiles holding real rows and none for the others; dk/dv 2 query tiles (x 2 query heads
    per KV head) for the 3 key tiles holding real keys and none for the last."""
    q = jnp.ones((1, 64, 2, 16))
    k = jnp.ones((1, 64, 1, 16))
    counts = jax.jit(lambda q, k: _tile_counts(q, k, k, block_sizes=TILES, q_valid_length=20, kv_valid_length=40))(q, k)
    np.testing.assert_array_equal(counts["forward"][0, 0], [3, 3, 0, 0])
    np.testing.assert_array_equal(counts["dq"][0, 0], [3, 3, 0, 0])
    np.testing.assert_array_equal(counts["dkv"][0, 0], [4, 4, 4, 0])
