"""A stage's layer weights in its stage program: gathered for a pass, their gradients reduced after it.

* `Weights`: the stage's layer weights gathered once per step into its ``[R, K, ...]`` working copy in the
  compute dtype, and the gradients summed over the step reduced back into the stored blocks once, after the
  loop (MaxText's ``pipeline_fsdp_ag_once`` trade-off: one gather and one reduction per step instead of one
  per microbatch, the gathered copy held through the step);
* `Streamed`, with ``--pipeline-gather microbatch``: one block of layers gathered at a time inside each chunk
  pass (zero bubble's weight-gradient pass, which reads no weight, gathers none) and its gradient
  reduce-scattered there, so the step holds one block instead of the stage.

Both run inside the schedule's `jax.shard_map` (`sharding.pipeline.program.Setup` builds the `Weights`), on
the storage of `sharding.pipeline.storage`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharding import axes as ax
from sharding.parallel import (
    gather_shards,
    psum_unsplit,
    reduce_shards,
    to_varying,
)
from sharding.pipeline.buffers import (
    add_block,
    backward_slot,
    forward_slot,
    get_cut,
    index_leaf,
    index_tree,
    put_cut,
)
from sharding.pipeline.padding import own_slots, sum_owned
from sharding.pipeline.split import LayerSplit
from sharding.pipeline.storage import StageStorage


def _inverse_rows(local_index: np.ndarray, size: int, width: int) -> np.ndarray:
    """``[S, G, size]`` int32: for each device's local row, the slot of ``local_index`` ``[S, G, W]`` that takes
    it, or ``width`` (a zero row) where none does.

    Raises:
      ValueError: a local row taken by two slots (a placement `Weights` cannot invert).
    """
    stages, groups, _ = local_index.shape
    inverse = np.full((stages, groups, size), width, np.int32)
    for s in range(stages):
        for g in range(groups):
            for w, row in enumerate(local_index[s, g]):
                if row < 0:
                    continue
                if inverse[s, g, row] != width:
                    raise ValueError(
                        f"pipeline storage: local row {row} of device ({s}, {g}) feeds slots "
                        f"{inverse[s, g, row]} and {w}"
                    )
                inverse[s, g, row] = w
    return inverse


@dataclasses.dataclass(frozen=True)
class Weights:
    """How a stage's layer weights are gathered for a pass and their gradients reduced after it.

    Two storages (`run_pipeline` tells them apart by shape): the unpadded `StageStorage` ``[rows, ...]``
    (``storage`` set: each device holds ``q`` whole rows; see `sharding.pipeline.storage`) and the padded
    ``[stages, slots, ...]`` of a `StageLayout` (``storage`` None: each device holds its stage's slots,
    split over the batch axes ``specs`` names).

    Attributes:
      specs: per leaf of the stacked parameters (``[q, ...]`` or ``[1, slots, ...]`` blocks), its
        `PartitionSpec` over the map's manual batch axes (``data``/``fsdp``; the ``stage`` entry and, for
        the storage, the rows entry left out).
      summed: the manual axes the batch is split over: per-device gradients are partial sums over them.
      dtype: the compute dtype the floating weights are gathered in (the activations' dtype).
      storage: the `StageStorage`, or None (padded slots).
      groups: the storage's batch axes besides ``stage`` (`sharding.pipeline.storage.storage_axes`).
      span: the devices each stored row's features are split over (the per-microbatch gather's
        feature-split storage, `sharding.pipeline.storage.feature_devices`; 1 otherwise).
    """

    specs: Any
    summed: tuple[str, ...]
    dtype: Any
    storage: StageStorage | None = None
    groups: tuple[str, ...] = ()
    span: int = 1

    def gather(self, stacked, repeats: int):
        """This device's blocks -> its stage's whole ``[R, K, ...]`` weights in the compute dtype (``K``: the
        layout's slots per chunk; the storage's ``K'`` padded slots, which no layer fills, are dropped).

        Padded: one all-gather per leaf over its split batch axes. Unpadded: the rows stored for other
        devices move (one ``ppermute`` per distance that moves any), each device picks its slots' rows
        (empty slots zero) and one all-gather over the storage's group axes assembles the working copy.
        """

        def one(w, spec):
            if jnp.issubdtype(w.dtype, jnp.floating):
                w = w.astype(self.dtype)
            if self.all_reduced:  # the R*K real slots summed over the group axes, each from its one owner
                return sum_owned(self._own_slots(self._mine(w), repeats, back=False), self.groups)
            w = self._take_slots(w, spec) if self.storage is not None else gather_shards(w, spec)
            w = w.reshape(repeats, w.shape[1] // repeats, *w.shape[2:])
            return w if self.storage is None else w[:, : self.storage.layout.chunk_slots]

        return jax.tree.map(one, stacked, self.specs)

    @property
    def all_reduced(self) -> bool:
        """Whether the working copy is assembled, and its gradient sums reduced, by all-reduces of the layout's
        ``R*K`` real slots over the group axes (`gather`, `reduce`), rather than an all-gather and a
        reduce-scatter of the padded ``R*K'``.

        The storage's ``G`` devices must divide ``R*K'``, so a stage with fewer layers than ``G`` pads its copy
        (e.g. 8 layers over ``fsdp=64``: ``K' = 64``, eight times the stage). The padded slots are never
        computed, so the step always keeps the copy and saves slot inputs for ``K`` slots only (`gather`); the
        all-reduces also keep the padding out of the collectives' buffers (the gathered copy and the float32
        sums) where they move fewer bytes: ``K' >= 2K`` (ring all-reduce ``2(G-1)/G * R*K`` slots per device,
        all-gather or reduce-scatter ``(G-1)/G * R*K'``). Exact: each real slot has one owner, the others add
        zeros.
        """
        if self.storage is None or not self.groups:
            return False
        return 2 * self.storage.layout.chunk_slots <= self.storage.placement.chunk_slots

    def sums_zeros(self, params, stacked):
        """Zero gradient sums for the working copy ``params`` (leaves ``[R, K, ...]``, from `gather`), in the
        stored blocks' dtype: ``[R, K, ...]``, or ``[R, K', ...]`` where `reduce` reduce-scatters the padded
        copy (`all_reduced` False)."""
        width = None
        if self.storage is not None and not self.all_reduced:
            width = self.storage.placement.chunk_slots

        def one(p, w):
            return jnp.zeros((p.shape[0], width or p.shape[1], *p.shape[2:]), w.dtype)

        return jax.tree.map(one, params, stacked)

    def _mine(self, w):
        """``[q, ...]`` stored rows -> ``[W, ...]`` this device's working-copy slots ``w*G + g`` in the compute
        dtype (the zero row for an empty one)."""
        stage, g = self._where()
        return jnp.take(self._local_rows(self._compute(w)), jnp.asarray(self._slot_rows())[stage, g], axis=0)

    def _own_slots(self, x, repeats: int, back: bool = True):
        """`sharding.pipeline.padding.own_slots` for this device (``g`` along the group axes)."""
        return own_slots(x, self.storage, repeats, self._where()[1], back)

    def _compute(self, w):
        """``w`` in the compute dtype where it is floating point."""
        return w.astype(self.dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w

    def _where(self):
        """``(stage, g)``: this device's stage and index along the group axes (traced int32)."""
        stage = jax.lax.axis_index(ax.STAGE)
        return stage, (jax.lax.axis_index(self.groups) if self.groups else jnp.zeros((), jnp.int32))

    def _send(self, x, d: int, back: bool = False):
        """``ppermute`` of ``x`` by ``d`` devices along the ``(stage, *groups)`` ring (``back``: the other way)."""
        devices = self.storage.stages * self.storage.groups
        pairs = [(p, (p + d) % devices) for p in range(devices)]
        return jax.lax.ppermute(x, (ax.STAGE, *self.groups), [(b, a) for a, b in pairs] if back else pairs)

    def _received_rows(self, w):
        """``[q, ...]`` rows -> ``[C, ...]`` the rows other devices store for this one (one ``ppermute`` per
        distance that moves any), or None when none moves (storage only)."""
        stage, g = self._where()
        parts = []
        for d, send in enumerate(self.storage.placement.sends):
            if send is not None:
                message = jnp.take(w, jnp.asarray(send)[stage, g], axis=0)
                parts.append(self._send(message, d))
        return jnp.concatenate(parts, axis=0) if parts else None

    def _local_rows(self, w):
        """``[q, ...]`` rows -> ``[q + C + 1, ...]``: this device's rows, the rows other devices store for it
        (`_received_rows`) and a zero row last, which the empty slots take (storage only)."""
        received = self._received_rows(w)
        # A zero row, not a select against a slot-sized zero array (XLA shares such a broadcast with the
        # backward pass's and materialises it before the step loop).
        parts = [w] + ([] if received is None else [received]) + [jnp.zeros((1, *w.shape[1:]), w.dtype)]
        return jnp.concatenate(parts, axis=0)

    def _slot_rows(self):
        """``[S, G, W]`` int32 numpy: the local row (`_local_rows`) each device gives working-copy slot
        ``w*G + g`` (the zero row for an empty slot)."""
        placement = self.storage.placement
        size = placement.per_device + placement.received
        return np.where(placement.local_index >= 0, placement.local_index, size)

    def _take_slots(self, w, spec):
        """``[q, ...]`` rows -> ``[1, R*K', ...]`` this stage's working copy (storage only; a feature-split
        storage's rows, ``spec`` naming their split features, gathered whole)."""
        stage, g = self._where()
        local = self._local_rows(w)  # [q + C + 1, ...]
        mine = jnp.take(local, jnp.asarray(self._slot_rows())[stage, g], axis=0)  # [W, ...]
        if not self.groups:
            return gather_shards(mine, spec)[None]
        full = jax.lax.all_gather(mine, self.groups, axis=1, tiled=False)  # [W, G, ...]: slot w*G + g
        return full.reshape(1, -1, *w.shape[1:])

    def _return_rows(self, g_slots, spec):
        """The transpose of `_take_slots` for gradients: ``[R*K', ...]`` -> ``[q, ...]``, summed over the group
        axes (reduce-scatter; a feature-split storage's features over ``spec``'s axes) and sent back to the
        devices storing the received rows."""
        if not self.groups:
            g_slots = reduce_shards(g_slots, spec, ())
        else:
            g_slots = g_slots.reshape(-1, self.storage.groups, *g_slots.shape[1:])
            g_slots = jax.lax.psum_scatter(g_slots, self.groups, scatter_dimension=1, tiled=False)  # [W, ...]
        return self._rows_of(g_slots)

    def _rows_of(self, g_slots):
        """This device's slots' gradients ``[W, ...]`` (already summed over the group axes) -> its rows'
        ``[q, ...]``, the received rows' sent back to the devices storing them."""
        placement = self.storage.placement
        stage, g = self._where()
        # A gather by the inverse of the slots' rows (each local row feeds at most one slot), not a scatter into
        # zeros: XLA materialises a scatter's zero operand before the step loop, through the peak.
        width = g_slots.shape[0]
        inverse = _inverse_rows(placement.local_index, placement.per_device + placement.received, width)
        padded = jnp.concatenate([g_slots, jnp.zeros((1, *g_slots.shape[1:]), g_slots.dtype)], axis=0)
        return self._send_back(jnp.take(padded, jnp.asarray(inverse)[stage, g], axis=0))

    def _send_back(self, local):
        """Gradients of the local rows ``[q + C, ...]`` -> of the stored rows ``[q, ...]``: the received rows'
        sent back to the devices storing them (the transpose of `_received_rows`) and added there."""
        placement = self.storage.placement
        stage, g = self._where()
        q = placement.per_device
        rows, offset = local[:q], q
        for d, send in enumerate(placement.sends):
            if send is not None:
                count = send.shape[-1]
                back = self._send(local[offset : offset + count], d, back=True)
                rows = rows.at[jnp.asarray(send)[stage, g]].add(back)
                offset += count
        return rows

    def reduce(self, grads, stacked):
        """Whole per-device gradient sums (`sums_zeros`: ``[R, K, ...]`` or ``[R, K', ...]``) -> the blocks'
        gradients, summed over ``summed`` (reduce-scatter over the split axes, or with `all_reduced` an
        all-reduce over the group axes; all-reduce over the rest), in the blocks' dtype."""

        def one(g, w, spec):
            if self.all_reduced:  # the real slots all-reduced over the group axes, each device's picked
                own = self._own_slots(jax.lax.psum(g, self.groups), g.shape[0])
                return self._psum_rest(self._rows_of(own), spec).astype(w.dtype)
            g = g.reshape(1, g.shape[0] * g.shape[1], *g.shape[2:])
            if self.storage is None:
                return reduce_shards(g, spec, self.summed).astype(w.dtype)
            rows = self._return_rows(g[0], spec)
            return self._psum_rest(rows, spec).astype(w.dtype)

        return jax.tree.map(one, grads, stacked, self.specs)

    def _psum_rest(self, rows, spec):
        """Stored rows' gradients summed over the batch axes they are still partial over: ``summed`` less the
        group axes and the axes ``spec`` splits the features over (both already reduce-scattered)."""
        return psum_unsplit(rows, spec, self.summed, self.groups)

    def stream(self, stacked, repeats: int, received=None, block_inputs: bool = True) -> Streamed:
        """The per-microbatch gather (``--pipeline-gather microbatch``): what stays local for the step.

        Unpadded storage: the rows other devices store for this one arrive once (`_received_rows`, in the
        compute dtype; no gather over the group axes yet); ``received``: those rows already made (a backward
        pass reusing its forward pass's), else made here. Padded: the blocks as they are. ``block_inputs``:
        a chunk's forward saves each block's input only (`Streamed.block_inputs`).
        """
        if self.storage is not None:
            if received is None and any(send is not None for send in self.storage.placement.sends):
                received = jax.tree.map(lambda w: self._received_rows(self._compute(w)), stacked)
            chunk_slots = self.storage.placement.chunk_slots
            # whole rows: a block is one row of each of the G devices; split features: the slots whose
            # inputs the forward saves one of (each slot is gathered where it runs, `Streamed.per_slot`)
            block = self.storage.groups if self.groups else (self.span if block_inputs else 1)
            return Streamed(self, stacked, received, repeats, chunk_slots, block, block_inputs and block > 1)
        return Streamed(self, stacked, None, repeats, jax.tree.leaves(stacked)[0].shape[1] // repeats, 1)

    def finish(self, sums, stacked):
        """`Streamed` gradient sums (reduce-scattered per pass, `Streamed.zeros`) -> the blocks' gradients:
        summed over the batch axes not yet reduced, in the blocks' dtype."""

        def one(g, w, spec):
            if self.storage is None:
                return psum_unsplit(g, spec, self.summed).astype(w.dtype)
            return self._psum_rest(self._send_back(g), spec).astype(w.dtype)

        return jax.tree.map(one, sums, stacked, self.specs)


@dataclasses.dataclass(frozen=True)
class Streamed:
    """A stage's layer weights gathered per pass of a chunk, one block of ``B`` slots at a time
    (``--pipeline-gather microbatch``; MaxText's alternative to ``pipeline_fsdp_ag_once``).

    The working copy's slots ``[R*K', ...]`` fall into ``W = R*K'/B`` blocks of ``B`` consecutive slots:
    with the unpadded storage ``B = G`` (device ``g`` of the stage provides slot ``w*B + g`` of block ``w``:
    one all-gather over the group axes assembles a block), with padded blocks ``B = 1`` (each slot's
    FSDP-shards all-gathered). A chunk pass (`chunk_forward`, `chunk_backward`, or zero bubble's
    `chunk_backward_input` and `chunk_backward_weight`) gathers the ``n`` blocks that
    cover chunk ``r`` (slots ``r*K' ... r*K' + K' - 1``) in the compute dtype, one at a time, outside the
    slots' conditionals, and its backward pass (zero bubble: its weight-gradient pass) reduce-scatters each
    block's gradient into float32 sums of this device's rows (`zeros`) as soon as the block is done. A pass
    that runs no layer (a bubble tick, or the idle half of a lockstep tick) is skipped whole, its gathers
    with it: they are among the devices of one stage, which all skip it alike. So a step holds one block's
    gathered weights and gradients instead of the stage's, at the price of a gather per chunk pass forward
    and backward (the backward recomputes from a second gather; zero bubble's weight-gradient pass gathers
    nothing where it reads no weight) and a reduce-scatter per backward pass.

    With `block_inputs` a chunk's forward pass saves only each block's input (``n`` activations per chunk
    instead of ``n*B``, `saved`): the backward pass, which gathers the block anyway, first recomputes the
    block's other ``B - 1`` slot inputs from it (``(B - 1) / B`` of a forward more per layer, no gather more),
    then differentiates the slots as before. Chen et al., "Training Deep Nets with Sublinear Memory Cost"
    (2016), section 4: checkpoints every ``B`` layers, the segment between recomputed in the backward pass.

    With the per-microbatch gather's own storage (`per_slot`: rows over ``stage`` only, each row's features
    split over the stage's ``G`` devices, `sharding.pipeline.storage.storage_axes`) nothing is gathered per
    block: each slot's layer is all-gathered over the feature axes where it runs (inside the slot's
    conditional) and its gradient reduce-scattered into this device's share of the row as soon as the slot's
    backward is done, so a pass holds one layer and one layer's gradient instead of ``G`` of each; blocks of
    ``B = G`` slots then only say which activations the forward saves (`block_inputs`), and the backward's
    recomputation of a block's ``B - 1`` other inputs gathers those layers once more.

    Attributes:
      weights: the `Weights` whose storage and specs these are.
      stacked: per leaf, this device's block as stored: ``[q, ...]`` rows (storage) or ``[1, R*K, ...]``.
      received: per leaf, ``[C, ...]`` rows other devices store for this one (`Weights._received_rows`), or
        None when none moves.
      repeats: R, chunks per stage.
      chunk_slots: K', slots per chunk of the working copy.
      block: B, slots per gathered block.
      block_inputs: a chunk's forward saves each block's input only, not each slot's (the backward, or zero
        bubble's input-gradient pass, recomputes the rest).
    """

    weights: Weights
    stacked: Any
    received: Any
    repeats: int
    chunk_slots: int
    block: int
    block_inputs: bool = False

    @property
    def windows(self) -> int:
        """W, blocks in the working copy."""
        return self.repeats * self.chunk_slots // self.block

    @property
    def slots(self) -> int:
        """``R*K'``, slots in the working copy."""
        return self.repeats * self.chunk_slots

    @property
    def per_slot(self) -> bool:
        """Each slot gathered on its own, over the feature axes (a storage whose rows are not spread over the
        stage's devices: `sharding.pipeline.storage.storage_axes` with ``"microbatch"``)."""
        return self.weights.storage is not None and not self.weights.groups

    def _block(self, w):
        """Block ``w``'s gathered weights, leaves ``[B, ...]`` (`fetch`), or None with `per_slot`."""
        return None if self.per_slot else self.fetch(jnp.minimum(w, self.windows - 1))

    def _slot_index(self, w, j):
        """The working-copy slot of slot ``j`` of block ``w`` (clamped into the copy; past it no slot is on)."""
        return jnp.minimum(w * self.block + j, self.slots - 1)

    def _slot(self, block, w, j):
        """Slot ``j`` of block ``w``'s weights: from the gathered ``block``, or (``block`` None, `per_slot`)
        the slot's layer all-gathered here."""
        if block is not None:
            return index_tree(block, j)
        return index_tree(self.fetch(self._slot_index(w, j)), 0)

    def _stand_in(self):
        """Zeros typed as one slot's weights (for tracing a layer's backward, `LayerSplit.trace`)."""
        shapes = jax.eval_shape(self.fetch, jnp.zeros((), jnp.int32))
        return index_tree(to_varying(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes), self._vary()), 0)

    @property
    def blocks(self) -> int:
        """n, blocks one chunk pass gathers: enough to cover any chunk (one more where ``B`` does not divide
        ``K'`` and a chunk straddles two blocks)."""
        k, b = self.chunk_slots, self.block
        return max(-(-(r + 1) * k // b) - (r * k) // b for r in range(self.repeats))

    @property
    def positions(self) -> int:
        """P = ``n * B``: the slot positions a chunk pass covers (some of them empty)."""
        return self.blocks * self.block

    @property
    def saved(self) -> int:
        """The activations a chunk's forward pass saves for its backward: ``n`` block inputs with
        `block_inputs`, else ``P`` slot inputs."""
        return self.blocks if self.block_inputs else self.positions

    def _vary(self):
        return (ax.STAGE, *self.weights.summed)

    def _row(self, w):
        """``(row, q, C)``: the local row (own rows first, then received; ``q + C``: none) of block ``w``'s
        slot on this device (storage only)."""
        weights = self.weights
        stage, g = weights._where()
        placement = weights.storage.placement
        return jnp.asarray(weights._slot_rows())[stage, g, w], placement.per_device, placement.received

    def fetch(self, w):
        """Block ``w`` (traced int32 in ``[0, W)``): leaves ``[B, ...]`` in the compute dtype, device-varying
        over ``stage`` and the batch axes (so differentiating a layer adds no reduction inside the loop).
        With `per_slot`, ``w`` is a working-copy slot in ``[0, R*K')`` and the leaves ``[1, ...]``: its row's
        features all-gathered."""
        weights = self.weights
        received = self.received if self.received is not None else jax.tree.map(lambda _: None, self.stacked)

        def one(own, extra, spec):
            if weights.storage is None:
                x = index_leaf(own[0], w)
            else:
                row, q, c = self._row(w)
                # Row-sized reads and selects: no copy of the stored rows.
                x = weights._compute(index_leaf(own, jnp.minimum(row, q - 1)))
                if extra is not None:
                    x = jnp.where(row < q, x, index_leaf(extra, jnp.clip(row - q, 0, c - 1)))
                x = jnp.where(row < q + c, x, jnp.zeros((), x.dtype))
            x = weights._compute(x)
            if weights.storage is None:
                return gather_shards(x, P(*tuple(spec)[2:]))[None]
            if not weights.groups:
                return gather_shards(x, P(*tuple(spec)[1:]))[None]
            return jax.lax.all_gather(x, weights.groups, axis=0, tiled=False)  # [G, ...]: slot w*G + g

        return to_varying(jax.tree.map(one, self.stacked, received, weights.specs), self._vary())

    def zeros(self):
        """The float32 gradient sums of this device's rows: leaves ``[q + C, ...]`` (storage: own rows, then
        received) or ``[1, R*K, ...]`` of the blocks' local shape (padded)."""
        weights = self.weights
        received = self.received if self.received is not None else jax.tree.map(lambda _: None, self.stacked)

        def one(own, extra):
            dtype = jnp.promote_types(own.dtype, jnp.float32)
            rows = own.shape[0] + (0 if extra is None else extra.shape[0])
            return jnp.zeros((rows, *own.shape[1:]) if weights.storage is not None else own.shape, dtype)

        return to_varying(jax.tree.map(one, self.stacked, received), self._vary())

    def _add(self, sums, w, block_grads):
        """Block ``w``'s gradients ``[B, ...]`` reduce-scattered over the axes the block was gathered over and
        added to this device's row of ``sums`` (`zeros`); with `per_slot`, slot ``w``'s ``[1, ...]``."""
        weights = self.weights

        def one(acc, d, spec):
            # Reduced in the sums' float32, as the cost model prices it and as NeMo's bf16 mixed-precision recipe
            # does (``grad_reduce_in_fp32``); XLA's CPU compiler also aborts on a bfloat16 reduce-scatter here
            # (``AllReducePromotion``, as in `stage_varying`).
            d = d.astype(acc.dtype)
            if weights.storage is None:
                d = reduce_shards(d[0], P(*tuple(spec)[2:]), ())
                old = jax.lax.dynamic_index_in_dim(acc, w, axis=1, keepdims=False)
                return jax.lax.dynamic_update_index_in_dim(acc, (old + d.astype(acc.dtype))[None], w, 1)
            if weights.groups:
                d = jax.lax.psum_scatter(d, weights.groups, scatter_dimension=0, tiled=False)
            else:
                d = reduce_shards(d[0], P(*tuple(spec)[1:]), ())
            row, q, c = self._row(w)
            at = jnp.minimum(row, q + c - 1)
            d = jnp.where(row < q + c, d.astype(acc.dtype), jnp.zeros((), acc.dtype))  # an empty slot adds nothing
            return jax.lax.dynamic_update_index_in_dim(acc, index_leaf(acc, at) + d, at, 0)

        return jax.tree.map(one, sums, block_grads, weights.specs)

    def _start(self, r):
        """The first block chunk ``r`` touches (traced int32)."""
        return (r * self.chunk_slots) // self.block

    def forward(self, layer_fn, r, h, applied, extras, count, skip_empty: bool, save: bool):
        """`chunk_forward` with the weights gathered block by block (arguments as there)."""
        start, b, k0 = self._start(r), self.block, r * self.chunk_slots

        def outer(carry, i):
            w = start + i
            block = self._block(w)

            def inner(carry, j):
                h, applied = carry
                k = w * b + j - k0
                on = (k >= 0) & (k < count)
                out = forward_slot(layer_fn, lambda: self._slot(block, w, j), h, applied, extras, on, skip_empty)
                return out, (h if save and not self.block_inputs else None)

            out, inputs = jax.lax.scan(inner, carry, jnp.arange(b))
            return out, (carry[0] if save and self.block_inputs else inputs)

        def run(h, applied):
            (h, applied), inputs = jax.lax.scan(outer, (h, applied), jnp.arange(self.blocks))
            return h, applied, (inputs.reshape(self.saved, *h.shape) if save else None)

        if not skip_empty:
            return run(h, applied)

        def idle(h, applied):
            zeros = jnp.zeros((self.saved, *h.shape), h.dtype) if save else None
            return h, applied, to_varying(zeros, self._vary())

        return jax.lax.cond(count > 0, run, idle, to_varying(h, self._vary()), applied)

    def backward(self, layer_fn, r, inputs, extras, count, g, sums, skip_empty: bool):
        """`chunk_backward` with the weights gathered again block by block and each block's gradient
        reduce-scattered into ``sums`` (`zeros`) once the block is done (arguments as there)."""
        start, b, k0 = self._start(r), self.block, r * self.chunk_slots

        def outer(carry, i):
            g, sums = carry
            w = start + i
            block = self._block(w)
            slot_of = lambda j: self._slot(block, w, j)  # noqa: E731
            xs = self._block_slot_inputs(layer_fn, slot_of, w * b - k0, inputs, i, extras, count, skip_empty)
            if block is None:  # each slot's gradient reduce-scattered into this device's row at once

                def each(carry, j):
                    g, sums = carry
                    k = w * b + j - k0
                    at = self._slot_index(w, j)
                    add = lambda sums, dw: self._add(sums, at, jax.tree.map(lambda d: d[None], dw))  # noqa: E731
                    on = (k >= 0) & (k < count)
                    x = index_leaf(xs, j)
                    return backward_slot(layer_fn, lambda: slot_of(j), x, extras, on, g, sums, add, skip_empty), None

                return jax.lax.scan(each, (g, sums), jnp.arange(b), reverse=True)[0], None
            clamped = jnp.minimum(w, self.windows - 1)
            zero = to_varying(jax.tree.map(lambda p, a: jnp.zeros(p.shape, a.dtype), block, sums), self._vary())

            def inner(carry, j):
                g, acc = carry
                k = w * b + j - k0
                add = lambda acc, dw: add_block(acc, j, dw)  # noqa: E731
                x = index_leaf(xs, j)
                slot = lambda: index_tree(block, j)  # noqa: E731
                on = (k >= 0) & (k < count)
                return backward_slot(layer_fn, slot, x, extras, on, g, acc, add, skip_empty), None

            (g, acc), _ = jax.lax.scan(inner, (g, zero), jnp.arange(b), reverse=True)
            return (g, self._add(sums, clamped, acc)), None

        def run(g, sums):
            (g, sums), _ = jax.lax.scan(outer, (g, sums), jnp.arange(self.blocks), reverse=True)
            return g, sums

        if not skip_empty:
            return run(g, sums)
        return jax.lax.cond(count > 0, run, lambda g, sums: (g, sums), to_varying(g, self._vary()), sums)

    def _block_slot_inputs(self, layer_fn, slot_of, first, inputs, i, extras, count, skip_empty: bool):
        """``[B, microbatch, ...]``: the inputs of block ``i``'s slots in a chunk pass, from ``inputs`` (a
        `RingEntry` of `saved` of them): read as saved, or, with `block_inputs`, the block's input read and the
        ``B - 1`` slots after it recomputed with the block's weights (``slot_of(j)``: slot ``j``'s, `_slot`;
        ``first``: the chunk slot of the block's first slot; slots outside ``[0, count)`` pass their input
        through, as in the forward pass)."""
        b = self.block
        if not self.block_inputs:
            return inputs.rows(i * b, b)
        none = jnp.zeros((), jnp.int32)

        def step(h, j):
            k = first + j
            on = (k >= 0) & (k < count)
            out, _ = forward_slot(layer_fn, lambda: slot_of(j), h, none, extras, on, skip_empty)
            return out, h

        last, before = jax.lax.scan(step, inputs[i], jnp.arange(b - 1))
        return jnp.concatenate([before, last[None]], axis=0)

    def backward_input(self, layer_fn, r, inputs, extras, count, g, kept, entry, skip_empty: bool):
        """`chunk_backward_input` (zero bubble's B pass) with the weights gathered again block by block (with
        `block_inputs`, each block's other slot inputs recomputed first, as `backward` does): each slot's cut
        (`LayerSplit.input_pass`) written into entry ``entry`` of the saved ring ``kept`` (``[E, P, ...]``) at
        its position, no gradient of the weights.

        Returns:
          ``(g, kept)``: the cotangent of the chunk's input and the ring (positions outside the chunk pass ``g``
          through and write nothing).
        """
        start, b, k0 = self._start(r), self.block, r * self.chunk_slots

        def outer(carry, i):
            g, kept = carry
            w = start + i
            block = self._block(w)
            slot_of = lambda j: self._slot(block, w, j)  # noqa: E731
            xs = self._block_slot_inputs(layer_fn, slot_of, w * b - k0, inputs, i, extras, count, skip_empty)

            def inner(carry, j):
                g, kept = carry
                k = w * b + j - k0
                x = index_leaf(xs, j)
                like = self._stand_in() if block is None else index_tree(block, j)
                cut = LayerSplit.trace(layer_fn, like, x, g, extras)
                on = (k >= 0) & (k < count)

                def back(g, kept):
                    dx, saved = cut.input_pass(slot_of(j), x, g, extras)
                    return dx, put_cut(kept, entry, i * b + j, saved, on)

                if skip_empty:
                    return jax.lax.cond(on, back, lambda g, kept: (g, kept), g, kept), None
                dx, kept = back(g, kept)
                return (jnp.where(on, dx, g), kept), None

            return jax.lax.scan(inner, (g, kept), jnp.arange(b), reverse=True)[0], None

        def run(g, kept):
            return jax.lax.scan(outer, (g, kept), jnp.arange(self.blocks), reverse=True)[0]

        if not skip_empty:
            return run(g, kept)
        return jax.lax.cond(count > 0, run, lambda g, kept: (g, kept), to_varying(g, self._vary()), kept)

    def backward_weight(self, layer_fn, r, kept, entry, extras, count, sums, like, skip_empty: bool):
        """`chunk_backward_weight` (zero bubble's W pass) from the cuts `backward_input` left in entry ``entry``
        of the saved ring: the weight-gradient products of each slot, and each block's gradient
        reduce-scattered into ``sums`` (`zeros`) once the block is done. The block is gathered only where the
        weight pass reads the weights (`LayerSplit.needs_params`; a dense layer's does not).

        Returns:
          ``sums`` with this chunk's slots added.
        """
        start, b, k0 = self._start(r), self.block, r * self.chunk_slots

        def outer(sums, i):
            w = start + i
            clamped = jnp.minimum(w, self.windows - 1)
            stand_in = self._stand_in()
            cut = LayerSplit.trace(layer_fn, stand_in, like, like, extras)
            if self.per_slot:  # each slot's gradient reduce-scattered into this device's row at once

                def each(sums, j):
                    k = w * b + j - k0
                    at = self._slot_index(w, j)
                    weights = lambda: self._slot(None, w, j) if cut.needs_params else stand_in  # noqa: E731

                    def dw():
                        return jax.tree.map(
                            lambda d: d[None], cut.weight_pass(weights(), get_cut(kept, entry, i * b + j))
                        )

                    on = (k >= 0) & (k < count)
                    if skip_empty:
                        return jax.lax.cond(on, lambda sums: self._add(sums, at, dw()), lambda sums: sums, sums), None
                    kept_dw = jax.tree.map(lambda d: jnp.where(on, d, jnp.zeros((), d.dtype)), dw())
                    return self._add(sums, at, kept_dw), None

                return jax.lax.scan(each, sums, jnp.arange(b))[0], None
            if cut.needs_params:
                block = self.fetch(clamped)
            else:
                block = jax.tree.map(lambda a: jnp.broadcast_to(a[None], (b, *a.shape)), stand_in)
            zero = to_varying(jax.tree.map(lambda p, a: jnp.zeros(p.shape, a.dtype), block, sums), self._vary())

            def inner(acc, j):
                k = w * b + j - k0

                def dw():
                    return cut.weight_pass(index_tree(block, j), get_cut(kept, entry, i * b + j))

                on = (k >= 0) & (k < count)
                if skip_empty:
                    return jax.lax.cond(on, lambda acc: add_block(acc, j, dw()), lambda acc: acc, acc), None
                kept_dw = jax.tree.map(lambda d: jnp.where(on, d, jnp.zeros((), d.dtype)), dw())
                return add_block(acc, j, kept_dw), None

            acc, _ = jax.lax.scan(inner, zero, jnp.arange(b))
            return self._add(sums, clamped, acc), None

        def run(sums):
            return jax.lax.scan(outer, sums, jnp.arange(self.blocks))[0]

        if not skip_empty:
            return run(sums)
        return jax.lax.cond(count > 0, run, lambda sums: sums, sums)
