"""The collectives of a step without pipeline stages, as XLA's SPMD partitioner emits them.

Every collective the compiled step runs (`Comm`: kind, mesh axes, bytes of its per-device result,
the figure `sharding.hlo` reads from compiled HLO, and executions per step): FSDP's weight gathers
and gradient reductions, Megatron-style tensor parallelism, the vocabulary-parallel loss, the
uneven data-parallel step's explicit collectives, context parallelism over ``sequence``, and the
embedding lookup (`sharding.costmodel.embedding`).

What the compiler emits depends on the backend: XLA's CPU backend lowers a reduce-scatter to an
all-reduce of the whole array followed by a slice, so the FSDP gradient shows up on CPU as an
all-reduce of the whole (unsharded) gradient; GPU backends keep the reduce-scatter. Pass
``backend="cpu"`` to predict what a CPU compile shows (the tests check this against the compiler,
`sharding.hlo.collectives`), ``backend="gpu"`` (the default) for planning.

Units: bytes, executions per step.
"""

from __future__ import annotations

import dataclasses
import math

from sharding import axes as ax
from sharding.costmodel.collectives import Comm, _axes, _partitioner
from sharding.costmodel.context import context_groups, context_traffic
from sharding.costmodel.embedding import _embedding_comms, _table_split
from sharding.costmodel.layout import (
    _BATCH_FIELDS,
    _INT_BYTES,
    _PARAM_BYTES,
    Layout,
    _axis_split,
    _fsdp_gather_bytes,
    _place_cached,
    _Placed,
    _Shape,
    _stack_share,
    _tensor_split,
    attention_of,
    expert_placement_of,
)
from sharding.costmodel.sequence import sequence_parallel_comms
from sharding.costmodel.stream import forward_only_gathers, shared_gathers, stream_comms, stream_split_axes
from sharding.modeldesc import ModelDescription
from sharding.rules import Rules
from sharding.vocab import VocabSplit, choose_output


def _comms(
    model: ModelDescription,
    layout: Layout,
    rules: Rules,
    placed: dict[str, _Placed],
    s: _Shape,
    backend: str,
    batch_rows: float | None = None,
    embedding: bool = True,
) -> list[Comm]:
    if layout.uneven_batch:
        return _uneven_comms(model, layout, rules, placed, s, batch_rows)
    comms: list[Comm] = []
    split = _output_split(model, layout, rules, s)
    # the residual stream's split is the run's (on its own mesh: folding expert into fsdp would merge an axis
    # the batch is split over with one it is kept whole over)
    once, stream = forward_only_gathers(model, layout, placed), stream_split_axes(layout, placed)[1] > 1
    for part_layout, part in _zero_groups(model, layout, rules, placed):
        comms += _weight_gathers(part_layout, part, s, split, backend, once, stream)
        comms += _gradient_reductions(part_layout, part, s, backend, split)
    comms += stream_comms(model, layout, placed, s, backend) + shared_gathers(model, layout, placed, s, backend)
    comms += sequence_parallel_comms(_tensor_comms(model, layout, rules, s, split), model, layout, rules, s, backend)
    comms += _vocab_parallel_comms(model, layout, placed, s, split)
    if embedding:
        comms += _embedding_comms(model, *_zero_groups(model, layout, rules, placed)[0], s, layout)
    comms += _length_comms(model, layout, rules, s, backend)
    comms += _expert_comms(model, layout, rules, s)
    return comms


def _zero_groups(
    model: ModelDescription, layout: Layout, rules: Rules, placed: dict[str, _Placed]
) -> list[tuple[Layout, dict[str, _Placed]]]:
    """The parameters grouped by how their ZeRO-3 split is priced: ``[(layout, placed), ...]``, the
    weights outside the experts first.

    With ``expert`` > 1 the weights outside a mixture's experts have their ``embed`` split over ``fsdp``
    and ``expert`` (`sharding.rules`), and the batch is split over both: for them the step is the one of a
    mesh whose ``fsdp`` is ``fsdp * expert`` (the two axes are adjacent in the mesh), priced on that mesh.
    The experts' weights (split over ``expert`` by their experts, over ``fsdp`` by their embed, and summed
    over the batch axes but ``expert``) are priced on the mesh as it is."""
    mesh = layout.mesh
    if mesh[ax.EXPERT] <= 1:
        return [(layout, placed)]
    merged = dataclasses.replace(layout, mesh={**mesh, ax.FSDP: mesh[ax.FSDP] * mesh[ax.EXPERT], ax.EXPERT: 1})
    merged_placed = _place_cached(model, rules, tuple(merged.mesh.items()))
    experts = {path: p for path, p in placed.items() if ax.EXPERT in p.param.axes}
    others = {path: p for path, p in merged_placed.items() if path not in experts}
    return [(merged, others), (layout, experts)]


