"""The pipeline's edges in the 1F1B loop: the output head's weights and the entry (the token embedding).

The 1F1B family (`sharding.pipeline.onef1b`) runs the head (final norm, output projection, loss) on the last
virtual stage inside its loop, one microbatch at a time, and, where the plan streams its edges
(`sharding.pipeline.layout.PipelinePlan.streams_head`), the entry on stage 0 per microbatch too:

* `HeadWeights`: how the loop holds the head's (or the entry's) weights and sums their gradients, gathered
  once per step or per head step, over ``stage`` at every tick outside every conditional;
* `Entry`: the entry computed and differentiated per microbatch on the first virtual stage;
* `edge_specs`, `over_stage_specs`: their `PartitionSpec` over the stage program's manual axes, as the state
  stores them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding import axes as ax
from sharding.parallel import gather_shards, only_axes, psum_unsplit, reduce_shards, spec_axes, to_varying
from sharding.pipeline.buffers import index_tree
from sharding.pipeline.program import Setup, check_split, logical_leaves, manual_spec
from sharding.pipeline.storage import spread_over_stage


@dataclasses.dataclass(frozen=True)
class HeadWeights:
    """How the 1F1B loop holds the output head's weights and sums their gradients (the entry's too, `Entry`,
    always streamed, on stage 0).

    Gathered once (``--pipeline-gather once``, or a plan that computes every slot): the loop holds the whole
    weights, gathered before it (`hold`), and whole gradient sums in the weights' dtype, reduce-scattered
    after it (`finish`). Streamed (``--pipeline-gather microbatch`` with ``skip_empty``): the loop holds this
    device's blocks (the `jax.shard_map` blocks of ``specs``) and the head, which runs on the last virtual
    stage under a `jax.lax.cond`, all-gathers them inside its running branch (`fetch`) and reduce-scatters
    their gradient there (`reduce`) into float32 sums shaped as the blocks (`zeros`): the whole weights and
    one whole gradient are live only while a head step runs, at the price of an all-gather and a
    reduce-scatter per microbatch instead of one each per step. Those collectives stay among the devices of
    the last stage (``specs`` name batch axes only, `sharding.pipeline.program.check_split`), which all take
    the branch alike. A plan that computes every slot (no ``skip_empty``) runs the head on every stage at
    every tick, outside any conditional: streaming there would gather on every tick of every stage, ``ticks``
    times the step's one gather, so it keeps the gather once.

    Streamed, the weights also enter the loop split over ``stage`` as they are stored (`spread_over_stage`:
    ``stage_dims``), and each tick all-gathers them over ``stage`` outside every conditional (`over_stage`): a
    collective over ``stage`` cannot run inside the last stage's branch, and gathered once before the loop
    that copy (the head's and the table's ``[D/f, V]``, 250 MiB each per device on the 7B) would stay live
    through the whole loop. Per tick it is live only while the tick's head (or entry) step runs, for
    ``ticks`` gathers over ``stage`` of the stored shards instead of one; the gradient sums stay shaped as
    the gathered blocks and are summed over ``stage`` after the loop, each stage keeping its slice (`finish`:
    an all-reduce, as XLA lowers a reduce-scatter over ``stage`` of a table split over ``tensor`` too).

    Attributes:
      specs: per leaf of the head's parameters, its `PartitionSpec` over the map's manual axes, ``stage``
        left out (the blocks `fetch` gathers from).
      summed: the manual batch axes the per-device gradients are partial sums over.
      streamed: gathered per head step (above), else once per step.
      stage_dims: None, or per leaf the dimension its loop input is split over ``stage`` on (the last axis of
        that dimension's entry), or None for a leaf not split over ``stage``.
    """

    specs: Any
    summed: tuple[str, ...]
    streamed: bool
    stage_dims: Any = None

    def over_stage(self, held, tick):
        """The loop's inputs (split over ``stage`` on `stage_dims`) -> the blocks over the other axes,
        all-gathered over ``stage``; run at every tick, by every stage, outside any conditional. ``tick`` (the
        scan's int32 index) only orders the gather inside the tick: without it the gather would be loop
        invariant and XLA would hoist it before the loop, where its output would stay live throughout."""
        if self.stage_dims is None or not self.streamed:
            return held
        return self._stage_gather(jax.tree.map(lambda x: jnp.where(tick >= 0, x, jnp.zeros((), x.dtype)), held))

    def _stage_gather(self, held):
        if self.stage_dims is None:
            return held

        def one(x, dim):
            return x if dim is None else jax.lax.all_gather(x, ax.STAGE, axis=dim, tiled=True)

        return jax.tree.map(one, held, self.stage_dims, is_leaf=lambda x: x is None)

    def zeros_over_stage(self, held):
        """`zeros` of the blocks `over_stage` gathers from the loop's inputs ``held``."""
        if self.stage_dims is None or not self.streamed:
            return self.zeros(held)
        return self.zeros(jax.eval_shape(lambda h: self.over_stage(h, 0), held))  # the streamed sums: shapes only

    @property
    def vary(self) -> tuple[str, ...]:
        """The manual axes the loop's per-device values vary over: ``stage`` and the batch axes."""
        return (ax.STAGE, *self.summed)

    def _gather(self, blocks):
        return to_varying(jax.tree.map(gather_shards, blocks, self.specs), self.vary)

    def hold(self, blocks):
        """This device's ``blocks`` -> what the loop holds: the whole weights (gathered once, device-varying
        over `vary` so that differentiating the head adds no reduction inside the loop), or the blocks."""
        return blocks if self.streamed else self._gather(self._stage_gather(blocks))

    def fetch(self, held):
        """What the loop holds -> the whole weights for one head step (streamed: all-gathered here)."""
        return self._gather(held) if self.streamed else held

    def zeros(self, held):
        """The gradient sums' zeros, device-varying over `vary`: shaped as the whole weights in their dtype
        (gathered once), or as this device's blocks in at least float32 (streamed)."""
        if self.streamed:
            zeros = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.promote_types(w.dtype, jnp.float32)), held)
        else:
            zeros = jax.tree.map(jnp.zeros_like, held)
        return to_varying(zeros, self.vary)

    def reduce(self, grads, held):
        """One head step's whole gradients -> what the sums add: streamed, reduce-scattered over each spec's
        axes in the sums' float32 (XLA's CPU compiler aborts on a bfloat16 reduce-scatter, `Streamed`'s note)
        to this device's blocks; gathered once, as they are."""
        if not self.streamed:
            return grads
        return jax.tree.map(
            lambda g, w, spec: reduce_shards(g.astype(jnp.promote_types(w.dtype, jnp.float32)), spec, ()),
            grads,
            held,
            self.specs,
        )

    def finish(self, sums, blocks):
        """The step's gradient sums -> the gradients of this device's ``blocks``: summed over ``stage`` and the
        batch axes not yet reduced (gathered once: reduce-scattered over each spec's axes first), in the
        blocks' dtypes."""

        def one(g, w, spec, dim):
            if self.streamed:
                g = psum_unsplit(g, spec, self.summed)
            else:
                g = reduce_shards(g, spec, self.summed)
            g = jax.lax.psum(g, ax.STAGE).astype(w.dtype)
            if dim is not None:  # the blocks are split over stage too (`stage_dims`): this stage's slice
                size = w.shape[dim]
                g = jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(ax.STAGE) * size, size, dim)
            return g

        dims = jax.tree.map(lambda _: None, self.specs) if self.stage_dims is None else self.stage_dims
        return jax.tree.map(one, sums, blocks, self.specs, dims, is_leaf=lambda x: x is None)


