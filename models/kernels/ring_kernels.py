"""The per-device rings of ring attention (`models.kernels.ring_attention`): what each step computes, the
forward and backward rings over even shards, the chunk-by-chunk rings over uneven ones, and the
``jax.custom_vjp`` that joins them.

Each device keeps its query block; key/value blocks (and on the way back their gradients) travel around
the ring of the devices along the axis (`jax.lax.ppermute`), one hop per step, and each step attends the
local queries to the visiting keys with the flash kernels (`models.kernels.flash_attention`), merging the
partial outputs by log-sum-exp (Liu et al., 2023, Algorithm 1). Einsum letters and layouts as in
`models.kernels.ring_attention`.

Imports nothing from meshwork except the sibling flash-attention kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from .flash_attention import (
    flash_attention_backward,
    flash_attention_forward,
)
from .flash_blocks import BlockSizes

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