def _expert_comms(model: ModelDescription, layout: Layout, rules: Rules, s: _Shape) -> list[Comm]:
    """The mixture of experts' dispatch (`models.moe`) over the placement the model decides for a microbatch's
    tokens (`sharding.costmodel.layout.expert_placement_of`), per MoE layer and microbatch:

    * fixed buffers (`sharding.dispatch.ALL_TO_ALL`): two all-to-alls of the ``[E * C, D]`` buffer over the
      axes that split the experts forward (dispatch, combine) and two backward;
    * the ring (`sharding.dispatch.RING`) over the axes that split the experts and the tokens (G devices): the
      forward all-gathers the tokens ``[tok * G, D]`` with their routing (k int32 experts and k float32 weights
      per token) and reduce-scatters the partial outputs back to ``[tok, D]``; the backward is the transpose (an
      all-gather of the output gradients, a reduce-scatter of the token and weight gradients);
    * over the axes that split the experts but not the tokens (rules that keep the batch whole over them, or a
      batch they do not divide), where every device holds the same tokens: the partial outputs all-reduced
      ``[tok, D]`` forward, and the gradients of the tokens and of the combine weights (``[tok, D]`` and
      ``[tok, k]`` float32, one all-reduce as compiled) backward.

    Full remat runs the forward's again. ``tok`` is the layer's tokens on a device, the microbatch's over the
    devices that split them under the rules (the placement's ``token_split``; ``s.tok`` where those are the
    batch's and the length's axes). The router's scores gathered before ``top_k``: `_router_gathers`."""
    moe = model.experts
    if moe is None:
        return []
    rows = s.rows * layout.batch_split  # a microbatch's sequences, whole over the mesh
    place = expert_placement_of(model, rules, layout.mesh, (int(rows), s.seq) if rows == int(rows) else None)
    if not place.dispatch.collectives:
        return _router_gathers(model, layout, rules, s)
    tok = s.tok * layout.batch_split * layout.length_split / place.token_split
    n = moe.layers * s.micro
    forward = n * (1 + (layout.remat == "full"))
    tokens = tok * model.hidden * s.act_bytes
    routing = tok * moe.experts_per_token * 4
    if place.dispatch.fixed_buffers:  # fixed buffers [E * C, D], there and back, each way
        rows = moe.num_experts * math.ceil(moe.capacity_factor * tok * moe.experts_per_token / moe.num_experts)
        buffer = rows * model.hidden * s.act_bytes
        what = "MoE dispatch and combine"
        comms = [Comm("all-to-all", place.expert_axes, place.split, buffer, 2 * (forward + n), what, False)]
        return comms + _router_gathers(model, layout, rules, s)
    comms = _router_gathers(model, layout, rules, s)
    axes, g = place.gather_axes, place.gather_split
    if g > 1:
        comms += [
            Comm(
                "all-gather",
                axes,
                g,
                g * tokens,
                forward + n,
                "MoE tokens to the expert devices (and output grads)",
                False,
            ),
            Comm("reduce-scatter", axes, g, tokens, forward + n, "MoE partial outputs back (and token grads)", False),
            Comm("all-gather", axes, g, g * routing, 2 * forward, "MoE routing (experts, weights)", False),
            Comm("reduce-scatter", axes, g, routing, n, "MoE combine-weight gradients", False),
        ]
    summed = place.summed_expert_axes
    if summed:
        group = math.prod(layout.mesh[a] for a in summed)
        comms += [
            Comm(
                "all-reduce", summed, group, tokens, forward, "MoE partial outputs summed (tokens whole there)", False
            ),
            Comm("all-reduce", summed, group, tokens + routing, n, "MoE token and combine-weight gradients", False),
        ]
    return comms


def _routed_rows(model: ModelDescription, layout: Layout, rules: Rules, s: _Shape) -> float:
    """Rows of a device's grouped expert products per MoE layer and microbatch: its own tokens (``tok`` as in
    `_expert_comms`; ``s.tok`` inside pipeline stages, where the layer runs on the stage's own) times the routed
    copies it computes of each (`ExpertPlacement.copies_held`: ``k`` without expert parallelism,
    ``gather_split * min(k, E / E_p)`` under the ring)."""
    rows = s.rows * layout.batch_split
    place = expert_placement_of(model, rules, layout.mesh, (int(rows), s.seq) if rows == int(rows) else None)
    tok = s.tok * layout.batch_split * layout.length_split / place.token_split if place.token_axes else s.tok
    return tok * place.copies_held(model.experts.experts_per_token)


