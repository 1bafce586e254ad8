"""The residual stream split along ``embed`` over the axes that split the weights but not the batch.

Under ``--rule batch=data`` on ``data=2,fsdp=4`` (``fsdp_tp``) the weights' ``embed`` is split over ``fsdp``
(ZeRO-3) while every ``fsdp`` device holds the same rows. The partitioner then carries the residual stream
between the layers split along ``embed`` over those axes, as the RMSNorm scales ``[embed]`` are (the scan's
carry ``f32[rows, T, D/f]``, its saved activations too), rather than gathering the scales, as it does where
the batch is split over the same axes (every preset). What that costs, per microbatch, as jax 0.10 compiles it
on CPU (the ``test`` model: ``f32[8,64,128]`` gathers over ``fsdp``):

* each RMSNorm sums its squares over the split (an all-reduce of ``[tokens]`` float32, forward, backward, and
  again where full remat recomputes it) and multiplies by its scale's shard, so its output is gathered whole
  for the products that contract ``embed`` (the scales themselves are never gathered);
* the residual sums inside a layer (all but its last) are gathered;
* backward, the stream's cotangent is gathered at the block output's constraint and at each of the
  cotangent sums of a norm's input: two per norm;
* outside the layer loop, the stream leaving it (at its constraint) and the final norm's output, and their
  cotangents: four;
* a weight whose ``embed`` a product contracts (the query, key, value, gate and up projections) is gathered
  before its forward product only: its backward products take the stream's ``embed`` split as it is (the
  input gradient comes out split, the weight gradient from the split saved input). Those whose ``embed`` is
  the output (the attention output and down projections) are gathered again backward, and under full remat
  every weight is (`sharding.costmodel.partitioner._weight_gathers`).

Per layer of ``test`` (two norms) that is 3 stream gathers forward and 4 backward, 2 and 2 all-reduces: seen at
16 x 64 on ``data=2,fsdp=4`` with and without 2 microbatches, under full remat, on ``data=4,fsdp=2`` and on
``data=2,fsdp=2,tensor=2``. The gathers move the activations' dtype on GPU, float32 on CPU (XLA:CPU upcasts
bfloat16 collectives), an assumption on GPU.

Units: bytes, executions per step.
"""

from __future__ import annotations

import math

from sharding import axes as ax
from sharding.costmodel.collectives import Comm
from sharding.costmodel.layout import _DTYPE_BYTES, _PARAM_BYTES, Layout, _Placed, _Shape
from sharding.modeldesc import ModelDescription


def _norm_scales(placed: dict[str, _Placed]) -> list[_Placed]:
    """The RMSNorm scales over the residual stream: role ``scale``, one ``[embed]`` dimension."""
    return [p for p in placed.values() if p.param.role == "scale" and p.param.axes == (ax.EMBED,)]


def stream_split_axes(layout: Layout, placed: dict[str, _Placed]) -> tuple[tuple[str, ...], int]:
    """``(axes, devices)``: the mesh axes that split the norm scales' ``embed`` but neither the batch nor the
    length under the layout's rules (``fsdp`` under ``--rule batch=data`` with ``fsdp_tp``), over which the
    partitioner splits the residual stream; ``((), 1)`` where there are none (every preset)."""
    scales = _norm_scales(placed)
    if not scales:
        return (), 1
    rules, mesh = layout.rules_table(), layout.mesh
    tokens = (*rules.batch_axes(mesh), *rules.length_axes(mesh))
    axes = tuple(a for a in scales[0].split if scales[0].factor(a) > 1 and a not in tokens)
    return axes, math.prod(mesh[a] for a in axes)


def forward_only_gathers(model: ModelDescription, layout: Layout, placed: dict[str, _Placed]) -> frozenset[str]:
    """The weights gathered before their forward product only, where the stream is split
    (`stream_split_axes`) and remat does not run the forward again: the per-layer weights outside the
    experts whose ``embed`` their product contracts. Empty where the stream is whole."""
    if stream_split_axes(layout, placed)[1] <= 1 or layout.remat == "full":
        return frozenset()
    return frozenset(
        p.weight.path
        for p in model.products
        if p.weight.per_layer and ax.EXPERT not in p.weight.axes and ax.EMBED in p.in_axes
    )


def stream_comms(model: ModelDescription, layout: Layout, placed: dict[str, _Placed], s: _Shape, backend: str):
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
    width = _DTYPE_BYTES[layout.dtype] if backend == "gpu" else _PARAM_BYTES
    gathers = (2 * norms - s.layers) + 2 * norms + again * norms + marked + 4 * final
    sums = (2 + again) * norms + final
    return [
        Comm("all-gather", axes, n, s.tok * model.hidden * width, gathers * s.micro, "residual stream (embed split)"),
        Comm("all-reduce", axes, n, s.tok * 4, sums * s.micro, "RMSNorm sums of squares (embed split)", False),
    ]
