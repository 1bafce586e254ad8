"""The residual stream split along ``embed`` over the axes that split the weights but not the batch.

Under ``--rule batch=data`` on ``data=2,fsdp=4`` (``fsdp_tp``) the weights' ``embed`` is split over ``fsdp``
(ZeRO-3) while every ``fsdp`` device holds the same rows. The partitioner then carries the residual stream
between the layers split along ``embed`` over those axes, as the RMSNorm scales ``[embed]`` are (the scan's
carry ``f32[rows, T, D/f]``, its saved activations too), rather than gathering the scales, as it does where
the batch is split over the same axes (every preset). What that costs, per microbatch, as jax 0.10 compiles it
on CPU (the ``test`` model: ``f32[8,64,128]`` gathers over ``fsdp``):

* each RMSNorm sums its squares over the split (an all-reduce of ``[tokens]`` float32, forward, backward, and
  again where full remat recomputes it) and multiplies by its scale's shard, so its output is gathered whole
  for the products that contract ``embed`` (the scales are never gathered over the stream's axes);
* the residual sums inside a layer (all but its last) are gathered;
* backward, the stream's cotangent is gathered at the block output's constraint and at each of the
  cotangent sums of a norm's input: two per norm;
* outside the layer loop, the stream leaving it (at its constraint) and the final norm's output, and their
  cotangents: four;
* a weight whose ``embed`` a product contracts (the query, key, value, gate and up projections) is gathered
  before its forward product only: its backward products take the stream's ``embed`` split as it is (the
  input gradient comes out split, the weight gradient from the split saved input). Those whose ``embed`` is
  the output (the attention output and down projections) are gathered again backward, and under full remat
  every weight is (`sharding.costmodel.partitioner._weight_gathers`); under ``dots`` the norms' outputs are
  gathered again backward and the layer input once more forward;
* where the weights are also split over axes the batch is split over (``--rule batch=data+expert`` on
  ``expert=4,fsdp=2``: ``embed`` over ``fsdp`` x ``expert``, the stream over ``fsdp``), the scales and the
  backward copies of the weights above are gathered over those to the stream's split (`shared_gathers`), and
  a mixture's experts are gathered again backward.

* the backward products take the stream's split (`gradient_shares`): each layer product's weight gradient
  (``[D/f, F]`` from the split saved input, ``[F, D/f]`` from the split cotangent) and the input gradient of
  those contracting ``embed`` (``[t, D/f]``), a quarter of their work on ``fsdp=4`` (2.82 GFLOP priced against
  2.85 compiled at 16 x 64 on ``data=2,fsdp=4``, 4.23 priced whole); the output projection's weight gradient
  too where its weight shares no axis with the batch (`head_backward_split`). Not inside pipeline stages.

Per layer of ``test`` (two norms) that is 3 stream gathers forward and 4 backward, 2 and 2 all-reduces: seen at
16 x 64 on ``data=2,fsdp=4`` with and without 2 microbatches, under full remat, on ``data=4,fsdp=2`` and on
``data=2,fsdp=2,tensor=2``, and on ``moe-test`` under ``batch=data+expert`` at 64 x 32 and 16 x 64 (its
dense layer and two mixture layers: 25 stream gathers). The gathers move the activations' dtype on GPU,
float32 on CPU (XLA:CPU upcasts bfloat16 collectives), an assumption on GPU.

Units: bytes, executions per step.
"""

from __future__ import annotations

import math

from sharding import axes as ax
from sharding.costmodel.collectives import Comm
from sharding.costmodel.layout import Layout, _fsdp_gather_bytes, _in_stack, _Placed, _Shape
from sharding.modeldesc import ModelDescription, Product


def _norm_scales(placed: dict[str, _Placed]) -> list[_Placed]:
    """The RMSNorm scales over the residual stream: role ``scale``, one ``[embed]`` dimension."""
    return [p for p in placed.values() if p.param.role == "scale" and p.param.axes == (ax.EMBED,)]