def _router_gathers(model: ModelDescription, layout: Layout, rules: Rules, s: _Shape) -> list[Comm]:
    """The router's float32 scores ``[B, T, E]`` gathered whole before ``top_k`` (`models.moe.route`), per
    MoE layer and microbatch, in every dispatch (the local one too): XLA's SPMD partitioner has no split
    ``top_k`` (the ``topk`` instruction, XLA:CPU's ``TopK`` custom call), so it replicates the operand over
    every axis that splits it, runs ``top_k`` on the microbatch's every token and slices its own back. The
    scores are split as the tokens are, over the rules' batch and length axes (not over ``tensor``, nor by
    sequence parallelism's split of the stream): one all-gather to ``[B, T, E]``, two where both split them
    (over the length axes to the device's rows first, ``[B / batch, T, E]``, then over the batch axes).
    Forward only (the backward scatters the chosen entries' cotangents on the split), again where remat
    recomputes it: ``full``, and ``dots`` (``top_k``'s output is not a product's). A standalone ``top_k`` on
    a batch split over 8 devices compiles the same gather on jax 0.10.2; seen in ``moe-test``'s step on
    ``expert=4,fsdp=2``, ``data=2,expert=4``, ``expert=2,fsdp=2,tensor=2``, ``fsdp=8``, ``sequence=2,expert=4``,
    under ``batch=data+fsdp`` and ``batch=data+expert``, in 2 microbatches and under each remat policy.
    Not inside pipeline stages (the layer runs locally in the stage's map, and the head's shape,
    ``s.layers == 0``, has no layers) nor in the uneven step (manual over its batch axes): there the scores are
    whole where ``top_k`` reads them."""
    moe, mesh = model.experts, layout.mesh
    batch, length = rules.batch_axes(mesh), rules.length_axes(mesh)
    split_b, split_l = math.prod(mesh[a] for a in batch), math.prod(mesh[a] for a in length)
    if moe is None or s.layers == 0 or split_b * split_l == 1:
        return []
    n = moe.layers * s.micro * (1 + (layout.remat in ("full", "dots")))
    whole = s.tok * split_b * split_l * moe.num_experts * 4  # a microbatch's scores, float32
    what = "router scores gathered whole for top_k (MoE)"
    comms = [Comm("all-gather", batch or length, split_b if batch else split_l, whole, n, what, False)]
    if batch and length:
        comms.append(Comm("all-gather", length, split_l, whole / split_b, n, what, False))
    return comms


def _uneven_comms(
    model: ModelDescription,
    layout: Layout,
    rules: Rules,
    placed: dict[str, _Placed],
    s: _Shape,
    batch_rows: float | None,
) -> list[Comm]:
    """The uneven data-parallel step (`train.strategies.UnevenGradients`), whose batch-axis collectives
    are explicit (`jax.shard_map` manual over ``data`` and ``fsdp``), so both backends emit them as
    written: the global batch gathered for the re-layout into per-group buffers (five [B, T]
    int32/float32 fields), each parameter gathered over the batch axes that split it once before the
    microbatch loop, and each gradient reduced once after it: a reduce-scatter to the shard, then an
    all-reduce of the shard over the other batch axes. With ``tensor`` (automatic inside the map), each
    of the group's microbatches adds the tensor-parallel collectives of the layers and the loss, as in
    the uniform step on the mesh without its batch axes (`_tensor_comms`, `_vocab_parallel_comms`,
    `_embedding_comms`)."""
    mesh = layout.mesh
    if mesh[ax.TENSOR] > 1:
        inner = dataclasses.replace(layout, mesh={**mesh, ax.DATA: 1, ax.FSDP: 1}, uneven_batch=False)
        inner_placed = _place_cached(model, rules, tuple(inner.mesh.items()))
        split = _output_split(model, inner, rules, s)
        in_loop = (
            _tensor_comms(model, inner, rules, s, split)
            + _vocab_parallel_comms(model, inner, inner_placed, s, split)
            + _embedding_comms(model, inner, inner_placed, s)
        )
    else:
        in_loop = []
    # fixed, not the rules': the step's map splits the rows over every batch axis, and check_uneven refuses a rule
    # that leaves one out (train.strategies.uneven)
    batch_axes, batch_n = _axes(mesh, ax.DATA, ax.FSDP)
    comms = []
    if batch_rows:
        field = batch_rows * s.seq * _INT_BYTES
        comms.append(Comm("all-gather", batch_axes, batch_n, field, _BATCH_FIELDS, "batch re-layout"))
    for p in placed.values():
        layers = s.slots if p.param.per_layer else 1
        split_axes = tuple(a for a in batch_axes if p.factor(a) > 1)
        n = p.factor(*split_axes)
        local, what = p.local * _PARAM_BYTES, p.param.path
        if n > 1:
            comms.append(Comm("all-gather", split_axes, n, local * n, layers, f"gather {what}"))
            comms.append(Comm("reduce-scatter", split_axes, n, local, layers, f"gradient of {what}"))
        rest = tuple(a for a in batch_axes if a not in split_axes)
        if rest:
            comms.append(
                Comm("all-reduce", rest, math.prod(mesh[a] for a in rest), local, layers, f"gradient of {what}")
            )
    return comms + in_loop