@dataclasses.dataclass(frozen=True)
class Entry:
    """The pipeline's entry (the token embedding), computed by the first virtual stage one microbatch at a time.

    Under the same conditions as the streamed head (`PipelinePlan.streams_head`), the 1F1B loop holds no
    ``[M, microbatch, ...]`` stage inputs nor their cotangent: at a forward of chunk 0 on stage 0 the entry's
    weights are all-gathered (`HeadWeights.fetch`) inside a `jax.lax.cond` that only stage 0's devices take,
    and that microbatch's input computed from its entry inputs (int32 tokens ``[microbatch, length]``, held
    whole: small); at that microbatch's backward there the entry is differentiated (`jax.vjp`) with the input
    cotangent and its weights' gradient reduce-scattered into float32 shard sums (`HeadWeights.reduce`; the
    lookup's gradient reads no table value, so XLA drops that branch's gather: one per microbatch remains),
    summed over the other batch axes and ``stage`` after the loop (`HeadWeights.finish`). Narayanan et al.
    (SC'21), section 2.2: a stage then holds at most its ring's stage inputs, not ``M``.

    Attributes:
      fn: ``(entry_weights, inputs) -> h [microbatch, ...]`` in the compute dtype (the stage's ``par`` bound).
      weights: how the loop holds the entry's weights and sums their gradients (streamed).
      params: the entry's weights as the loop holds them (this device's blocks).
      h: one microbatch's `jax.ShapeDtypeStruct` of ``h`` on this device.
    """

    fn: Callable[..., Any]
    weights: HeadWeights
    params: Any
    h: Any

    def steps(self, xs, vary: tuple[str, ...]):
        """``(first_input, first_cotangent)`` of the tick loop (`sharding.pipeline.onef1b`) for entry inputs ``xs``
        ``[M, microbatch, ...]``: ``first_input(on, mb, blocks) -> h`` (zeros where not ``on``) and
        ``first_cotangent(on, mb, g_in, sums, blocks) -> sums`` (the entry gradient of microbatch ``mb`` added
        where ``on``), with the tick's ``blocks`` of the entry's weights (`HeadWeights.over_stage` of
        ``params``)."""

        def run_forward(inputs, blocks):
            h = self.fn(self.weights.fetch(blocks), inputs)
            return to_varying(h.astype(self.h.dtype), vary)

        def idle_forward(inputs, blocks):
            return to_varying(jnp.zeros(self.h.shape, self.h.dtype), vary)

        def run_backward(g_in, inputs, sums, blocks):
            _, vjp = jax.vjp(lambda w: self.fn(w, inputs), self.weights.fetch(blocks))
            (g_w,) = vjp(g_in.astype(self.h.dtype))
            return to_varying(jax.tree.map(jnp.add, sums, self.weights.reduce(g_w, blocks)), vary)

        def idle_backward(g_in, inputs, sums, blocks):
            return sums

        def first_input(on, mb, blocks):
            return jax.lax.cond(on, run_forward, idle_forward, index_tree(xs, mb), blocks)

        def first_cotangent(on, mb, g_in, sums, blocks):
            return jax.lax.cond(on, run_backward, idle_backward, g_in, index_tree(xs, mb), sums, blocks)

        return first_input, first_cotangent