def stream_split_axes(layout: Layout, placed: dict[str, _Placed]) -> tuple[tuple[str, ...], int]:
    """``(axes, devices)``: the mesh axes that split the norm scales' ``embed`` but neither the batch nor the
    length under the layout's rules (``fsdp`` under ``--rule batch=data`` with ``fsdp_tp``), over which the
    partitioner splits the residual stream; ``((), 1)`` where there are none (every preset).

    Only where those axes lead the scales' split: gathering a scale ``[D/f]`` over the trailing axes, which the
    batch is split over, leaves it one block of the leading ones. Where they trail (``--rule batch=data+fsdp``
    on ``expert=4,fsdp=2``, ``embed`` over ``fsdp`` x ``expert``) the partitioner gathers the scales whole, as
    under a preset, and the stream stays whole (seen on ``moe-test`` at 64 x 32)."""
    scales = _norm_scales(placed)
    if not scales:
        return (), 1
    rules, mesh = layout.rules_table(), layout.mesh
    tokens = (*rules.batch_axes(mesh), *rules.length_axes(mesh))
    split = tuple(a for a in scales[0].split if scales[0].factor(a) > 1)
    axes = tuple(a for a in split if a not in tokens)
    if split[: len(axes)] != axes:
        return (), 1
    return axes, math.prod(mesh[a] for a in axes)


def forward_only_gathers(model: ModelDescription, layout: Layout, placed: dict[str, _Placed]) -> frozenset[str]:
    """The weights gathered before their forward product only, where the stream is split
    (`stream_split_axes`) and remat does not run the forward again: the per-layer weights outside the
    experts whose ``embed`` their product contracts. Empty where the stream is whole."""
    if stream_split_axes(layout, placed)[1] <= 1 or layout.remat == "full":
        return frozenset()
    contracting = {_in_stack(p.weight.path) for p in model.products if ax.EMBED in p.in_axes}
    return frozenset(
        path
        for path, p in placed.items()
        if p.param.per_layer and ax.EXPERT not in p.param.axes and _in_stack(path) in contracting
    )


def backward_split(layout: Layout, placed: dict[str, _Placed]) -> int:
    """The devices the residual stream is split over (`stream_split_axes`) where that splits backward products
    (`gradient_shares`): outside pipeline stages (whose map runs each layer on its own); 1 elsewhere."""
    if layout.mesh[ax.STAGE] > 1:
        return 1
    return stream_split_axes(layout, placed)[1]


def head_backward_split(model: ModelDescription, layout: Layout, placed: dict[str, _Placed]) -> int:
    """`backward_split` for the output projection's weight gradient: the stream's devices where its weight
    shares no axis with the batch (``test`` on ``data=2,fsdp=4``: ``f32[4096,32]``, the weight's own shard); 1
    where it does (``moe-test`` under ``--rule batch=data+expert`` on ``expert=4,fsdp=2``, ``unembed`` split over
    ``fsdp`` x ``expert``: ``f32[512,64]`` whole, the gradient summed over ``expert`` after)."""
    n = backward_split(layout, placed)
    if n <= 1 or _shared_axes(layout, placed[model.logits.weight.path])[1] > 1:
        return 1
    return n


def gradient_shares(product: Product, n: int, head: bool = False) -> tuple[float, float]:
    """``(input gradient, weight gradient)``: the share of each backward product of ``product`` one device
    computes of what it would on a whole stream, where the stream is split ``n`` ways along ``embed``
    (`backward_split`). As jax 0.10 compiles ``test`` under ``--rule batch=data`` (16 x 64 on
    ``data=2,fsdp=4``, with and without full remat or ``dots``, in 2 microbatches; ``data=4,fsdp=2``;
    ``data=2,fsdp=2,tensor=2``): the weight gradient of every product with ``embed`` on either side comes out
    split along ``embed`` (``[D/n, F]`` from the split saved input, ``[F, D/n]`` from the split cotangent); the
    input gradient of a product that contracts ``embed`` (q, k, v, gate, up) comes out split too ``[t, D/n]``,
    while one whose output is ``embed`` (the attention output, down) and the output projection (``head``: the
    final norm's output and its cotangent are gathered; ``n`` from `head_backward_split`) take the gathered
    cotangent and the gathered weight.
    The experts' products are left whole (not examined). ``(1, 1)`` where ``n`` is 1."""
    axes = (*product.in_axes, *product.out_axes)
    if n <= 1 or ax.EMBED not in axes or ax.EXPERT in axes:
        return 1.0, 1.0
    contracts = ax.EMBED in product.in_axes and not head
    return (1.0 / n if contracts else 1.0), 1.0 / n