def _output_split(model: ModelDescription, layout: Layout, rules: Rules, s: _Shape) -> VocabSplit | None:
    """The vocabulary-parallel split of the loss (`sharding.vocab.choose_output`), or None (gathered,
    and always for an output projection that is the embedding table: tied)."""
    logits = model.logits
    if logits.weight.role != "output":
        return None
    rows = s.rows * layout.batch_split
    if rows != int(rows):
        return None
    return choose_output(layout.logits, rules, layout.mesh, logits.out_size, logits.in_size, int(rows), s.tok)


def _vocab_parallel_comms(
    model: ModelDescription, layout: Layout, placed: dict[str, _Placed], s: _Shape, split: VocabSplit | None
) -> list[Comm]:
    """The vocabulary-parallel loss (`models.output`), per microbatch, its collectives explicit.

    Over the group (f, the axes splitting the output weight's ``embed``): the weight shard traded
    for a vocabulary slice and its gradient traded back (two all-to-alls of the local shard
    ``[D/f, V/t]``), the group's activations gathered in float32 (``[f x tokens, D]``) with their
    targets, the activations' gradient reduce-scattered back (a reduce-scatter on both backends: it
    is written as one). Over the slices (group and ``tensor``): the softmax max, sum, target logit
    and the loss gradient of each group token (``[f x tokens]`` float32 each). Over ``tensor``: the
    local rows' input gradient. Over the token axes the weight is whole along (the rules' batch and length
    axes outside the slices: ``data`` under every preset): its gradient, the local shard; none over an axis the
    batch is kept whole over (``--rule batch=fsdp`` on a ``data`` mesh).
    """
    if split is None:
        return []
    mesh, m, d = layout.mesh, s.micro, model.logits.in_size
    weight = placed[model.logits.weight.path]
    f, group = split.group, split.group_axes
    slices = split.vocab_axes + group
    shard = weight.local * _PARAM_BYTES
    comms = [
        Comm(
            "all-to-all",
            group,
            f,
            shard,
            1 + m,
            "output weight: shard to vocabulary slice (once: the "
            "partitioner hoists it out of the microbatch loop) and its gradient back",
        ),
        Comm("all-gather", group, f, s.tok * f * d * 4, m, "loss: the group's activations", False),
        Comm("all-gather", group, f, s.tok * f * _INT_BYTES, m, "loss: the group's targets", False),
        Comm("reduce-scatter", group, f, s.tok * d * 4, m, "loss: activations' gradient", False),
        Comm(
            "all-reduce", slices, split.shards, s.tok * f * 4, 4 * m, "loss: softmax max, sum, target, gradient", False
        ),
    ]
    t = split.shards // f
    if t > 1:
        comms.append(
            Comm("all-reduce", split.vocab_axes, t, s.tok * d * 4, m, "loss: input gradient over tensor", False)
        )
    rules = layout.rules_table()
    tokens = (*rules.batch_axes(mesh), *rules.length_axes(mesh))
    rest, n = _axes(mesh, *(a for a in tokens if a not in slices))
    if n > 1:
        comms.append(Comm("all-reduce", rest, n, shard, m, f"gradient of {weight.param.path}"))
    return comms