def edge_specs(params, names, par, setup: Setup, what: str):
    """The `PartitionSpec` over the map's manual axes of each leaf of the head's or the entry's ``params``
    (``names``: their logical names; None: replicated).

    Raises:
      ValueError: ``names`` not shaped as ``params``; a leaf split over a manual axis the microbatches are
        not split over (``stage`` included: their gathers run inside one stage's conditional).
    """
    leaves, tree = jax.tree.flatten(params)
    if names is None:
        specs = [P()] * len(leaves)
    else:
        name_leaves = logical_leaves(names)
        if len(name_leaves) != len(leaves):
            raise ValueError(f"run_pipeline_loss: {len(name_leaves)} logical names for {len(leaves)} {what} parameters")
        specs = [manual_spec(par, n, w.shape, setup.manual) for n, w in zip(name_leaves, leaves)]
    check_split(specs, setup.weights.summed, par, setup.xs.shape[1], setup.data[1], skip_first=False)
    return jax.tree.unflatten(tree, specs)


def over_stage_specs(params, names, specs, par, setup: Setup):
    """``(in_specs, stage_dims)`` for streamed head or entry weights (`HeadWeights.stage_dims`): per leaf its
    `edge_specs` spec with ``stage`` added as the state stores it (`spread_over_stage`, cut to the map's
    manual axes) and the dimension that names it, where ``stage`` is that dimension's last axis and the rest
    is the leaf's spec (so gathering over ``stage`` gives `edge_specs`' block); else the spec and None."""
    leaves, tree = jax.tree.flatten(params)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    name_leaves = logical_leaves(names) if names is not None else [None] * len(leaves)
    in_specs, dims = [], []
    for w, spec, n in zip(leaves, spec_leaves, name_leaves):
        full = P() if n is None else par.spec(tuple(n), w.shape)
        staged = only_axes(spread_over_stage(full, w.shape, par.mesh_shape), setup.manual)
        entries = [spec_axes(e) for e in staged]
        dim = next((d for d, e in enumerate(entries) if ax.STAGE in e), None)
        own = [spec_axes(e) for e in spec] + [()] * (len(entries) - len(spec))
        if dim is not None and entries == [o + (ax.STAGE,) if d == dim else o for d, o in enumerate(own)]:
            in_specs.append(staged)
            dims.append(dim)
        else:
            in_specs.append(spec)
            dims.append(None)
    return jax.tree.unflatten(tree, in_specs), jax.tree.unflatten(tree, dims)
