"""Ring attention over a mesh axis: exact attention on sequences split across devices.

Source: Hao Liu, Matei Zaharia, Pieter Abbeel, "Ring Attention with Blockwise Transformers
for Near-Infinite Context" (2023), Section 3 and Algorithm 1. The sequence is split into P
blocks along a mesh axis (the `sequence` axis in meshwork); each device keeps its query
block while the key/value blocks travel around a ring of the P devices (`lax.ppermute`),
one hop per step. Each step attends the local queries to the visiting keys with our
FlashAttention-2 kernel (`flash_attention_forward`, which also returns the log-sum-exp) and
merges the partial output into a running one by log-sum-exp (the blockwise softmax of
Section 2, as in FlashAttention's online softmax). The backward pass (`jax.custom_vjp`) is
a second ring: dq is accumulated locally, while dk and dv travel with their key/value block
and arrive home after the last step, so every device holds O(length / P) of everything.
The next block's transfer is issued before the current block is computed, so XLA can
overlap communication with the kernel.

Every device runs the same P steps (a collective inside a loop with a per-device trip
count deadlocks); blocks a causal mask hides entirely are skipped with `lax.switch`, not by
leaving the loop.

Layouts of the sequence over the P devices (`layout`):

* ``contiguous``: device r holds tokens [r L/P, (r+1) L/P). Under a causal mask device r
  attends r + 1/2 blocks' worth of keys, so the last device does about (2P-1)/P times the
  mean work.
* ``zigzag``: the sequence is cut into 2P equal chunks and device r holds chunks r and
  2P-1-r, concatenated (`zigzag_permutation`). Every device then does the same work: the
  causal diagonal of its own two chunks at step 0, and exactly half a block at every later
  step. This is the load-balanced layout of context parallelism in Megatron-LM and Llama 3
  (Llama Team, "The Llama 3 Herd of Models", 2024, Section 3.3.2). The caller permutes the
  tokens (and positions, segment ids, targets) once on the host; attention needs no
  gathering.

Uneven shards (`shares`, for devices of unequal speed): device r holds ``shares[r]`` real
tokens, half in each of its two zigzag chunks, inside a block of the same shape on every
device (each chunk padded at its end to the largest half; `uneven_zigzag_layout`). The
natural sequence is cut into 2P chunks of ``shares[0]/2, ..., shares[P-1]/2,
shares[P-1]/2, ..., shares[0]/2`` tokens: mirrored, so device r's causal work is
``shares[r]/2 x (length + 1)`` query-key pairs, in proportion to its real tokens (the zigzag
balance, per device). Each step attends chunk by chunk (the flash kernels' valid lengths mask
the padding and skip tiles of padding only), so a device does work in proportion to its share.

Einsum letters: B batch, T length (queries, local), S length (keys, local), N heads, K kv
heads, H head_dim, P ring size (devices along the axis). Local arrays: queries `[B, T, N, H]`,
keys and values `[B, S, K, H]` with S = T (self-attention).

Imports nothing from meshwork except the sibling flash-attention kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .flash_attention import (
    BlockSizes,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    forward_tile_count,
)

CONTIGUOUS = "contiguous"
ZIGZAG = "zigzag"
LAYOUTS = (CONTIGUOUS, ZIGZAG)

# What one ring step computes for a device: which of its queries attend which of the
# visiting keys. Step 0 (a device's own block) is DIAGONAL (causal) or FULL.
DIAGONAL = "diagonal"  # all local queries x all keys, causal mask on local positions.
FULL = "full"  # all local queries x all keys, no causal mask.
SKIP = "skip"  # nothing (the block lies entirely after the queries).
LOWER = "lower"  # zigzag: all queries x the first key chunk (the second is in the future).
UPPER = "upper"  # zigzag: the second query chunk x all keys (the first sees none of them).


def zigzag_permutation(length: int, num_shards: int) -> np.ndarray:
    """Token order of the zigzag layout: position i of the permuted sequence holds token
    `perm[i]` of the natural one.

    The sequence is cut into 2P chunks of `length / (2P)` tokens; shard r (the r-th 1/P of
    the permuted sequence) holds chunks r and 2P-1-r, in that order.

    Args:
      length: L, tokens in the sequence; a multiple of 2 * num_shards.
      num_shards: P, devices along the sequence axis.

    Returns:
      int64 `[length]` permutation; `x[..., perm]` puts a natural-order sequence in zigzag
      order, `x[..., np.argsort(perm)]` undoes it.

    Raises:
      ValueError: when length is not a multiple of 2 * num_shards.
    """
    if num_shards < 1 or length % (2 * num_shards):
        raise ValueError(
            f"the zigzag layout needs the length ({length}) to be a multiple of 2 x the "
            f"sequence-axis size ({num_shards}), i.e. of {2 * num_shards}"
        )
    chunk = length // (2 * num_shards)
    chunks = np.arange(length).reshape(2 * num_shards, chunk)
    order = [c for r in range(num_shards) for c in (r, 2 * num_shards - 1 - r)]
    return chunks[order].reshape(-1)


def uneven_zigzag_layout(shares: Sequence[int], local_length: int) -> np.ndarray:
    """Token order of the zigzag layout with uneven shards: position i of the laid-out sequence
    holds token ``order[i]`` of the natural one, or padding where ``order[i] == -1``.

    Device r's block (positions ``[r * local_length, (r + 1) * local_length)``) is two chunks of
    ``local_length / 2`` positions: natural chunk r, then natural chunk 2P-1-r, each holding
    ``shares[r] / 2`` real tokens followed by padding. The natural chunk sizes are
    ``shares[0]/2, ..., shares[P-1]/2, shares[P-1]/2, ..., shares[0]/2``. With equal shares of
    ``local_length`` tokens it is `zigzag_permutation`.

    Args:
      shares: real tokens per device, P >= 1 even non-negative ints (their sum is the length).
      local_length: tokens per device block, even and at least ``max(shares)``.

    Returns:
      int64 ``[P * local_length]``: natural token index, -1 for padding.

    Raises:
      ValueError: an odd or negative share, or a block too small or odd.
    """
    _check_shares(shares, local_length)
    halves = [s // 2 for s in shares]
    sizes = halves + halves[::-1]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    chunk, p = local_length // 2, len(shares)
    order = np.full(p * local_length, -1, np.int64)
    for r, half in enumerate(halves):
        for which, natural in ((0, r), (1, 2 * p - 1 - r)):
            base = r * local_length + which * chunk
            order[base : base + half] = np.arange(starts[natural], starts[natural] + half)
    return order


def _check_shares(shares: Sequence[int], local_length: int) -> None:
    if not shares or any(int(s) != s or s < 0 or s % 2 for s in shares):
        raise ValueError(f"shares {list(shares)}: each must be an even number of tokens >= 0 (two zigzag chunks)")
    if local_length % 2 or local_length < max(shares):
        raise ValueError(
            f"a device block of {local_length} tokens cannot hold shares {list(shares)}: it must be even and at "
            f"least the largest share ({max(shares)})"
        )


def step_kinds(causal: bool, layout: str) -> tuple[str, ...]:
    """Block kinds a ring step s >= 1 may take, in `step_kind_index` order."""
    if not causal:
        return (FULL,)
    return (FULL, SKIP) if layout == CONTIGUOUS else (LOWER, UPPER)


def step_kind_index(step, shard):
    """Which of `step_kinds` ring step `step` (1 <= step < P) takes on shard `shard`.

    At step s shard r holds the keys of shard (r - s) mod P, which precede its own queries
    iff s <= r: index 0 (FULL contiguous / LOWER zigzag), else 1 (SKIP / UPPER). Works on
    Python ints (host-side tile counts) and traced ints (the kernel) alike.
    """
    return step > shard


def ring_tile_counts(
    length: int, num_shards: int, *, causal: bool, layout: str, block_sizes: BlockSizes | None = None, dtype=jnp.float32
) -> np.ndarray:
    """Forward attention tiles each device computes, per (batch, head), over a whole ring.

    Uses the ring's own step schedule (`step_kinds`, `step_kind_index`) and the flash
    kernel's own tile-skipping rule (`forward_tile_count`), so it counts the work the
    kernels do without running them. With P = 1 it is the single-device count.

    Args:
      length: L, global tokens.
      num_shards: P.
      causal: causal mask.
      layout: ``contiguous`` or ``zigzag``.
      block_sizes, dtype: the kernel's tiles, as `flash_attention`.

    Returns:
      int64 `[P]`: tiles computed by each device.
    """
    _check_layout(layout)
    local = length // num_shards
    half = local // 2

    def tiles(kind: str) -> int:
        if kind == SKIP:
            return 0
        q_len, kv_len = {LOWER: (local, half), UPPER: (half, local)}.get(kind, (local, local))
        count = functools.partial(forward_tile_count, block_sizes=block_sizes, dtype=dtype)
        return count(q_len, kv_len, causal=kind == DIAGONAL)

    kinds = step_kinds(causal, layout)
    counts = np.zeros(num_shards, np.int64)
    for shard in range(num_shards):
        counts[shard] = tiles(DIAGONAL if causal else FULL)
        for step in range(1, num_shards):
            counts[shard] += tiles(kinds[int(step_kind_index(step, shard))])
    return counts


def uneven_ring_tile_counts(
    shares: Sequence[int], local_length: int, *, block_sizes: BlockSizes | None = None, dtype=jnp.float32
) -> np.ndarray:
    """Forward attention tiles each device of a ring on uneven shards computes, per (batch, head).

    The chunk pairs `_uneven_forward` attends (step 0: the front chunk causally, the back chunk over
    the front one and causally over itself; each visiting block from device j: the back queries over
    j's front chunk, and the front queries over j's front chunk when j < r, the back queries over j's
    back chunk when j > r), each counted by the flash kernel's own rule with the chunks' real lengths
    (`forward_tile_count` with valid lengths: tiles of padding only are skipped). Device r's count
    follows its ``shares[r] / 2 x (length + 1)`` query-key pairs up to the tiles the causal diagonal
    and the padding's last partial tile add.

    Args:
      shares: real tokens per device (P even ints), as `ring_attention`'s ``shares``.
      local_length: positions per device block (even, at least ``max(shares)``).
      block_sizes, dtype: the kernel's tiles, as `flash_attention`.

    Returns:
      int64 `[P]`: tiles computed by each device.

    Raises:
      ValueError: as `uneven_zigzag_layout`.
    """
    _check_shares(shares, local_length)
    chunk, halves = local_length // 2, [int(s) // 2 for s in shares]

    def tiles(q_real: int, kv_real: int, causal: bool) -> int:
        return forward_tile_count(
            chunk,
            chunk,
            causal=causal,
            block_sizes=block_sizes,
            dtype=dtype,
            q_valid_length=q_real,
            kv_valid_length=kv_real,
        )

    counts = np.zeros(len(shares), np.int64)
    for r, mine in enumerate(halves):
        counts[r] = 2 * tiles(mine, mine, True) + tiles(mine, mine, False)
        for step in range(1, len(shares)):
            theirs = halves[(r - step) % len(shares)]
            counts[r] += 2 * tiles(mine, theirs, False)  # back x front, and front x front or back x back
    return counts


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")


def _check_ring_inputs(q, k, q_segment_ids, kv_segment_ids, layout: str) -> None:
    """Raises ValueError unless the local blocks fit the ring (the kernel checks the rest)."""
    _check_layout(layout)
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(
            "ring attention takes q [batch, length, heads, head_dim] and k, v [batch, length, "
            f"kv_heads, head_dim], got shapes {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"ring attention is self-attention: local query ({q.shape[1]}) and key ({k.shape[1]}) lengths must be equal"
        )
    if layout == ZIGZAG and q.shape[1] % 2:
        raise ValueError(
            f"the zigzag layout needs an even local length (two chunks per device), got "
            f"{q.shape[1]}; use a length divisible by 2 x the sequence-axis size"
        )
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")


def _axis_size(axis_name) -> int:
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    return math.prod(lax.axis_size(name) for name in names)


# --------------------------------------------------------------------------------------
# Per-device helpers
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static description of one ring-attention call (hashable: a custom_vjp nondiff arg)."""

    axis_name: str | tuple[str, ...]
    axis_size: int
    causal: bool
    layout: str
    sm_scale: float
    block_sizes: BlockSizes | None
    interpret: bool | None
    shares: tuple[int, ...] | None = None  # real tokens per device (uneven zigzag); None: all real

    @property
    def first_kind(self) -> str:
        return DIAGONAL if self.causal else FULL

    def kernel_kwargs(self) -> dict:
        return {"sm_scale": self.sm_scale, "block_sizes": self.block_sizes, "interpret": self.interpret}