def stream_comms(
    model: ModelDescription, layout: Layout, placed: dict[str, _Placed], s: _Shape, backend: str
) -> list[Comm]:
    """The collectives of a residual stream split along ``embed`` (see the module docstring) per step: the
    stream's gathers ``[tokens, D]`` and the norms' sums of squares ``[tokens]`` float32 over
    `stream_split_axes`. Empty where the stream is whole."""
    axes, n = stream_split_axes(layout, placed)
    if n <= 1:
        return []
    norms = sum(p.param.copies(s.layers) for p in _norm_scales(placed) if p.param.per_layer)
    final = sum(1 for p in _norm_scales(placed) if not p.param.per_layer)
    again = layout.remat != "none"  # the norms' outputs are no products: dots recomputes them too
    marked = s.layers if layout.remat == "dots" else 0  # the layer input, gathered where dots saves it
    width = _fsdp_gather_bytes(layout, backend)
    gathers = (2 * norms - s.layers) + 2 * norms + again * norms + marked + 4 * final
    sums = (2 + again) * norms + final
    return [
        Comm("all-gather", axes, n, s.tok * model.hidden * width, gathers * s.micro, "residual stream (embed split)"),
        Comm("all-reduce", axes, n, s.tok * 4, sums * s.micro, "RMSNorm sums of squares (embed split)", False),
    ]


def _shared_axes(layout: Layout, p: _Placed) -> tuple[tuple[str, ...], int]:
    """The axes of ``p``'s split that the batch is split over under the layout's rules, and their devices."""
    batch = layout.rules_table().batch_axes(layout.mesh)
    axes = tuple(a for a in p.split if p.factor(a) > 1 and a in batch)
    return axes, p.factor(*axes)


def shared_gathers(
    model: ModelDescription, layout: Layout, placed: dict[str, _Placed], s: _Shape, backend: str
) -> list[Comm]:
    """Where the stream is split (`stream_split_axes`) over some of the weights' axes and the batch over the
    others (``--rule batch=data+expert`` on ``expert=4,fsdp=2``: ``embed`` over ``fsdp`` x ``expert``, the
    stream over ``fsdp``), what brings a weight to the stream's split rather than whole: each norm scale
    gathered over the batch's axes before its multiply, forward and backward, and each weight of
    `forward_only_gathers` gathered over them for its backward products (``[D/f_stream, ...]``), per layer and
    microbatch. Seen on ``moe-test`` at 64 x 32 (``f32[32]`` scales and ``f32[32,4,16]`` query projections
    gathered over ``expert``). Empty where the stream is whole or the batch shares no axis with the weights."""
    if stream_split_axes(layout, placed)[1] <= 1:
        return []
    width = _fsdp_gather_bytes(layout, backend)
    once, scales = forward_only_gathers(model, layout, placed), _norm_scales(placed)
    comms = []
    for p in placed.values():
        axes, n = _shared_axes(layout, p)
        scale = p in scales
        if n <= 1 or not (scale or p.param.path in once):
            continue
        runs = p.param.copies(s.layers) * s.micro if p.param.per_layer else 1
        count = 2 * runs if scale else runs
        what = f"gather {p.param.path} to the stream's split" + ("" if scale else " (backward)")
        comms.append(Comm("all-gather", axes, n, p.local * n * width, count, what, layer_loop=p.param.per_layer))
    return comms
