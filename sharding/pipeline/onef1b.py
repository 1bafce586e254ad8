"""The 1F1B schedules (PipeDream-Flush, and zero bubble) in one SPMD program, with the loss and the backward
pass inside.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(SC'21), section 2.2: after its warm-up forwards each stage alternates one forward and one backward,
so with one chunk per stage it keeps at most ``S`` microbatches' stage inputs where GPipe keeps all
``M``; with ``R`` chunks per stage (``--pipeline-repeats``) it is the interleaved schedule of section
2.2.2 over the circular layout (`sharding.pipeline.layout`).

One loop for every stage. Every device runs the same `jax.lax.scan` over the ticks of the plan's table
(`PipelinePlan.tick_table`: `sharding.pipeline.ticks.one_f_one_b_ticks` in lockstep, ``1f1b``, or
`sharding.pipeline.ticks.fused_ticks`, ``1f1b-fused``); at each tick a stage reads its forward and its
backward (each a chunk, a microbatch and buffer slots, or idle) from that table by its stage index. In
lockstep at most one of the two runs; fused, both do in steady state. A tick runs the forward first: the
chunk's slots (`program.chunk_forward`, each slot under a `jax.lax.cond`, none when the forward is idle),
keeping each slot's input in a ring of chunk inputs ``[slots, K, microbatch, ...]``; then the head, on
the last virtual stage; then the backward, which differentiates the slots from their saved inputs
(`program.chunk_backward`), so on the last virtual stage a microbatch's backward may share the tick of
its forward. Zero bubble (``zb``, `sharding.pipeline.ticks.zero_bubble_ticks`) splits that backward: the
input gradient (`program.chunk_backward_input`) at the backward's tick, leaving what each slot's weight
gradient needs (each product's input and output cotangent, `sharding.pipeline.split`) in a ring of its own,
and the weight gradient (`program.chunk_backward_weight`: the weight-gradient products alone) at the tick
its table gives, last in the tick. Cotangents that arrive before their backward wait in a second, smaller ring. Two
``ppermute`` per tick, outside every conditional (XLA's CPU backend deadlocks on a collective-permute
inside one): the forward output down the ring (stage ``S-1`` to 0 for the next chunk), the input's
cotangent up it; a stage with nothing to send sends what it holds, which the receiver ignores (the table
says when what arrives is real and which slot it goes to).

The loss inside the loop. The last stage needs a microbatch's output cotangent soon after its
forward, so the output head (final norm, projection, loss: ``head_fn``) runs on the last virtual
stage inside the loop, differentiated at once (`jax.value_and_grad`); its cotangent waits in the
cotangent ring for the backward. The whole pass is therefore a `jax.custom_vjp` whose forward rule
computes the loss and every gradient; its backward rule scales them by the loss's cotangent and
reduces them (layer weights: `weights.Weights.reduce`; head weights: reduce-scatter over the batch
axes, sum over ``stage``). Called without differentiation, the loop runs the forwards only.

Weights are gathered once per step (`weights.Weights.gather`, compute dtype) and the head's weights
once (their own dtype), both outside the loop; parameters, stage inputs and extras are cast
device-varying first so no reduction lands inside it. With ``--pipeline-gather microbatch`` the layers
are gathered per chunk pass (`weights.Streamed`) and the head's weights per head step, over ``stage`` at each
tick outside every conditional and over the batch axes inside its conditional on the last stage, their gradient
reduce-scattered there (`HeadWeights`); the entry (the token embedding, when `run_pipeline_loss` is given one)
runs likewise on stage 0 per microbatch (`Entry`), so the loop holds no stage inputs of all ``M`` microbatches
nor their cotangent.

Cost. A tick lasts as long as what runs in it. In lockstep neighbouring stages run a forward and a
backward in the same tick after warm-up, so with one chunk a step takes ``2 (M + S - 1)`` ticks of a
backward's time, against GPipe's ``M + S - 1`` steps of a forward plus a backward: the memory of ``S``
stage inputs instead of ``M`` is bought with time. Fused, a tick runs a forward and a backward, and a step
takes ``M + 2 (S - 1)`` such ticks (``R*M + (R+1) S - 2`` interleaved), near GPipe's time, holding up to
``2 (S - s) - 1`` stage inputs on stage ``s`` (`sharding.pipeline.ticks`: one hop per tick each way makes
a microbatch's round trip from stage 0 ``2 (S - 1)`` ticks long).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding import axes as ax
from sharding.parallel import to_varying
from sharding.pipeline.buffers import (
    RingEntry,
    index_leaf,
    index_tree,
    objective_cotangent,
    store,
    to_microbatches,
    with_objective_cotangent,
    write,
)
from sharding.pipeline.edges import Entry, HeadWeights, edge_specs, over_stage_specs
from sharding.pipeline.layout import PipelinePlan, head_parallelism
from sharding.pipeline.program import (
    Setup,
    StageTable,
    chunk_backward,
    chunk_backward_input,
    chunk_backward_weight,
    chunk_forward,
    cut_ring,
    keeps,
    kept_ring,
    manual_axes,
    slot_positions,
    stage_rings,
    stage_varying,
)
from sharding.pipeline.schedule import run_pipeline
from sharding.pipeline.ticks import BACKWARD, FORWARD, WEIGHT
from sharding.pipeline.traffic import ACTIVATIONS, COTANGENTS, PipelineTraffic
from sharding.pipeline.weights import Weights


class _Carry(NamedTuple):
    """What one stage's tick loop carries from tick to tick (`_TickLoop.tick`); None where not ``train``.

    Attributes:
      received: ``[microbatch, ...]`` the activations the previous stage sent at the last tick.
      g_received: the input cotangent the next stage sent at the last tick.
      buffer: ``[slots, P, microbatch, ...]`` the ring of chunk inputs (`Ticks.slots` entries).
      waiting: ``[cotangent_slots, microbatch, ...]`` output cotangents waiting for their backward.
      kept: zero bubble's ring of cuts (`sharding.pipeline.program.cut_ring`); ``()`` otherwise.
      residuals: where the stage keeps its layers' residuals (`_TickLoop.keep`), their ring
        (`sharding.pipeline.program.kept_ring`, entries as ``buffer``'s); ``()`` otherwise.
      grads, head_grads: the layer and head weights' gradient sums.
      g_xs: the cotangent of the first stage's inputs (with an `Entry`, its weights' gradient sums).
      loss, weight: float32 sums of the head steps run (and the layers' objectives).
      applied: int32 forward layer applications.
      stats: the layers' summed statistics (with an objective), else None.
    """

    received: Any
    g_received: Any
    buffer: Any
    waiting: Any
    kept: Any
    residuals: Any
    grads: Any
    head_grads: Any
    g_xs: Any
    loss: Any
    weight: Any
    applied: Any
    stats: Any


class _Forwarded(NamedTuple):
    """What a tick's forward leaves for its backward (`_TickLoop._forward`)."""

    h: Any  # [microbatch, ...] the chunk's output, sent down the ring
    inputs: Any  # the chunk's slot inputs, stored in the ring
    forward: Any  # bool: the tick ran a forward
    exit_: Any  # bool: on the last virtual stage
    slot: Any  # int32: the ring entry the inputs go to
    g_h: Any  # the head's cotangent of h (where it ran)
    g_hp: Any  # the head weights' gradient
    entry_blocks: Any  # the entry's weight blocks of this tick (with an `Entry`)


@dataclasses.dataclass(frozen=True)
class _TickLoop:
    """One stage's 1F1B loop (inside the stage program): what it runs and the step's data every tick reads.

    Attributes:
      layer: ``(layer_params, h, *extras) -> h``; with ``objective_axes``, ``-> (h, objective)``: entry 0 of
        the float32 objectives ``[objective_size]`` of the layers run is added to the loss sum, the others to
        the statistics (partial sums varying over those axes).
      back_layer: the layer the backward ticks differentiate (``layer``; for a layer with an objective,
        `sharding.pipeline.buffers.with_objective_cotangent` of it at
        `sharding.pipeline.buffers.objective_cotangent`, as the loss).
      head: ``(head_params, h, *head_inputs) -> (loss_sum, weight_sum)``.
      plan: the run's `PipelinePlan` (its tick table, `PipelinePlan.tick_table`).
      head_weights: how the loop holds the head's weights and sums their gradients.
      params: the stage's gathered weights, leaves ``[R, K, ...]``, or a `Streamed` (gathered per chunk pass).
      head_params: the head's weights as it holds them (`HeadWeights.hold`: whole, or this device's blocks).
      xs: ``[M, microbatch, ...]`` inputs of the first virtual stage (stage-varying); with ``entry``, the
        entry's inputs (e.g. int32 tokens ``[M, microbatch, length]``).
      extras, head_inputs: ``[M, microbatch, ...]`` side inputs of the layers and of the head.
      train: run the backward ticks too.
      vary: the manual axes the per-device sums vary over (``stage`` and the batch axes).
      objective_axes: None, or the axes the layers' objective varies over (as ``layer`` above).
      objective_size: the size of the layers' objective (1 without one).
      entry: None, or the `Entry` the first virtual stage computes its input with, per microbatch.
      keep: keep each slot's residuals from the forward tick for its backward (`sharding.pipeline.program.keeps`)
        instead of recomputing the layer there.
    """

    layer: Callable
    back_layer: Callable
    head: Callable
    plan: PipelinePlan
    head_weights: HeadWeights
    params: Any
    head_params: Any
    xs: Any
    extras: Any
    head_inputs: Any
    train: bool
    vary: tuple[str, ...]
    objective_axes: tuple[str, ...] | None = None
    objective_size: int = 1
    entry: Entry | None = None
    keep: bool = False

    def run(self, grads, head_grads):
        """All ticks of one stage.

        Args:
          grads, head_grads: zero accumulators shaped as ``params`` (or `Streamed.zeros`) and as
            `HeadWeights.zeros` of ``head_params`` (None when not ``train``).

        Returns:
          ``(loss_sum, weight_sum, applied, grads, head_grads, g_xs, stats)``: this device's float32 sums
          (nonzero on the last stage), its forward layer applications (int32), when ``train`` its gradient sums
          and the cotangent of ``xs`` ``[M, microbatch, ...]`` (nonzero on stage 0; with ``entry``, the entry
          weights' gradient sums, `HeadWeights.zeros` of them), else None for those, and with
          ``objective_axes`` the summed statistics ``[objective_size - 1]`` (else None).
        """
        ticks = self.plan.tick_table()
        traffic = PipelineTraffic.of_plan(self.plan, self.train)  # what each tick sends, and how many ticks
        table = StageTable.of(ticks, self.plan.layout)
        first = self._first_stage()
        init = self._init(ticks, table, first[2], grads, head_grads)
        tick = functools.partial(self.tick, table, first, traffic.sends())
        carry, _ = jax.lax.scan(tick, init, jnp.arange(traffic.trips))
        return carry.loss, carry.weight, carry.applied, carry.grads, carry.head_grads, carry.g_xs, carry.stats

    def _first_stage(self):
        """``(first_input, first_cotangent, zero_h)``: how the first virtual stage reads (or, with an `Entry`,
        computes) microbatch ``mb``'s input and takes its cotangent (`Entry.steps`), and a zero stage input."""
        if self.entry is None:
            xs = self.xs

            def first_input(on, mb, blocks):
                return index_leaf(xs, mb)

            def first_cotangent(on, mb, g_in, g_xs, blocks):
                return write(g_xs, mb, g_in, on)

            return first_input, first_cotangent, jnp.zeros_like(xs[0])
        return (*self.entry.steps(self.xs, self.vary), jnp.zeros(self.entry.h.shape, self.entry.h.dtype))

    def _init(self, ticks, table: StageTable, zero_h, grads, head_grads) -> _Carry:
        """The loop's first carry: empty rings sized by the tick table, zero sums."""
        train, vary = self.train, self.vary
        # K from the working copy, not the layout: the unpadded storage rounds a chunk's slots up to its gather
        # (`sharding.pipeline.storage`), and the extra slots are empty (skipped, or computed as padding).
        slots = slot_positions(self.params)
        buffer = jnp.zeros((ticks.slots, slots if train else 1, *zero_h.shape), zero_h.dtype)
        waiting = jnp.zeros((ticks.cotangent_slots, *zero_h.shape), zero_h.dtype) if train else None
        kept = ()
        if train and table.split:  # the saved ring: per entry, each slot position's cut (`sharding.pipeline.split`)
            like = to_varying(zero_h, vary)
            kept = cut_ring(self.back_layer, self.params, like, index_tree(self.extras, 0), ticks.saved_slots)
        residuals = ()
        if train and self.keep:
            like = to_varying(zero_h, vary)
            residuals = kept_ring(self.layer, self.params, like, index_tree(self.extras, 0), ticks.slots)
        zero = to_varying(jnp.zeros((), jnp.float32), vary)
        g_xs = None
        if train:
            g_xs = (
                jnp.zeros_like(self.xs)
                if self.entry is None
                else self.entry.weights.zeros_over_stage(self.entry.params)
            )
        init = (zero_h, zero_h if train else None, buffer, waiting, kept, residuals, grads, head_grads, g_xs)
        init = to_varying(init, vary)
        stats = None
        if self.objective_axes is not None:
            stats = to_varying(jnp.zeros((self.objective_size - 1,), jnp.float32), self.objective_axes)
        return _Carry(*init, zero, zero, to_varying(jnp.zeros((), jnp.int32), ax.STAGE), stats)

    def head_step(self, on, h, inputs, blocks):
        """The head on one microbatch's output ``h`` where ``on`` (the last virtual stage's forward), differentiated
        at once when ``train``: ``(loss, weight, g_h, g_head)``, zeros where not ``on``."""
        head_weights, train = self.head_weights, self.train

        def run(h, inputs):
            # streamed: gathered here, inside the branch the last stage's devices all take
            hp = head_weights.fetch(blocks)
            if train:
                value = jax.value_and_grad(lambda hp, h: self.head(hp, h, *inputs), argnums=(0, 1), has_aux=True)
                (loss, weight), (g_hp, g_h) = value(hp, h)
                g_hp = head_weights.reduce(g_hp, blocks)  # streamed: reduce-scattered to the shards here
            else:
                (loss, weight), g_hp, g_h = self.head(hp, h, *inputs), None, None
            return to_varying((loss.astype(jnp.float32), weight.astype(jnp.float32), g_h, g_hp), self.vary)

        def idle(h, inputs):
            zero = jnp.zeros((), jnp.float32)
            grads = (jnp.zeros_like(h), head_weights.zeros(blocks)) if train else (None, None)
            return to_varying((zero, zero, *grads), self.vary)

        if self.plan.skip_empty:
            return jax.lax.cond(on, run, idle, h, inputs)
        return jax.tree.map(lambda a: jnp.where(on, a, jnp.zeros((), a.dtype)), run(h, inputs))

    def tick(self, table: StageTable, first, sends, carry: _Carry, t):
        """Tick ``t`` of this stage: the forward (with the head on the last virtual stage), then, when ``train``,
        the backward; then the tick's ``ppermute`` s, outside every conditional, as the step's traffic lists
        them (``sends``, `sharding.pipeline.traffic.PipelineTraffic.sends`: the input's cotangent up the ring,
        the forward output down it)."""
        row = table.row(t)
        carry, forwarded = self._forward(table, first[0], carry, row, t)
        sent = {ACTIVATIONS: forwarded.h}
        if self.train:
            carry, sent[COTANGENTS] = self._backward(table, first[1], carry, row, forwarded)
        down, up = stage_rings(self.plan.layout.stages)
        received = {
            s.what: jax.lax.ppermute(sent[s.what], ax.STAGE, up if s.what == COTANGENTS else down) for s in sends
        }
        return carry._replace(received=received[ACTIVATIONS], g_received=received.get(COTANGENTS)), None

    def _forward(self, table: StageTable, first_input, carry: _Carry, row, t):
        """The tick's forward: the received activations stored, the chunk run on its input, the head on the last
        virtual stage. Returns the carry with the sums added and the `_Forwarded` values the backward reads."""
        layout, stage = self.plan.layout, table.stage
        forward, r, mb, slot = (row["forward" + part] for part in ("", "_chunk", "_microbatch", "_slot"))
        forward = forward == FORWARD
        arrive = row["arrive"]
        zero = jnp.zeros((), jnp.int32)
        buffer = store(carry.buffer, (jnp.maximum(arrive, 0), zero), carry.received, arrive >= 0)
        starts = (stage == 0) & (r == 0)  # the first virtual stage reads (or computes) the microbatch itself
        entry = self.entry
        entry_blocks = None if entry is None else entry.weights.over_stage(entry.params, t)  # every tick
        h_in = jnp.where(starts, first_input(forward & starts, mb, entry_blocks), RingEntry(buffer, slot)[0])
        h, done, inputs = chunk_forward(
            self.layer,
            self.params,
            r,
            h_in,
            index_tree(self.extras, mb),
            jnp.where(forward, table.counts[r], 0),
            self.plan.skip_empty,
            self.train,
            self.objective_axes,
            self.objective_size,
            self.keep,
        )
        loss, stats = carry.loss, carry.stats
        if self.objective_axes is not None:  # the layers' objectives join the loss sum, their statistics the stats
            done, objective = done
            loss, stats = loss + objective[0], stats + objective[1:]
        exit_ = (stage == layout.stages - 1) & (r == layout.repeats - 1)  # the last virtual stage runs the head
        blocks = self.head_weights.over_stage(self.head_params, t)  # every tick, outside the head's conditional
        loss_i, weight_i, g_h, g_hp = self.head_step(forward & exit_, h, index_tree(self.head_inputs, mb), blocks)
        carry = carry._replace(
            buffer=buffer,
            loss=loss + loss_i,
            weight=carry.weight + weight_i,
            applied=carry.applied + done,
            stats=stats,
        )
        return carry, _Forwarded(h, inputs, forward, exit_, slot, g_h, g_hp, entry_blocks)

    def _backward(self, table: StageTable, first_cotangent, carry: _Carry, row, fwd: _Forwarded):
        """The tick's backward, after its forward and head: the chunk's inputs and the head's cotangent stored,
        the received cotangent stored, the chunk's backward (zero bubble: its input gradient, and a weight
        gradient where the table gives one). Returns the carry and the chunk input's cotangent, which `tick`
        sends up the ring."""
        stage, counts, skip = table.stage, table.counts, self.plan.skip_empty
        inputs, residuals = fwd.inputs if self.keep else (fwd.inputs, carry.residuals)
        buffer = store(carry.buffer, (fwd.slot,), inputs, fwd.forward)
        if self.keep:  # the residuals beside the inputs, in the same entry
            residuals = tuple(store(b, (fwd.slot,), v, fwd.forward) for b, v in zip(carry.residuals, residuals))
        head_grads = jax.tree.map(jnp.add, carry.head_grads, fwd.g_hp)
        arrive = row["cotangent_arrive"]
        waiting = store(carry.waiting, (jnp.maximum(arrive, 0),), carry.g_received, arrive >= 0)
        waiting = store(waiting, (row["loss_slot"],), fwd.g_h, fwd.forward & fwd.exit_)
        # The backward runs after the forward and the head: on the last virtual stage it may be the
        # backward of the microbatch whose forward and loss this tick just ran (fused ticks).
        backward, r, mb, slot = (row["backward" + part] for part in ("", "_chunk", "_microbatch", "_slot"))
        backward = backward == BACKWARD
        c = row["cotangent_slot"]
        args = (RingEntry(buffer, slot), index_tree(self.extras, mb), jnp.where(backward, counts[r], 0))
        held = tuple(RingEntry(b, slot) for b in residuals) if self.keep else None
        kept, grads = carry.kept, carry.grads
        if table.split:  # zero bubble: B now, its cut into the saved ring; W from there at the tick the table gives
            g = index_leaf(waiting, c)
            g_in, kept = chunk_backward_input(
                self.back_layer, self.params, r, *args, g, kept, row["backward_saved"], skip, held
            )
            w_r = row["weight_chunk"]
            grads = chunk_backward_weight(
                self.back_layer,
                self.params,
                w_r,
                kept,
                row["weight_saved"],
                index_tree(self.extras, row["weight_microbatch"]),
                jnp.where(row["weight"] == WEIGHT, counts[w_r], 0),
                grads,
                index_leaf(buffer, 0)[0],
                skip,
            )
        else:
            g_in, grads = chunk_backward(
                self.back_layer, self.params, r, *args, index_leaf(waiting, c), grads, skip, held
            )
        g_xs = first_cotangent(backward & (stage == 0) & (r == 0), mb, g_in, carry.g_xs, fwd.entry_blocks)
        carry = carry._replace(
            buffer=buffer,
            waiting=waiting,
            kept=kept,
            residuals=residuals,
            grads=grads,
            head_grads=head_grads,
            g_xs=g_xs,
        )
        return carry, g_in


def _loss_program(
    layer_fn,
    head_fn,
    plan: PipelinePlan,
    par,
    weights: Weights,
    head_specs,
    remat_policy=None,
    objective: int = 0,
    entry_fn=None,
    entry_specs=None,
    head_stage_dims=None,
    entry_stage_dims=None,
    recompute: bool = True,
):
    """``f(stacked [1, slots, ...], head_params, entry_params, xs, extras, head_inputs) -> (loss_sum,
    weight_sum, applied, stats)`` for one stage (this device's partial sums), a `jax.custom_vjp` whose forward
    rule runs the whole 1F1B step (module docstring). With ``objective`` entry 0 of the layers' objectives is
    part of ``loss_sum``, differentiated with it, and ``stats`` the sums of their other entries
    (`run_pipeline_loss`; None without ``objective``; not differentiated). With ``entry_fn`` (``(par,
    entry_params, inputs) -> h``) ``xs`` are its inputs and the first virtual stage computes each microbatch's
    input from them (`Entry`); else ``entry_params`` is None and ``xs`` the first stage's inputs. Not
    ``recompute``, each slot's residuals are kept from its forward tick for its backward
    (`sharding.pipeline.program.keeps`)."""
    summed = weights.summed
    traffic = PipelineTraffic.of_plan(plan)  # where the layers and the head are gathered
    streamed = traffic.streams_layers
    head_weights = HeadWeights(head_specs, summed, traffic.streams_head, head_stage_dims)
    entry_weights = None if entry_fn is None else HeadWeights(entry_specs, summed, True, entry_stage_dims)

    def run(stacked, head_params, entry_params, xs, extras, head_inputs, train: bool):
        stage_par = par.inside(manual_axes(par))
        if objective:
            layer = lambda w, h, *e: layer_fn(stage_par, w, h, *e, batch_axes=summed)  # noqa: E731
        else:
            layer = lambda w, h, *e: layer_fn(stage_par, w, h, *e)  # noqa: E731
        if remat_policy is not None:
            layer = jax.checkpoint(layer, policy=remat_policy, prevent_cse=False)
        # The loss is differentiated inside the loop at cotangent 1 and every gradient scaled after it.
        back_layer = with_objective_cotangent(layer, objective_cotangent(objective)) if objective else layer
        head = lambda hp, h, *inputs: head_fn(stage_par, hp, h, *inputs)  # noqa: E731
        vary = (ax.STAGE, *summed)
        axes = vary if objective else None
        hp = head_weights.hold(head_params)
        entry = None
        if entry_fn is not None:
            fn = lambda w, inputs: entry_fn(stage_par, w, inputs)  # noqa: E731
            h = jax.eval_shape(
                lambda blocks, inputs: fn(entry_weights.fetch(entry_weights.over_stage(blocks, 0)), inputs),
                entry_params,
                xs[0],
            )
            entry = Entry(fn, entry_weights, entry_params, jax.ShapeDtypeStruct(h.shape, weights.dtype))
        grads = head_grads = None
        if streamed:  # each block gathered where a chunk runs it, its gradient reduce-scattered there
            params = weights.stream(stacked, plan.layout.repeats)
            grads = params.zeros() if train else None
        else:
            # Varying over the batch axes (and stage), so that differentiating adds no reduction inside the loop.
            params = to_varying(weights.gather(stacked, plan.layout.repeats), vary)
            if train:
                grads = to_varying(weights.sums_zeros(params, stacked), vary)
        if train:
            head_grads = head_weights.zeros_over_stage(hp)
        loop = _TickLoop(
            layer,
            back_layer,
            head,
            plan,
            head_weights,
            params,
            hp,
            xs,
            extras,
            head_inputs,
            train,
            vary,
            axes,
            max(objective, 1),
            entry,
            keeps(recompute, streamed, bool(objective)),
        )
        return loop.run(grads, head_grads)

    @jax.custom_vjp
    def program(stacked, head_params, entry_params, xs, extras, head_inputs):
        loss, weight, applied, *_, stats = run(stacked, head_params, entry_params, xs, extras, head_inputs, False)
        return loss, weight, applied, stats

    def forward(stacked, head_params, entry_params, xs, extras, head_inputs):
        loss, weight, applied, grads, head_grads, g_xs, stats = run(
            stacked, head_params, entry_params, xs, extras, head_inputs, True
        )
        return (loss, weight, applied, stats), (stacked, head_params, entry_params, grads, head_grads, g_xs)

    def backward(residuals, cotangents):
        stacked, head_params, entry_params, grads, head_grads, g_xs = residuals
        ct = cotangents[0]

        def scale(tree):
            return jax.tree.map(lambda g: (g * ct).astype(g.dtype), tree)

        d_head = head_weights.finish(scale(head_grads), head_params)
        finish = weights.finish if streamed else weights.reduce
        if entry_weights is None:  # g_xs: the cotangent of the first stage's inputs
            d_entry, d_xs = None, scale(g_xs)
        else:  # g_xs: the entry weights' gradient sums; its inputs (tokens) have none
            d_entry, d_xs = entry_weights.finish(scale(g_xs), entry_params), None
        return finish(scale(grads), stacked), d_head, d_entry, d_xs, None, None

    program.defvjp(forward, backward)
    return program


def run_pipeline_loss(
    layer_fn: Callable[..., Any],
    head_fn: Callable[..., Any],
    stacked,
    head_params,
    x,
    extras: Sequence[Any],
    head_inputs: Sequence[Any],
    par,
    *,
    names=None,
    head_names=None,
    remat_policy=None,
    objective: int = 0,
    entry_fn: Callable[..., Any] | None = None,
    entry_params=None,
    entry_names=None,
    recompute: bool = True,
):
    """The summed loss of a stacked layer function run as a pipeline, after an optional entry (the token
    embedding) and followed by an output head.

    With ``par``'s plan's schedule ``1f1b`` or ``1f1b-fused`` (interleaved with ``R > 1`` chunks per stage) the
    head runs inside the pipeline on the last stage, one microbatch at a time, and the backward pass of each
    microbatch follows its forward through the stages (module docstring); otherwise `run_pipeline` runs
    GPipe or circular and ``head_fn`` takes the whole batch after it, under `head_parallelism` of ``par``
    (each stage computes the head for 1/S of the rows; ``head_fn`` constrains its input to that layout).
    With ``entry_fn`` the layers' input is ``entry_fn(par, entry_params, x)``: computed on the whole batch
    first, or, where the plan streams the head (`PipelinePlan.streams_head`), per microbatch on the first
    virtual stage inside the 1F1B loop (`Entry`), so that no ``[M, microbatch, ...]`` stage inputs are held.

    Args:
      layer_fn: as `run_pipeline`: ``(par, layer_params, h, *extras) -> h``.
      head_fn: ``(par, head_params, h, *head_inputs) -> (loss_sum, weight_sum)``, float32 scalars summed
        over the rows of ``h`` ``[rows, ...]`` (its rows: a microbatch, or the whole batch).
      stacked: the stacked layer parameters, as `run_pipeline`.
      head_params: pytree of the head's parameters (the same on every stage; their gradients too).
      x: ``[batch, ...]`` activations entering the first layer (float; its dtype is the compute dtype); with
        ``entry_fn``, the entry's inputs (int32 tokens ``[batch, length]``).
      extras: side inputs ``[batch, ...]`` of every layer (None entries pass through).
      head_inputs: side inputs ``[batch, ...]`` of the head (targets int32, loss weights float32).
      par: the run's `sharding.parallel.Parallelism` (its ``pipeline`` a `PipelinePlan`), bound to a mesh.
      names: logical names of ``stacked``'s leaves, as `run_pipeline`.
      head_names: logical names of ``head_params``' leaves (a tree of tuples shaped as them); None: replicated.
      remat_policy, recompute: as `run_pipeline`.
      objective: 0, or the size of the layers' objective (as `run_pipeline`; ``layer_fn`` then returns ``(h,
        objective)``, float32 ``[objective]``): entry 0 summed over layers, microbatches and devices into
        ``loss_sum``, the others summed likewise into ``stats``.
      entry_fn: None, or ``(par, entry_params, inputs) -> h``: the layers' input ``[rows, ...]`` in the
        compute dtype from the entry's inputs ``[rows, ...]`` (its rows: a microbatch, or the whole batch).
      entry_params: pytree of the entry's parameters (with ``entry_fn``).
      entry_names: logical names of ``entry_params``' leaves, as ``head_names``.

    Returns:
      ``(loss_sum, weight_sum, applied)``: float32 scalars, and ``[stages]`` int32 forward layer
      applications per device of each stage (`PipelinePlan.layer_applications`). With ``objective``,
      ``(loss_sum, weight_sum, applied, stats)``: the summed statistics ``[objective - 1]``, float32.

    Raises:
      ValueError: as `run_pipeline`; an interleaved 1F1B plan (``R > 1``) whose microbatches are not a
        multiple of the stages; ``head_names`` (``entry_names``) not shaped as ``head_params``
        (``entry_params``); a head (entry) parameter split over a batch axis the microbatches are not split
        over.
    """
    plan = par.pipeline
    streams_head = plan is not None and plan.one_f_one_b and PipelineTraffic.of_plan(plan).streams_head
    streams_entry = entry_fn is not None and streams_head
    if entry_fn is not None and not streams_entry:  # the entry runs first, on the whole batch, as a layer would
        x = entry_fn(par, entry_params, x)
    if plan is None or not plan.one_f_one_b:
        out = run_pipeline(
            layer_fn,
            stacked,
            x,
            extras,
            par,
            names=names,
            remat_policy=remat_policy,
            objective=objective,
            recompute=recompute,
        )
        y, applied = out[:2]
        loss, weight = head_fn(head_parallelism(par), head_params, y, *head_inputs)
        if not objective:
            return loss, weight, applied
        return loss + out[2][0], weight, applied, out[2][1:]
    plan.tick_table()  # raises on a bad M
    setup = Setup.of(stacked, x, extras, par, names)
    weights = setup.weights
    head_specs = edge_specs(head_params, head_names, par, setup, "head")
    entry_specs = None
    if streams_entry:  # x holds the entry's inputs: the layers' compute dtype is that of the entry's output
        entry_specs = edge_specs(entry_params, entry_names, par, setup, "entry")
        h = jax.eval_shape(lambda p, inputs: entry_fn(par, p, inputs), entry_params, x)
        weights = dataclasses.replace(weights, dtype=h.dtype)
    else:
        entry_params = None
    head_inputs = jax.tree.map(lambda e: to_microbatches(e, plan.microbatches), tuple(head_inputs))
    head_in, head_dims = head_specs, None
    if streams_head:
        head_in, head_dims = over_stage_specs(head_params, head_names, head_specs, par, setup)
    entry_in, entry_dims = entry_specs, None
    if streams_entry:
        entry_in, entry_dims = over_stage_specs(entry_params, entry_names, entry_specs, par, setup)
    program = _loss_program(
        layer_fn,
        head_fn,
        plan,
        par,
        weights,
        head_specs,
        remat_policy,
        objective,
        entry_fn if streams_entry else None,
        entry_specs,
        head_dims,
        entry_dims,
        recompute,
    )
    vary = (ax.STAGE, *weights.summed)

    def stage_program(stacked, head_params, entry_params, xs, extras, head_inputs):
        # The entry's inputs are integers, not differentiated: cast as they are.
        xs = to_varying(xs, ax.STAGE) if streams_entry else stage_varying(xs)
        extras, head_inputs = to_varying((extras, head_inputs), ax.STAGE)
        loss, weight, applied, stats = program(stacked, head_params, entry_params, xs, extras, head_inputs)
        out = (jax.lax.psum(loss, vary), jax.lax.psum(weight, vary), applied[None])
        return (*out, jax.lax.psum(stats, vary)) if objective else out

    data = setup.data
    mapped = jax.shard_map(
        stage_program,
        mesh=par.mesh,
        in_specs=(
            setup.stacked_specs,
            head_in,
            entry_in,
            data,
            jax.tree.map(lambda _: data, setup.extras),
            jax.tree.map(lambda _: data, head_inputs),
        ),
        out_specs=(P(), P(), P(ax.STAGE), P()) if objective else (P(), P(), P(ax.STAGE)),
        axis_names=set(setup.manual),
    )
    return mapped(stacked, head_params, entry_params, setup.xs, setup.extras, head_inputs)