def _weight_gathers(
    layout: Layout,
    placed: dict[str, _Placed],
    s: _Shape,
    split: VocabSplit | None = None,
    backend: str = "gpu",
    forward_only: frozenset[str] = frozenset(),
    split_stream: bool = False,
) -> list[Comm]:
    """FSDP: each weight split over ``fsdp`` is gathered before use, again in the backward pass.

    The gather moves the weight in the compute dtype on GPU (`_fsdp_gather_bytes`).

    Per-layer weights are gathered inside the layer loop (forward and backward, recompute sharing
    the backward's gather) for every microbatch; the final norm and output projection outside it,
    once per step (the partitioner hoists them out of the microbatch loop), the output projection
    a second time in the backward pass when ``tensor`` is split and so is ``data`` or the batch
    (microbatches). The
    embedding table is handled in `_embedding_comms`. KV projections left whole on ``tensor``: `_kv_weight_moves`.
    Where the rules keep the batch whole over ``fsdp`` and the residual stream is split along ``embed`` instead
    (``split_stream``, `sharding.costmodel.stream`): the norm scales are not gathered, and the weights in
    ``forward_only`` are gathered for their forward product only.
    """
    mesh = layout.mesh
    comms = []
    for p in placed.values():
        n = p.factor(ax.FSDP)
        if n <= 1 or p.param.role == "embedding" or (split is not None and p.param.role == "output"):
            continue
        if split_stream and p.param.role == "scale" and p.param.axes == (ax.EMBED,):
            continue
        result = p.local * n * _fsdp_gather_bytes(layout, backend)
        if p.param.per_layer:
            # a mixture's stack of one dense layer runs outside a layer loop, so the partitioner hoists its
            # gathers out of the microbatch loop: once a pass per step (moe-test in 2 microbatches)
            hoisted = p.param.stack == 1 and s.layers >= 1
            count = (1 if p.param.path in forward_only else 2) * p.param.copies(s.layers) * (1 if hoisted else s.micro)
            if ax.EXPERT in p.param.axes and layout.remat == "none" and not split_stream:
                # the experts' weights are gathered before the dispatch's map, whose input the backward
                # keeps (no remat): one gather per layer and microbatch; with the stream split, again backward
                count //= 2
        elif p.param.role == "output":
            regather = mesh[ax.TENSOR] > 1 and (mesh[ax.DATA] > 1 or s.micro > 1)
            count = 2 if regather else 1
        else:
            count = 2
        per_layer = p.param.per_layer
        moves = _kv_weight_moves(layout, p, result, count, s)
        if moves:
            t = mesh[ax.TENSOR]
            comms.append(Comm("all-gather", (ax.TENSOR,), t, result, count, f"gather {p.param.path}", layer_loop=True))
            comms += moves
            continue
        comms.append(Comm("all-gather", (ax.FSDP,), n, result, count, f"gather {p.param.path}", layer_loop=per_layer))
    return comms


def _kv_weight_moves(layout: Layout, p: _Placed, result: float, count: float, s: _Shape) -> list[Comm]:
    """A KV projection (``[embed, kv_heads, head_dim]``) split over ``fsdp`` but whole on ``tensor`` (fewer KV
    heads than ``tensor``, or ``kv_heads`` not mapped to it), where ``tensor`` is at least its ``fsdp``
    split: the partitioner gathers it over ``tensor`` instead, each device first receiving its ``1/t`` slice
    of ``embed`` by a collective-permute (before each gather, forward and backward), and sends the gradient's
    ``fsdp`` shard back to its owner by another. Seen on ``fsdp=2,tensor=4`` (K = 1 and 2, reference and flash
    attention) and ``data=2,fsdp=2,tensor=2`` (K = 1); not on ``fsdp=4,tensor=2``. Empty for any other
    weight."""
    t, n = layout.mesh[ax.TENSOR], p.factor(ax.FSDP)
    if not p.param.per_layer or ax.KV_HEADS not in p.param.axes or p.factor(ax.TENSOR) > 1 or t < max(n, 2):
        return []
    what = f"{p.param.path}: embed slices for the gather over tensor"
    gradient = p.local * _PARAM_BYTES
    return [
        Comm("collective-permute", (ax.FSDP, ax.TENSOR), 2, result / t, count, what, layer_loop=True),
        Comm("collective-permute", (ax.FSDP, ax.TENSOR), 2, gradient, count / 2, f"gradient of {p.param.path} back"),
    ]