def _varying(x):
    """The mesh axes x varies over inside `shard_map` (empty outside or unchecked)."""
    aval = jax.typeof(x)
    axis_type = getattr(aval, "mat", None)  # jax >= 0.10: the manual-axis type
    if axis_type is not None:
        return frozenset(axis_type.varying)
    return frozenset(getattr(aval, "vma", None) or ())  # older jax


def _vary_union(*arrays):
    """Casts each array (None passes) to vary over the union of all their varying axes, so
    loop carries and `lax.switch` branches have one type inside `shard_map` (check_vma)."""
    union = frozenset().union(*(_varying(x) for x in arrays if x is not None))
    return tuple(
        x if x is None or _varying(x) == union else lax.pcast(x, tuple(sorted(union - _varying(x))), to="varying")
        for x in arrays
    )


def _send(ring: _Ring, tree):
    """One hop around the ring: shard r's arrays go to shard r + 1 (mod P)."""
    perm = [(r, (r + 1) % ring.axis_size) for r in range(ring.axis_size)]
    return jax.tree.map(lambda x: lax.ppermute(x, ring.axis_name, perm), tree)


def _slice(x, axis: int, start: int, stop: int):
    return None if x is None else lax.slice_in_dim(x, start, stop, axis=axis)


def _pad_front(x, axis: int, size: int, value):
    """Prepends `size` entries of `value` along `axis` (restores a skipped first half)."""
    shape = list(x.shape)
    shape[axis] = size
    return jnp.concatenate([jnp.full(shape, value, x.dtype), x], axis=axis)


