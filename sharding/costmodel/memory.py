"""Bytes on one device for one step (`Memory`): parameters (float32), gradients (float32), AdamW's two
float32 moments, the batch, the activations saved for the backward pass under the remat policy, the
logits, and the gathered weights of one layer (FSDP).

Checked against ``compiled.memory_analysis().argument_size_in_bytes`` for the state and batch
(``tests/test_costmodel.py``). With a pipeline, the stored rows follow `sharding.pipeline.storage`
(`_held_params`); the in-flight terms are `sharding.costmodel.pipeline`'s.

Units: bytes (elements for `_held_params`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from sharding import axes as ax
from sharding.costmodel.experts import DENSE_GROUPED_BACKENDS, batched_experts
from sharding.costmodel.layout import (
    _BATCH_FIELDS,
    _INT_BYTES,
    _PARAM_BYTES,
    Layout,
    _axis_split,
    _copies_held,
    _per_token,
    _place_cached,
    _Placed,
    _Shape,
    attention_of,
    expert_placement_of,
)
from sharding.costmodel.partitioner import _fsdp_gather_bytes
from sharding.modeldesc import ModelDescription
from sharding.pipeline.storage import spread_over_stage, storage_axes
from sharding.rules import Rules, logical_to_spec


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes on one device.

    Attributes:
      parameters: float32 parameters (with a pipeline, the unpadded storage's rows: `_held_params`).
      gradients: float32 gradients (the accumulator when microbatching).
      optimizer: AdamW's two float32 moments.
      activations: Saved for the backward pass under the remat policy (one microbatch's); with
        pipeline stages, what each saved slot keeps (GPipe/circular: every slot of every step; 1F1B: its
        ring of at most about S microbatches' chunks) under the remat policy (``full``: its input, the
        backward recomputing the layer; ``none``: the layer's activations; ``dots``: its input and the
        products' outputs; `sharding.costmodel.pipeline._saved_per_slot`), every microbatch's stage input and
        its cotangent, and one layer's backward working set (its activations where it recomputes).
      logits: float32 logits and their gradient for one microbatch (with pipeline stages: one run of
        the head's rows, beyond a layer's backward working set, which they never peak with; so often 0).
      gathered: FSDP-gathered weights of one layer in flight (two buffers), in the dtype the gather moves
        (`sharding.costmodel.partitioner._fsdp_gather_bytes`: the compute dtype on GPU); with pipeline stages,
        the stage's working copy gathered once per step, in the compute dtype, alive through the step.
      batch: The step's input batch on this device.
      cpu_only: Of ``activations``, what only XLA:CPU allocates (`_grouped_cpu_bytes`: a mixture of experts'
        grouped products lowered densely, float32 copies of bfloat16 activations); 0 on other backends.
      before_loop: With pipeline stages gathering their working copy once (``gather`` ``once``), everything
        but ``gradients`` the step holds while it gathers the working copy before the tick loop
        (`sharding.costmodel.pipeline._pipeline_memory`: the gathered rows, a slice of them, the zeroed rings
        and cotangents, the head's weights); 0 otherwise.

    Phases: ``gradients`` (and the float32 gradient sums a pipeline zeroes before its gather) are live
    through the whole step; ``activations``, ``logits`` and ``gathered`` are the loop's (the layers' passes;
    without a pipeline, the whole step's); ``before_loop`` is the phase before a pipeline's tick loop, which
    never peaks with the loop's: some of its bytes (the rings, the head's weights) are also counted in
    ``activations`` and ``gathered``, so the parts do not add up to `in_flight` where it is nonzero.
    """

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    gathered: float
    batch: float
    cpu_only: float = 0.0
    before_loop: float = 0.0

    @property
    def state(self) -> float:
        """Parameters plus optimizer state (the donated train state)."""
        return self.parameters + self.optimizer

    @property
    def in_flight(self) -> float:
        """What the step allocates besides its arguments (the donated state and the batch): gradients,
        saved activations, logits and gathered weights, to compare with the compiler's
        ``temp_size_in_bytes``. The optimizer update adds nothing: it writes the donated moments and
        parameters in place, element by element (the train step computes it inside its finite-step
        conditional). A pipeline's step holds the larger of its two phases (`before_loop` and the tick
        loop's parts) beside the gradients, which both hold."""
        return max(self.in_loop, self.gradients + self.before_loop)

    @property
    def in_loop(self) -> float:
        """`in_flight`'s loop phase (a pipeline's tick loop; without one, the whole step): the gradients,
        saved activations, logits and gathered weights."""
        return self.gradients + self.activations + self.logits + self.gathered

    @property
    def total(self) -> float:
        """Bytes on the device at the step's peak: the arguments (state and batch) and `in_flight`."""
        return self.parameters + self.optimizer + self.batch + self.in_flight