def _gradient_reductions(
    layout: Layout, placed: dict[str, _Placed], s: _Shape, backend: str, split: VocabSplit | None = None
) -> list[Comm]:
    """Gradients summed over the batch axes, per layer and per microbatch.

    GPU: a reduce-scatter over ``fsdp`` for weights split over it (result: the local shard), then
    an all-reduce of the shard over ``data``. CPU: the reduce-scatter is lowered to an all-reduce
    of the whole gradient over ``data`` x ``fsdp``, followed, when both are split, by an all-reduce
    of the shard over ``data`` (what XLA CPU emits). Weights not split over ``fsdp``: one all-reduce
    over the batch axes. The batch axes are the rules' (`sharding.rules.Rules.batch_axes`): an axis the
    batch is kept whole over sums nothing, and weights split over ``fsdp`` while the batch is kept whole
    over it are reduced as unsplit ones (the device's shard, over the other batch axes). A split length
    (``context``, ``sequence``) is summed by an all-reduce of the shard of its own over the length axes
    (the partitioner emits one per group of axes; checked on CPU with ``data`` and with ``fsdp``: the
    Llama-3-8B USP dry run of ``bench/RESULTS.md``).
    """
    mesh = layout.mesh
    all_axes, all_n = _axes(mesh, *layout.rules_table().batch_axes(mesh))  # the batch's devices, as ruled
    length_axes, length_n = _axes(mesh, *layout.rules_table().length_axes(mesh))  # the length's
    if all_n * length_n <= 1:
        return []
    comms = []
    for p in placed.values():
        special = (p.param.role == "embedding" and _table_split(p) != (1, 1)) or (
            p.param.role == "output" and split is not None
        )
        if special:  # see _embedding_comms, _vocab_parallel_comms; over the length, summed whole (as compiled)
            if length_n > 1:
                whole = p.local * p.factor(ax.FSDP) * _PARAM_BYTES
                comms.append(Comm("all-reduce", length_axes, length_n, whole, s.micro, f"gradient of {p.param.path}"))
            continue
        # A mixture of experts' weights split over ``expert`` are summed over the other batch axes only.
        batch_axes = tuple(a for a in all_axes if not (a == ax.EXPERT and p.factor(ax.EXPERT) > 1))
        batch_n = math.prod(mesh[a] for a in batch_axes)
        count = s.micro * p.param.copies(s.layers)
        local = p.local * _PARAM_BYTES
        n_f = p.factor(ax.FSDP)
        what, loop = f"gradient of {p.param.path}", p.param.per_layer
        if length_n > 1:
            comms.append(
                Comm("all-reduce", length_axes, length_n, local, count, what + " (over the length)", layer_loop=loop)
            )
        if batch_n <= 1:
            continue
        if n_f <= 1 or ax.FSDP not in batch_axes:
            comms.append(Comm("all-reduce", batch_axes, batch_n, local, count, what, layer_loop=loop))
            continue
        if backend == "gpu":
            comms.append(Comm("reduce-scatter", (ax.FSDP,), n_f, local, count, what, layer_loop=loop))
        else:
            comms.append(Comm("all-reduce", batch_axes, batch_n, local * n_f, count, what, layer_loop=loop))
        if ax.DATA in batch_axes and (backend == "gpu" or not p.param.per_layer or p.param.matmul):
            comms.append(
                Comm("all-reduce", (ax.DATA,), mesh[ax.DATA], local, count, what + " (over data)", layer_loop=loop)
            )
    return comms