def _pad_back(x, axis: int, size: int, value):
    shape = list(x.shape)
    shape[axis] = size
    return jnp.concatenate([x, jnp.full(shape, value, x.dtype)], axis=axis)


def _merge(o_a, lse_a, o_b, lse_b):
    """Output over two disjoint key sets from each one's (output, log-sum-exp).

    o `[B, T, N, H]` float32, lse `[B, N, T]` float32 (-inf: no key). Liu et al. 2023,
    Section 2 (blockwise softmax): o = (e^lse_a o_a + e^lse_b o_b) / (e^lse_a + e^lse_b).
    """
    peak = jnp.maximum(lse_a, lse_b)
    peak = jnp.where(peak == -jnp.inf, 0.0, peak)  # rows with no key yet: no NaN from -inf - -inf
    w_a, w_b = jnp.exp(lse_a - peak), jnp.exp(lse_b - peak)
    total = w_a + w_b
    lse = peak + jnp.log(total)  # log 0 = -inf keeps empty rows empty
    inv = 1.0 / jnp.where(total > 0, total, 1.0)

    def rows(w):  # [B, N, T] -> [B, T, N, 1]
        return jnp.transpose(w * inv, (0, 2, 1))[..., None]

    return o_a * rows(w_a) + o_b * rows(w_b), lse


