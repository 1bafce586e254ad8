"""The collectives of sequence parallelism beside tensor parallelism (the ``tp_sp`` and ``fsdp_tp_sp`` rules).

Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.2.2:
with the residual stream split along the length over ``tensor``, each block's all-reduce over ``tensor``
becomes an all-gather of the block's input before it and a reduce-scatter of its output after it, the same
bytes on the wire (a ring all-reduce is a reduce-scatter and an all-gather). In the backward pass the roles
swap: each block's input gradient is reduce-scattered (the all-gather's transpose) and its output gradient
all-gathered (the reduce-scatter's), and the norms' scales, now applied to 1/``tensor`` of the tokens on
each device, have their gradients all-reduced over ``tensor``.

What the compiled step runs, per layer and microbatch (`tests/test_sequence_parallel.py` counts them in the
compiled HLO): an all-gather of ``[tokens, embed]`` before each block and one in the backward pass for each
(forward again for each recomputation, ``remat="dots"`` included: it keeps the products' outputs, not their
gathered inputs), the row-parallel outputs and column-parallel input gradients that
`sharding.costmodel.partitioner._tensor_comms` prices as all-reduces reduce-scattered instead, and two
``[embed]`` float32 all-reduces (the norms' scale gradients); per microbatch, an all-gather of the loss's
input (the output projection reads the whole length), one of the embedding output's gradient, and the final
norm's scale gradient. A mixture of experts (`_blocks`): a MoE layer's block input is gathered once (the
router, the shared experts and the dispatch's map read the one copy), its output gradient once for each of the
shared experts' and the routed experts' down projections (2 gathers forward, 3 backward per MoE layer, 2 and 2
per dense layer: ``moe-test`` on ``fsdp=4,tensor=2``, ``data=2,tensor=4`` and ``expert=2,tensor=2,fsdp=2``);
each stack's blocks counted in its own layers. XLA's CPU backend lowers a reduce-scatter to an all-reduce of the whole array and a
slice, so for ``backend="cpu"`` the all-reduces stay as they are.

Units: bytes, executions per step.
"""

from __future__ import annotations

import dataclasses

from sharding import axes as ax
from sharding.costmodel.collectives import Comm
from sharding.costmodel.layout import Layout, _Shape, _stack_share, _tensor_split
from sharding.modeldesc import ModelDescription
from sharding.rules import Rules

ROW_PARALLEL = "row-parallel outputs (forward)"
COLUMN_GRADIENTS = "column-parallel input gradients"
OUTPUT_GRADIENT = "output projection input gradient"
_SCATTERED = (ROW_PARALLEL, COLUMN_GRADIENTS, OUTPUT_GRADIENT)
"""The `Comm.what` of the tensor-parallel all-reduces that sequence parallelism turns into reduce-scatters."""


def sequence_parallel_comms(
    comms: list[Comm],
    model: ModelDescription,
    layout: Layout,
    rules: Rules,
    s: _Shape,
    backend: str,
    with_edges: bool = True,
    recomputes: float = 0.0,
) -> list[Comm]:
    """``comms`` (a step's collectives priced without sequence parallelism) as the ``_sp`` rules run them.

    Args:
      comms: The step's collectives, the tensor-parallel ones as `_tensor_comms` prices them.
      model: The model.
      layout: The layout priced; nothing changes where the rules do not split ``act_length`` over ``tensor``.
      rules: The rules.
      s: Per-device sizes of one step (``tok``, ``layers``, ``micro``, ``act_bytes``).
      backend: ``gpu`` (reduce-scatters) or ``cpu`` (XLA:CPU's all-reduce and slice).
      with_edges: Whether the step's loss input and embedding output are priced here (False inside pipeline
        stages, whose head and entry are priced with the pipeline).
      recomputes: Forward passes of each layer a pipeline's backward pass adds (`_Pipe.recomputes`): each
        gathers its blocks' inputs again.

    Returns:
      The collectives: the changed all-reduces, then the added all-gathers and scale-gradient all-reduces.
    """
    t = rules.sequence_split(layout.mesh)
    if t <= 1:
        return comms
    out = []
    for c in comms:
        if c.kind == "all-reduce" and c.what in _SCATTERED and c.axes == (ax.TENSOR,):
            if backend != "cpu":
                c = dataclasses.replace(c, kind="reduce-scatter", result_bytes=c.result_bytes / t)
        out.append(c)
    n = s.layers * s.micro
    forward, backward = _blocks(model, layout, rules, s.layers)
    # a recomputed layer gathers every block's input again (even where it need not redo the product:
    # `remat="dots"` keeps the products' outputs, not their gathered inputs)
    forward_blocks = forward * n * (1 + (layout.remat != "none") + recomputes)
    whole = s.tok * model.hidden * s.act_bytes  # one microbatch's [tokens, embed] on this device, gathered
    out.append(Comm("all-gather", (ax.TENSOR,), t, whole, forward_blocks, "block inputs along the length", False))
    out.append(
        Comm("all-gather", (ax.TENSOR,), t, whole, backward * n, "block output gradients along the length", False)
    )
    scale = model.hidden * 4  # a norm's float32 scale
    out.append(Comm("all-reduce", (ax.TENSOR,), t, scale, 2 * n, "norm scale gradients (split tokens)", False))
    if with_edges:
        out.append(Comm("all-gather", (ax.TENSOR,), t, whole, 2 * s.micro, "loss input; embedding gradient", False))
        out.append(Comm("all-reduce", (ax.TENSOR,), t, scale, s.micro, "final norm scale gradient", False))
    return out


def _blocks(model: ModelDescription, layout: Layout, rules: Rules, layers: int) -> tuple[float, float]:
    """``(forward, backward)``: the all-gathers of ``[tokens, embed]`` along the length per layer, on average
    over ``layers`` layers (a mixture's dense layers and MoE layers are two stacks: `_stack_share`).

    Forward, one per block: each block's input is gathered once, read by every product of the block. Backward,
    one per row-parallel product (the block output's gradient gathered for each product that reads it): a
    mixture's routed experts, whose output the shared experts' sums into one block, gather it apart from the
    shared experts' down projection (the dispatch's map reads it in its own layout), 3 per MoE layer
    (attention, shared, routed) and 2 per dense layer, as the compiled step runs them.
    """
    rows = [p for p in model.products if _tensor_split(model, p.in_axes, rules, layout.mesh)]
    # the modules that hold a plain row-parallel product one level down (``layers/moe`` for ``layers/moe/shared/down``)
    shared = {p.weight.path.rsplit("/", 2)[0] for p in rows if p.groups == 1}
    forward = backward = 0
    for p in rows:
        share = _stack_share(model, p.weight, layers)
        backward += share
        if p.groups == 1 or p.weight.path.rsplit("/", 1)[0] not in shared:
            forward += share  # a routed product in a block of shared experts adds no block
    return forward, backward


__all__ = ["sequence_parallel_comms"]