def _tensor_comms(
    model: ModelDescription,
    layout: Layout,
    rules: Rules,
    s: _Shape,
    output_split: VocabSplit | None = None,
    recomputes: float = 0,
    with_logits: bool = True,
) -> list[Comm]:
    """Megatron-style tensor parallelism (Shoeybi et al., 2019, section 3).

    Forward: the row-parallel products (an input axis split over ``tensor``, e.g. the attention
    output and the MLP's down projection) end in partial sums, all-reduced over ``tensor`` ([tokens,
    out] each), again where full remat (or ``recomputes`` more times, the pipeline's backward pass)
    recomputes the product. Backward: the input gradients of the
    column-parallel products (an output axis split) are partial sums; the partitioner reduces each
    separately ([tokens, in]); with fewer KV heads than the devices splitting the query heads, the keys' and
    values' cotangents too (`_kv_cotangent_comms`). The logits: the cross-entropy's max and sum over the split vocabulary
    ([tokens] float32 each) and the input gradient of the output projection (with the
    vocabulary-parallel loss, `_vocab_parallel_comms` instead), unless ``with_logits`` is False.

    A mixture of experts: each product in the layers that run it (`_stack_share`: the dense layers' MLP, the
    MoE layers' experts, the attention in every layer); the routed experts' down projection ends in partial
    sums of the combined ``[tokens, D]`` (not ``[tokens, E * D]``; the layer's map sums them after the combine),
    of the copies' ``[rows, D]`` inside pipeline stages (the partitioner sums them before it), and their gate
    and up projections' input gradients are partial sums over the routed copies' rows (`_routed_rows`), as
    compiled.
    """
    mesh = layout.mesh
    if mesh[ax.TENSOR] <= 1:
        return []
    t, n = mesh[ax.TENSOR], s.layers * s.micro
    forward: dict[float, float] = {}  # bytes of one all-reduce -> executions per layer and microbatch
    backward: dict[float, float] = {}
    for product in model.products:
        share = _stack_share(model, product.weight, s.layers)
        rows = outputs = s.tok
        out_size = product.out_size
        if product.groups > 1:  # the routed experts: partial sums of [rows, D], their copies' rows backward
            out_size //= product.groups
            rows = _routed_rows(model, layout, rules, s)
            if mesh.get(ax.STAGE, 1) > 1:  # inside a stage the partitioner sums the copies' outputs
                outputs = rows
        if _tensor_split(model, product.in_axes, rules, mesh):
            out = outputs * out_size * s.act_bytes
            recomputed = ((layout.remat == "full") + recomputes) * product.recomputed
            forward[out] = forward.get(out, 0) + (1 + recomputed) * share
        if _tensor_split(model, product.out_axes, rules, mesh):
            grad = rows * product.in_size * s.act_bytes
            backward[grad] = backward.get(grad, 0) + share
    comms = [
        Comm("all-reduce", (ax.TENSOR,), t, b, c * n, "row-parallel outputs (forward)", False)
        for b, c in forward.items()
    ]
    comms += [
        Comm("all-reduce", (ax.TENSOR,), t, b, c * n, "column-parallel input gradients", False)
        for b, c in backward.items()
    ]
    comms += _kv_cotangent_comms(model, layout, rules, s)
    logits = model.logits
    if not with_logits or output_split is not None or not _tensor_split(model, logits.out_axes, rules, mesh):
        return comms
    if s.micro > 1 and _partitioner() == "0.12":
        # jax 0.12 re-gathers the float32 logits' gradient [tokens, V] over tensor at the logits'
        # sharding constraint inside the microbatch loop.
        comms.append(
            Comm(
                "all-gather",
                (ax.TENSOR,),
                t,
                s.tok * logits.out_size * 4,
                s.micro,
                "logits gradient (jax 0.12, microbatches)",
                False,
            )
        )
    comms.append(Comm("all-reduce", (ax.TENSOR,), t, s.tok * 4, 2 * s.micro, "softmax max and sum", False))
    comms.append(
        Comm(
            "all-reduce",
            (ax.TENSOR,),
            t,
            s.tok * logits.in_size * 4,
            s.micro,
            "output projection input gradient",
            False,
        )
    )
    return comms