# --------------------------------------------------------------------------------------
# Forward ring
# --------------------------------------------------------------------------------------


def _forward_block(ring: _Ring, kind: str, q, q_seg, kv):
    """(o float32 `[B, T, N, H]`, lse `[B, N, T]`) of the local queries over one key block."""
    k, v, kv_seg = kv
    t, s = q.shape[1], k.shape[1]

    def attend(q, k, v, q_seg, kv_seg, causal):
        o, lse = flash_attention_forward(
            q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, causal=causal, **ring.kernel_kwargs()
        )
        return _vary_union(o.astype(jnp.float32), lse, q, k)[:2]

    if kind in (DIAGONAL, FULL):
        return attend(q, k, v, q_seg, kv_seg, kind == DIAGONAL)
    if kind == LOWER:  # the visiting second chunk lies after both query chunks
        return attend(q, k[:, : s // 2], v[:, : s // 2], q_seg, _slice(kv_seg, 1, 0, s // 2), False)
    if kind == UPPER:  # the first query chunk precedes both visiting chunks
        o, lse = attend(q[:, t // 2 :], k, v, _slice(q_seg, 1, t // 2, t), kv_seg, False)
        return _pad_front(o, 1, t // 2, 0.0), _pad_front(lse, 2, t // 2, -jnp.inf)
    assert kind == SKIP, kind
    o = jnp.zeros(q.shape, jnp.float32)
    lse = jnp.full((q.shape[0], q.shape[2], t), -jnp.inf, jnp.float32)
    return _vary_union(o, lse, q, k)[:2]


def _visiting_block(ring: _Ring, step, shard, compute, *args):
    """`compute(kind, *args)` for the kind ring step `step` takes on this shard."""
    kinds = step_kinds(ring.causal, ring.layout)
    if len(kinds) == 1:
        return compute(kinds[0], *args)
    index = jnp.asarray(step_kind_index(step, shard), jnp.int32)
    branches = [functools.partial(compute, kind) for kind in kinds]
    return lax.switch(index, branches, *args)


def _ring_forward(ring: _Ring, q, k, v, q_seg, kv_seg):
    """Ring forward: (out `[B, T, N, H]` in q's dtype, lse `[B, N, T]` float32)."""
    shard = lax.axis_index(ring.axis_name)
    block = functools.partial(_forward_block, ring)
    local = (k, v, kv_seg)
    visiting = _send(ring, local)  # step 1's keys, in flight while the local block computes
    o, lse = block(ring.first_kind, q, q_seg, local)

    def step(s, carry, last=False):
        kv, o, lse = carry
        following = kv if last else _send(ring, kv)  # issued before this step's compute
        o_s, lse_s = _visiting_block(ring, s, shard, block, q, q_seg, kv)
        o, lse = _merge(o, lse, o_s, lse_s)
        return following, o, lse

    carry = (visiting, o, lse)
    if ring.axis_size > 2:
        carry = lax.fori_loop(1, ring.axis_size - 1, step, carry)
    _, o, lse = step(ring.axis_size - 1, carry, last=True)  # no transfer after the last step
    return o.astype(q.dtype), lse


# --------------------------------------------------------------------------------------
# Backward ring
# --------------------------------------------------------------------------------------


def _backward_block(ring: _Ring, kind: str, q, q_seg, out, lse, d_out, kv):
    """(dq, dk, dv) float32 contributions of one key block (rows' out/lse are global)."""
    k, v, kv_seg = kv
    t, s = q.shape[1], k.shape[1]

    def grads(q, k, v, out, lse, d_out, q_seg, kv_seg, causal):
        dq, dk, dv = flash_attention_backward(
            q, k, v, out, lse, d_out, q_segment_ids=q_seg, kv_segment_ids=kv_seg, causal=causal, **ring.kernel_kwargs()
        )
        return _vary_union(dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32), q, k)[:3]

    if kind in (DIAGONAL, FULL):
        return grads(q, k, v, out, lse, d_out, q_seg, kv_seg, kind == DIAGONAL)
    if kind == LOWER:
        dq, dk, dv = grads(
            q, k[:, : s // 2], v[:, : s // 2], out, lse, d_out, q_seg, _slice(kv_seg, 1, 0, s // 2), False
        )
        return dq, _pad_back(dk, 1, s - s // 2, 0.0), _pad_back(dv, 1, s - s // 2, 0.0)
    if kind == UPPER:
        half = slice(t // 2, t)
        dq, dk, dv = grads(
            q[:, half], k, v, out[:, half], lse[:, :, half], d_out[:, half], _slice(q_seg, 1, t // 2, t), kv_seg, False
        )
        return _pad_front(dq, 1, t // 2, 0.0), dk, dv
    assert kind == SKIP, kind
    zeros = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    return _vary_union(*zeros, q, k)[:3]


def _ring_backward(ring: _Ring, q, k, v, q_seg, kv_seg, out, lse, d_out):
    """Ring backward: (dq, dk, dv) like q, k, v.

    Key/value block j leaves shard j, visits shards j+1, ..., j+P-1 with an accumulator of
    its dk, dv (started at zero on shard j+1), and the accumulator takes one more hop home,
    where the block's local share (step 0) is added: P-1 transfers of keys and values and
    P-1 of their gradients.
    """
    shard = lax.axis_index(ring.axis_name)
    block = functools.partial(_backward_block, ring)
    rows = (q, q_seg, out, lse, d_out)
    local = (k, v, kv_seg)
    visiting = _send(ring, local)
    dq, dk_home, dv_home = block(ring.first_kind, *rows, local)
    travelling = (jnp.zeros_like(dk_home), jnp.zeros_like(dv_home))

    def step(s, carry, last=False):
        kv, dq, (dk_acc, dv_acc) = carry
        following = kv if last else _send(ring, kv)
        dq_s, dk_s, dv_s = _visiting_block(ring, s, shard, block, *rows, kv)
        travelling = _send(ring, (dk_acc + dk_s, dv_acc + dv_s))
        return following, dq + dq_s, travelling

    carry = (visiting, dq, travelling)
    if ring.axis_size > 2:
        carry = lax.fori_loop(1, ring.axis_size - 1, step, carry)
    _, dq, (dk_acc, dv_acc) = step(ring.axis_size - 1, carry, last=True)
    return (dq.astype(q.dtype), (dk_home + dk_acc).astype(k.dtype), (dv_home + dv_acc).astype(v.dtype))


# --------------------------------------------------------------------------------------
# Uneven shards: chunk by chunk, padding masked and skipped by valid lengths
# --------------------------------------------------------------------------------------


def _chunk(x, which: int, axis: int = 1):
    """Zigzag chunk ``which`` (0: the front one, natural chunk r; 1: the back one, 2P-1-r) of a block."""
    if x is None:
        return None
    size = x.shape[axis] // 2
    return lax.slice_in_dim(x, which * size, (which + 1) * size, axis=axis)


def _chunks(tree, which: int):
    return tuple(_chunk(x, which) for x in tree)


def _real_half(ring: _Ring, shard):
    """Real tokens in each chunk of device ``shard`` (traced int32)."""
    return jnp.asarray([s // 2 for s in ring.shares], jnp.int32)[shard]


def _pair_forward(ring: _Ring, q, q_seg, q_real, kv, kv_real, causal: bool):
    """(o float32, lse) of one query chunk over one key chunk, padding masked and skipped."""
    k, v, kv_seg = kv
    o, lse = flash_attention_forward(
        q,
        k,
        v,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        causal=causal,
        q_valid_length=q_real,
        kv_valid_length=kv_real,
        **ring.kernel_kwargs(),
    )
    return _vary_union(o.astype(jnp.float32), lse, q, k)[:2]


def _uneven_forward(ring: _Ring, q, k, v, q_seg, kv_seg):
    """Ring forward over uneven shards (chunk pairs): (out in q's dtype, lse `[B, N, T]`).

    In natural order a device's front chunk precedes every back chunk, and device j's front chunk
    precedes device r's iff j < r (its back chunk then follows r's): step 0 attends the front chunk
    causally, the back chunk over the front one fully and over itself causally; a visiting block
    from j gives the back queries its front chunk, and its other chunk pairs with the front
    queries (j < r, its front chunk) or the back ones (j > r, its back chunk).
    """
    shard = lax.axis_index(ring.axis_name)
    mine = _real_half(ring, shard)
    pair = functools.partial(_pair_forward, ring)
    q_front, q_back = _chunk(q, 0), _chunk(q, 1)
    seg_front, seg_back = _chunk(q_seg, 0), _chunk(q_seg, 1)
    local = (k, v, kv_seg)
    visiting = _send(ring, local)
    o_f, lse_f = pair(q_front, seg_front, mine, _chunks(local, 0), mine, True)
    o_b, lse_b = _merge(
        *pair(q_back, seg_back, mine, _chunks(local, 0), mine, False),
        *pair(q_back, seg_back, mine, _chunks(local, 1), mine, True),
    )

    def earlier(acc, kv, theirs):  # j < r: the front queries over its front chunk
        o_f, lse_f, o_b, lse_b = acc
        return (*_merge(o_f, lse_f, *pair(q_front, seg_front, mine, _chunks(kv, 0), theirs, False)), o_b, lse_b)

    def later(acc, kv, theirs):  # j > r: the back queries over its back chunk
        o_f, lse_f, o_b, lse_b = acc
        return (o_f, lse_f, *_merge(o_b, lse_b, *pair(q_back, seg_back, mine, _chunks(kv, 1), theirs, False)))

    def step(s, carry, last=False):
        kv, acc = carry
        following = kv if last else _send(ring, kv)
        theirs = _real_half(ring, (shard - s) % ring.axis_size)
        o_f, lse_f, o_b, lse_b = acc
        acc = (o_f, lse_f, *_merge(o_b, lse_b, *pair(q_back, seg_back, mine, _chunks(kv, 0), theirs, False)))
        index = jnp.asarray(step_kind_index(s, shard), jnp.int32)
        return following, lax.switch(index, [earlier, later], acc, kv, theirs)

    carry = (visiting, (o_f, lse_f, o_b, lse_b))
    if ring.axis_size > 2:
        carry = lax.fori_loop(1, ring.axis_size - 1, step, carry)
    _, (o_f, lse_f, o_b, lse_b) = step(ring.axis_size - 1, carry, last=True)
    return jnp.concatenate([o_f, o_b], axis=1).astype(q.dtype), jnp.concatenate([lse_f, lse_b], axis=2)


def _pair_backward(ring: _Ring, rows, q_real, kv, kv_real, causal: bool):
    """(dq, dk, dv) float32 of one query chunk over one key chunk (rows: q, seg, out, lse, d_out)."""
    q, q_seg, out, lse, d_out = rows
    k, v, kv_seg = kv
    dq, dk, dv = flash_attention_backward(
        q,
        k,
        v,
        out,
        lse,
        d_out,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        causal=causal,
        q_valid_length=q_real,
        kv_valid_length=kv_real,
        **ring.kernel_kwargs(),
    )
    return _vary_union(dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32), q, k)[:3]


def _uneven_backward(ring: _Ring, q, k, v, q_seg, kv_seg, out, lse, d_out):
    """Ring backward over uneven shards, the chunk pairs of `_uneven_forward`: (dq, dk, dv) like q, k, v.

    Key/value gradients travel with their block as in `_ring_backward`.
    """
    shard = lax.axis_index(ring.axis_name)
    mine = _real_half(ring, shard)
    pair = functools.partial(_pair_backward, ring)
    lse_front, lse_back = _chunk(lse, 0, axis=2), _chunk(lse, 1, axis=2)
    front = (_chunk(q, 0), _chunk(q_seg, 0), _chunk(out, 0), lse_front, _chunk(d_out, 0))
    back = (_chunk(q, 1), _chunk(q_seg, 1), _chunk(out, 1), lse_back, _chunk(d_out, 1))
    local = (k, v, kv_seg)
    visiting = _send(ring, local)
    dq_f, dk_f, dv_f = pair(front, mine, _chunks(local, 0), mine, True)
    dq_b, dk_f2, dv_f2 = pair(back, mine, _chunks(local, 0), mine, False)
    dq_b2, dk_b, dv_b = pair(back, mine, _chunks(local, 1), mine, True)
    dq_home = (dq_f, dq_b + dq_b2)
    dk_home = jnp.concatenate([dk_f + dk_f2, dk_b], axis=1)
    dv_home = jnp.concatenate([dv_f + dv_f2, dv_b], axis=1)

    def earlier(grads, kv, theirs):  # j < r: front queries x its front chunk
        dq_f, dq_b, dk_f, dk_b, dv_f, dv_b = grads
        dq, dk, dv = pair(front, mine, _chunks(kv, 0), theirs, False)
        return dq_f + dq, dq_b, dk_f + dk, dk_b, dv_f + dv, dv_b

    def later(grads, kv, theirs):  # j > r: back queries x its back chunk
        dq_f, dq_b, dk_f, dk_b, dv_f, dv_b = grads
        dq, dk, dv = pair(back, mine, _chunks(kv, 1), theirs, False)
        return dq_f, dq_b + dq, dk_f, dk_b + dk, dv_f, dv_b + dv

    def step(s, carry, last=False):
        kv, (dq_f, dq_b), (dk_acc, dv_acc) = carry
        following = kv if last else _send(ring, kv)
        theirs = _real_half(ring, (shard - s) % ring.axis_size)
        dq, dk_f, dv_f = pair(back, mine, _chunks(kv, 0), theirs, False)
        zeros = jnp.zeros_like(dk_f)
        index = jnp.asarray(step_kind_index(s, shard), jnp.int32)
        grads = lax.switch(index, [earlier, later], (dq_f, dq_b + dq, dk_f, zeros, dv_f, zeros), kv, theirs)
        dq_f, dq_b, dk_f, dk_b, dv_f, dv_b = grads
        dk_s, dv_s = jnp.concatenate([dk_f, dk_b], axis=1), jnp.concatenate([dv_f, dv_b], axis=1)
        travelling = _send(ring, (dk_acc + dk_s, dv_acc + dv_s))
        return following, (dq_f, dq_b), travelling

    carry = (visiting, dq_home, (jnp.zeros_like(dk_home), jnp.zeros_like(dv_home)))
    if ring.axis_size > 2:
        carry = lax.fori_loop(1, ring.axis_size - 1, step, carry)
    _, (dq_f, dq_b), (dk_acc, dv_acc) = step(ring.axis_size - 1, carry, last=True)
    dq = jnp.concatenate([dq_f, dq_b], axis=1)
    return dq.astype(q.dtype), (dk_home + dk_acc).astype(k.dtype), (dv_home + dv_acc).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v, q_seg, kv_seg):
    return _ring_attention_fwd(ring, q, k, v, q_seg, kv_seg)[0]


def _ring_attention_fwd(ring: _Ring, q, k, v, q_seg, kv_seg):
    forward = _ring_forward if ring.shares is None else _uneven_forward
    out, lse = forward(ring, q, k, v, q_seg, kv_seg)
    return out, (q, k, v, q_seg, kv_seg, out, lse)


def _ring_attention_bwd(ring: _Ring, residuals, d_out):
    q, k, v, q_seg, kv_seg, out, lse = residuals
    backward = _ring_backward if ring.shares is None else _uneven_backward
    dq, dk, dv = backward(ring, q, k, v, q_seg, kv_seg, out, lse, d_out)
    return dq, dk, dv, None, None


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: str | Sequence[str],
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = False,
    layout: str = CONTIGUOUS,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    shares: Sequence[int] | None = None,
) -> jax.Array:
    """Exact attention over a sequence split along a mesh axis, by ring (Liu et al. 2023).

    A per-device function: call it inside `jax.shard_map` with the length dimension of q,
    k, v and the segment ids split over `axis_name` (and any other dimensions split as you
    like: batch and heads are independent). Differentiable (`jax.custom_vjp`; the backward
    pass is a second ring). Each device holds O(length / P) memory throughout.

    Precision: partial outputs are merged, and dq, dk, dv accumulated (and dk, dv sent
    around the ring), in float32; with bfloat16 inputs each block's partial output and
    gradients leave the kernel in bfloat16 before being merged.

    Args:
      q: this device's queries `[batch, length / P, heads, head_dim]`, float32 or bfloat16.
      k, v: this device's keys and values `[batch, length / P, kv_heads, head_dim]`;
        `heads` a multiple of `kv_heads` (grouped-query attention).
      axis_name: the mesh axis (or axes) the length is split over; P is its size.
      q_segment_ids, kv_segment_ids: int `[batch, length / P]` packed-document ids of this
        device's tokens (queries attend keys of equal id only), or both None. The key ids
        travel with the keys.
      causal: token i attends token j iff j <= i in the original (natural) order.
      layout: how the original sequence is laid out over the devices: ``contiguous`` or
        ``zigzag`` (`zigzag_permutation`; balances causal work). Used only when causal.
      sm_scale: score scale, default 1 / sqrt(head_dim).
      block_sizes, interpret: the flash kernel's, as `flash_attention`.
      shares: uneven shards: real tokens per device along the ring (P even ints, each at most
        the local length), the tokens laid out by `uneven_zigzag_layout`; causal zigzag only.
        Padding rows output 0 and padding tokens get zero gradients. None: every token real.

    Returns:
      `[batch, length / P, heads, head_dim]` in q's dtype: this device's rows of the output,
      in the same layout as q.

    Raises:
      ValueError: unequal local query and key lengths, an odd local length with the zigzag
        layout, an unknown layout, only one of the segment ids, shares that are not P even
        ints within the local length or come without a causal zigzag ring, or what
        `flash_attention` raises.
    """
    _check_ring_inputs(q, k, q_segment_ids, kv_segment_ids, layout)
    axis_name = axis_name if isinstance(axis_name, str) else tuple(axis_name)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    size = _axis_size(axis_name)
    if shares is not None:
        if not causal or layout != ZIGZAG or size < 2 or len(shares) != size:
            raise ValueError(
                f"uneven shares {list(shares)} need causal attention in the zigzag layout over a ring of "
                f"{len(shares)} >= 2 devices (got causal={causal}, layout {layout}, {size} devices)"
            )
        _check_shares(shares, q.shape[1])
        shares = tuple(int(s) for s in shares)
    if size == 1:
        return flash_attention(
            q,
            k,
            v,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            causal=causal,
            sm_scale=sm_scale,
            block_sizes=block_sizes,
            interpret=interpret,
        )
    if q_segment_ids is not None:
        q_segment_ids = q_segment_ids.astype(jnp.int32)
        kv_segment_ids = kv_segment_ids.astype(jnp.int32)
    ring = _Ring(
        axis_name=axis_name,
        axis_size=size,
        causal=bool(causal),
        layout=layout if causal else CONTIGUOUS,
        sm_scale=float(sm_scale),
        block_sizes=block_sizes,
        interpret=interpret,
        shares=shares,
    )
    # One varying type for all inputs (pcast is differentiable: its transpose sums over the
    # axes an input did not vary on), so carries, branches and cotangents agree.
    q, k, v, q_seg, kv_seg = _vary_union(q, k, v, q_segment_ids, kv_segment_ids)
    return _ring_attention(ring, q, k, v, q_seg, kv_seg)