def _held_params(model: ModelDescription, layout: Layout, rules: Rules, placed: dict[str, _Placed], s: _Shape) -> float:
    """Parameter elements one device holds between steps (its optimizer state is twice as many).

    Without a pipeline: each parameter's shard, the per-layer ones times ``slots``. With one (``stage``
    > 1), the unpadded storage (`sharding.pipeline.storage`): every device holds ``ceil(L / (S*G))``
    whole-layer rows, ``G`` the devices of the batch axes the rules split layer parameters over (a row is
    split over the other axes only), whatever its stage's layer count; the other parameters are also
    split over ``stage`` where a dimension allows (`spread_over_stage`).
    """
    mesh = layout.mesh
    if mesh[ax.STAGE] <= 1:
        return sum(p.local * p.param.copies(s.slots) for p in placed.values())
    return _held_pipeline_params(model, rules, tuple(mesh.items()), layout.pipeline_gather)


@functools.lru_cache(maxsize=4096)
def _held_pipeline_params(model: ModelDescription, rules: Rules, mesh_items: tuple, gather: str = "once") -> float:
    """`_held_params` with a pipeline (cached: the same for every stage device of a mesh): ``ceil(L / (S*G))``
    whole rows, or (``gather`` ``microbatch``: rows over ``stage`` alone) ``ceil(L / S)`` rows of which each
    device holds its share of the features."""
    mesh = dict(mesh_items)
    placed = _place_cached(model, rules, mesh_items)
    layer = [p for p in placed.values() if p.param.per_layer]
    axes = storage_axes([(None, *p.param.axes) for p in layer], rules, mesh, gather)
    rows = -(-model.num_layers // (mesh[ax.STAGE] * math.prod(mesh[a] for a in axes)))
    held = rows * sum(p.local * p.factor(*axes) for p in layer)
    for p in placed.values():
        if not p.param.per_layer:
            spec = spread_over_stage(logical_to_spec(p.param.axes, rules, p.param.shape, mesh)[0], p.param.shape, mesh)
            held += p.param.size / math.prod(mesh[a] for e in spec for a in ((e,) if isinstance(e, str) else e or ()))
    return held


def _grouped_cpu_bytes(model: ModelDescription, layout: Layout, rules: Rules, s: _Shape, backend: str) -> float:
    """What XLA:CPU alone holds for a mixture of experts' grouped products (`jax.lax.ragged_dot`), bytes; 0 on
    other backends. Its dense lowering (`sharding.costmodel.experts.DENSE_GROUPED_BACKENDS`) builds masked float32
    ``[E_local, rows, D]`` and ``[E_local, rows, F]`` operands in a layer's backward pass (three of the first and
    one of the second live at its peak: the rows, the output's cotangent and a relayout, and the hidden's); and
    with a bfloat16 step it upcasts the saved routed activations (the ``per_copy`` terms) to float32 copies for
    its dots, every layer's at once before the backward loop. Read from the buffer assignment of
    ``qwen3-30b-a3b`` on ``expert=8`` (2 layers, E 16 and 128, 8 x 256, bfloat16)."""
    experts = model.experts
    if experts is None or backend not in DENSE_GROUPED_BACKENDS or batched_experts(model, layout):
        return 0.0
    mesh = layout.mesh
    rows = s.tok * _copies_held(model, rules, mesh)  # routed copies one layer computes here
    local = expert_placement_of(model, rules, mesh).local_experts
    f = next(  # one expert's hidden width, split over tensor
        size for p in model.products if p.groups > 1 for a, size in zip(p.weight.axes, p.weight.shape) if a == ax.MLP
    ) / _axis_split(model, ax.MLP, rules, mesh)
    dense = local * rows * (3 * model.hidden + f) * 4
    upcast = 0.0
    if s.act_bytes < 4:
        per_copy = sum(
            t.amount / _axis_split(model, t.axis, rules, mesh) for t in model.activations if t.per_copy and not t.bytes
        )
        upcast = rows * per_copy * 4 * (s.layers if layout.remat == "none" else 1)
    return dense + upcast


def _attention_scores(model: ModelDescription, layout: Layout, rules: Rules, s: _Shape) -> tuple[float, float]:
    """``(keys, scores)``: the keys a layer's saved ``per_key`` terms count (the probabilities and the mask:
    ``s.seq`` where autodiff saves them, `AttentionTraits.saves_scores`, else 0), and the bytes per token of the
    score-sized arrays one layer's backward holds beyond what the layer saved (`AttentionTraits.backward_scores`
    float32 arrays, each with its mask, less the one saved); both 0 where the attention does not materialise the
    scores. Checked against XLA's buffer assignment of the 7B pipeline step (`bench/RESULTS.md`, "The reference
    attention's backward")."""
    attention = attention_of(model, layout)
    if not attention.materialises_scores:
        return 0.0, 0.0
    one = _per_token(model, "activations", rules, layout.mesh, s.seq, s.act_bytes) - _per_token(
        model, "activations", rules, layout.mesh, 0.0, s.act_bytes
    )
    return (s.seq if attention.saves_scores else 0.0), (attention.backward_scores - attention.saves_scores) * one


def _memory(
    model: ModelDescription,
    layout: Layout,
    rules: Rules,
    placed: dict[str, _Placed],
    s: _Shape,
    backend: str = "gpu",
) -> Memory:
    params = _held_params(model, layout, rules, placed, s) * _PARAM_BYTES
    adapters = sum(p.local * p.param.copies(s.slots) for p in placed.values() if p.param.role == "adapter")
    if adapters and model.frozen_bytes != _PARAM_BYTES:  # a frozen base held in bfloat16 (models.lora)
        params = adapters * _PARAM_BYTES + (params / _PARAM_BYTES - adapters) * model.frozen_bytes
    mesh = layout.mesh
    # a layer's probabilities count where autodiff saves them, and one layer's backward holds its attention's
    # score-sized arrays beyond what it saved
    keys, scores = _attention_scores(model, layout, rules, s)

    def saved_bytes(kept=None) -> float:  # per token of one layer
        return _per_token(model, "activations", rules, mesh, keys, s.act_bytes, kept)

    per_layer = saved_bytes()
    if layout.remat == "full":
        saved = s.tok * (s.layers * saved_bytes(("input",)) + per_layer + scores)
    elif layout.remat == "dots":
        saved = s.tok * s.layers * saved_bytes(("input", "dot")) + s.tok * (per_layer + scores)
    else:
        saved = s.tok * (s.layers * per_layer + scores)
    cpu_only = _grouped_cpu_bytes(model, layout, rules, s, backend)
    saved += cpu_only
    out = model.logits
    logits = 2 * s.tok * out.out_size / math.prod(_axis_split(model, a, rules, mesh) for a in out.out_axes) * 4
    gathered = 0.0
    if mesh[ax.FSDP] > 1:
        one_layer = sum(p.local * p.factor(ax.FSDP) for p in placed.values() if p.param.per_layer)
        gathered = 2 * one_layer * _fsdp_gather_bytes(layout, backend)  # as the gather moves them
    batch = _BATCH_FIELDS * s.rows * s.micro * s.seq / layout.length_split * _INT_BYTES
    trained = params
    if adapters:  # low-rank adapters: only they have gradients
        trained = adapters * _PARAM_BYTES  # and optimizer state; the frozen base has neither (models.lora)
    grads = trained
    if layout.uneven_batch:  # whole parameters and a whole gradient accumulator during the loop
        whole = (
            sum(p.param.size / p.factor(ax.TENSOR) * (s.slots if p.param.per_layer else 1) for p in placed.values())
            * _PARAM_BYTES
        )  # whole over the batch axes, still split over tensor
        gathered = whole if mesh[ax.FSDP] > 1 else 0.0
        grads = whole
    return Memory(
        parameters=params,
        gradients=grads,
        optimizer=2 * trained,
        activations=saved,
        logits=logits,
        gathered=gathered,
        batch=batch,
        cpu_only=cpu_only,
    )