def _kv_cotangent_comms(model: ModelDescription, layout: Layout, rules: Rules, s: _Shape) -> list[Comm]:
    """Grouped-query attention whose KV heads the rules leave whole on ``tensor`` (K = ``num_kv_heads`` not
    divisible by ``tensor``: the KV projections replicated there) while the query heads are split over it.

    The score and value products (`models.attention_reference.reference_attention`'s, per KV head) then run with the KV
    dimension split over gcd(t, K) of the ``tensor`` devices and the query heads of one KV head over the other
    t / gcd(t, K). Their backward pass leaves each device its query heads' share of its KV heads' key and value
    cotangents ``[tokens, K/gcd(t, K), H]``; the replicated projections need them whole, so the partitioner sums
    each, keys and values, over the t / gcd(t, K) devices sharing a KV head (an all-reduce) and all-gathers it
    over the gcd(t, K) devices of distinct KV heads, once per layer and microbatch (in the activations' dtype;
    seen as ``f32[8,1,32,64]`` sums and ``f32[8,2,32,64]`` gathers for ``test``'s K = 2 on ``fsdp=2,tensor=4``,
    and as the sums alone for K = 1). None with a kernel that does not materialise the scores (it slices each
    device's KV heads itself, `models.attention_kernels.head_split`).
    """
    mesh, geometry = layout.mesh, model.attention
    if geometry is None or not attention_of(model, layout).materialises_scores:
        return []
    heads = _axis_split(model, geometry.heads_axis, rules, mesh)
    if heads <= 1 or _axis_split(model, geometry.kv_axis, rules, mesh) > 1:
        return []
    group = math.gcd(heads, geometry.num_kv_heads)  # devices of distinct KV heads
    whole = s.tok * geometry.num_kv_heads * geometry.head_dim * s.act_bytes  # keys or values, [tokens, K, H]
    count = 2 * s.layers * s.micro
    comms = []
    if heads // group > 1:
        what = "key and value cotangents summed over a KV head's query heads"
        comms.append(Comm("all-reduce", (ax.TENSOR,), heads // group, whole / group, count, what, False))
    if group > 1:
        comms.append(Comm("all-gather", (ax.TENSOR,), group, whole, count, "key and value cotangents", False))
    return comms


def _length_comms(model: ModelDescription, layout: Layout, rules: Rules, s: _Shape, backend: str) -> list[Comm]:
    """The traffic of a split length: a context-parallel kernel's own (`_context_comms`), else the
    partitioner's gathers of keys and values over ``sequence`` (`_sequence_comms`)."""
    if model.attention_kernel(layout.attention).splits_length:
        return _context_comms(model, layout, rules, s, backend)
    return _sequence_comms(model, layout, rules, s, backend)


def _context_comms(model: ModelDescription, layout: Layout, rules: Rules, s: _Shape, backend: str) -> list[Comm]:
    """A context-parallel kernel's collectives per layer and microbatch (`sharding.costmodel.context`):
    all-to-alls over its all-to-all axes, collective-permutes over its ring's, forward and backward
    (the forward's again under full remat). Heads are those of one ``tensor`` shard; the segment ids
    travel with the keys (the model always passes them); inside the scanned layer stack the backward
    resends the first key/value hop, unless full remat recomputes the forward beside it. The all-to-all's devices also gather the segment ids of the length
    they attend whole, once per microbatch. XLA's CPU backend upcasts bfloat16 collectives: float32 there
    (`_fsdp_gather_bytes`)."""
    kernel = model.attention_kernel(layout.attention)
    mesh = layout.mesh
    ring_axes, a2a_axes = context_groups(kernel, mesh, rules.mesh_axes(ax.LENGTH))
    ring, inner = math.prod(mesh[a] for a in ring_axes), math.prod(mesh[a] for a in a2a_axes)
    if ring * inner <= 1:
        return []
    geometry = model.attention
    shape = dict(
        batch=s.rows,
        length=s.seq,
        heads=geometry.num_heads // _axis_split(model, geometry.heads_axis, rules, mesh),
        kv_heads=max(1, geometry.num_kv_heads // _axis_split(model, geometry.kv_axis, rules, mesh)),
        head_dim=geometry.head_dim,
        ring=ring,
        all_to_all=inner,
        act_bytes=_fsdp_gather_bytes(layout, backend),
        segment_ids=True,
        first_hop_reused=False,
    )
    remat = layout.remat == "full"
    forward = context_traffic(kernel, training=False, **shape)
    # Full remat runs the forward again inside the backward's loop body, where the backward's first key/value
    # hop is the recomputed forward's (XLA merges the two sends).
    step = context_traffic(kernel, training=True, **{**shape, "first_hop_reused": remat})
    count = s.layers * s.micro
    again = 1 if remat else 0
    comms = []
    # The ring's hops overlap the block in hand (each is issued before its compute: Liu et al., 2023); the
    # all-to-alls sit between the projections and attention, on the critical path.
    for op, axes, what, overlappable in (
        ("all-to-all", a2a_axes, "attention: heads traded for the length (q, k, v, out; and back)", False),
        ("collective-permute", ring_axes, "attention: key/value blocks around the ring (and their gradients)", True),
    ):
        if op in step:
            group = ring if op == "collective-permute" else inner
            per_call = step[op] + again * forward[op]
            comms.append(Comm(op, axes, group, per_call, count, what, overlappable))
    if inner > 1:  # the same for every layer: the partitioner hoists it out of the layer loop
        ids = s.rows * s.seq / ring * _INT_BYTES
        comms.append(Comm("all-gather", a2a_axes, inner, ids, s.micro, "segment ids over the all-to-all", False))
    return comms


def _sequence_comms(model: ModelDescription, layout: Layout, rules: Rules, s: _Shape, backend: str) -> list[Comm]:
    """Context parallelism over the length's axes (``sequence``: a kernel that keeps the length whole is not
    priced over ``context``, `sharding.costmodel.layout.unpriced_attention`) as the partitioner does it for
    reference attention: keys and values gathered over them before the score product (forward, and again in
    the backward pass), their gradients reduce-scattered back (CPU: all-reduced whole). A rule that keeps
    the length whole (``--rule length=none``) gathers nothing."""
    mesh = layout.mesh
    axes, n = _axes(mesh, *rules.length_axes(mesh))
    if n <= 1:
        return []
    geometry = model.attention
    kv = _axis_split(model, geometry.kv_axis, rules, mesh)
    one = s.tok * n * geometry.num_kv_heads / kv * geometry.head_dim * s.act_bytes  # k or v, gathered
    count = s.layers * s.micro
    comms = [Comm("all-gather", axes, n, one, 4 * count, "keys and values", False)]
    if backend == "gpu":
        comms.append(Comm("reduce-scatter", axes, n, 2 * one / n, count, "key and value gradients", False))
    else:
        comms.append(Comm("all-reduce", axes, n, 2 * one, count, "key and value gradients", False))
    return comms
