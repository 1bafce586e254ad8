"""Cost model of one training step: FLOPs, bytes and collectives per device, and step time.

For a model described by a `sharding.modeldesc.ModelDescription` (its parameters with logical axes
and roles, matrix products, attention geometry, elementwise work and saved activations per token;
``models.spec.describe`` makes one), a global batch, a sequence length and a `Layout` (mesh sizes
over ``data, stage, fsdp, sequence, tensor``, a rules preset, microbatches, remat, stage split), it
predicts for one device; it knows nothing model-specific beyond the description:

* **FLOPs** (`Flops`): the matrix products of the forward pass, ``2 * m * n * k`` per product, and of
  the backward pass (twice the forward: the input and the weight gradient), as in Chowdhery et al.,
  PaLM (2022), Appendix B (``6 N`` per token plus ``12 L N H T`` for attention) and Narayanan et al.,
  "Efficient large-scale language model training on GPU clusters using Megatron-LM" (SC'21), section
  5.1 (``+2 N`` per token with full recomputation). The attention products are counted over the
  whole ``T x S`` score matrix for the reference (einsum + mask) implementation, and over half of it
  for FlashAttention, which skips masked tiles (Dao, FlashAttention-2, 2023, section 3.1), whose
  backward recomputes the scores (5 products instead of 4). Besides the products: the elementwise
  work as XLA counts it (1 FLOP per element per arithmetic op; the description's terms, times
  `ELEMENTWISE_BACKWARD_FACTOR` for the backward pass) and the optimizer update
  (`OPTIMIZER_FLOPS_PER_PARAM`).
* **Bytes** (`Memory`): parameters (float32), gradients (float32), AdamW's two float32 moments, the
  batch, the activations saved for the backward pass under the remat policy, the logits, and the
  gathered weights of one layer (FSDP).
* **Collectives** (`Comm`): every collective the partitioner emits, with its kind, mesh axes, the
  bytes of its per-device result (the figure `sharding.hlo` reads from compiled HLO) and how many
  times it runs per step.
* **Step time** (`step_time`): compute at ``efficiency x`` the device's peak FLOP/s, the optimizer's
  memory traffic at the device's memory bandwidth, and each collective by an alpha-beta model of its
  link class (within a host or across hosts): ring algorithms, Thakur, Rabenseifner and Gropp,
  "Optimization of collective communication operations in MPICH" (IJHPCA 2005), section 4, as NCCL
  implements them ("bus bandwidth" in the nccl-tests documentation, PERFORMANCE.md).

What the compiler emits depends on the backend: XLA's CPU backend lowers a reduce-scatter to an
all-reduce of the whole array followed by a slice, so the FSDP gradient shows up on CPU as an
all-reduce of the whole (unsharded) gradient; GPU backends keep the reduce-scatter. Pass
``backend="cpu"`` to predict what a CPU compile shows (the tests check this against the compiler),
``backend="gpu"`` (the default) for planning. The partitioner's choices for the token embedding
lookup (a gather from a table split over ``vocab`` and/or ``embed``) differ by layout and are modelled
case by case from what jax 0.10-0.12 emit (`_embedding_comms`).

Checked against the compiler (``tests/test_costmodel.py``, ``bench/costmodel.py``): on CPU,
`Cost.counted_flops` against ``compiled.cost_analysis()["flops"]``, which counts the body of each
``while`` loop once (the scanned layers and the microbatch loop), `Cost.matmul_flops` against the
products of the compiled HLO with loop trip counts folded in (`sharding.hlo.dot_flops`), the state
and batch bytes against ``compiled.memory_analysis().argument_size_in_bytes``, and the bytes of
each collective kind against `sharding.hlo.collectives`. Pipelines (section "Pipeline" below: GPipe,
circular and 1F1B over the unpadded stage storage, the head on 1/S of the rows) on the same figures
(``PIPELINE_GRID`` in ``bench/costmodel_grid.py``).

Units: FLOPs, bytes, seconds, FLOP/s, bytes/s. This module imports jax only (through
`sharding.rules`), never the model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from sharding import axes as ax
from sharding.modeldesc import ModelDescription, Param, Product
from sharding.pipeline.layout import plan_layout
from sharding.pipeline.storage import spread_over_stage, storage_axes
from sharding.rules import Rules, get_rules, logical_to_spec
from sharding.vocab import OUTPUT_IMPLS, VocabSplit, choose_output

__all__ = [
    "BACKENDS",
    "ELEMENTWISE_BACKWARD_FACTOR",
    "OPTIMIZER_FLOPS_PER_PARAM",
    "Comm",
    "Cost",
    "Flops",
    "Hardware",
    "Layout",
    "Memory",
    "StepTime",
    "collective_bytes",
    "comm_seconds",
    "describe_model",
    "device_cost",
    "estimate",
    "hardware_for",
    "link_classes",
    "step_time",
]

BACKENDS = ("gpu", "cpu")
_PARAM_BYTES = 4  # parameters, gradients and AdamW moments are float32
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_INT_BYTES = 4  # int32 tokens, positions, segment ids
_BATCH_FIELDS = 5  # tokens, targets, positions, segment_ids (int32), loss_mask (float32)
_WHOLE_SCORES = ("reference", "dot_product")  # attentions that materialise the [T, S] scores (XLA's dot_product too)

#: XLA-counted FLOPs per parameter of the update (HloCostAnalysis: 1 FLOP per element per
#: arithmetic op; square roots are counted as transcendentals, not FLOPs). The step divides the
#: gradient by the token count (1), takes the gradient norm for the metrics and for clipping
#: (2 + 2: square, sum), clips (3: divide, multiply, select), updates AdamW's moments (3 + 4),
#: corrects their bias (2), forms the update (3: add eps twice, divide), adds decoupled weight decay
#: (2), scales by the learning rate (1), applies it (1) and keeps the old values when the step is
#: not finite (3 selects: parameter and two moments), about 30; compiling the step of a 1-layer
#: ``test`` model on ``data=8`` with 8, 16 and 32 tokens per device and subtracting the
#: per-token part gives 34.9 (bench/costmodel.py prints it). We use 35.
OPTIMIZER_FLOPS_PER_PARAM = 35.0

#: The backward pass does about twice the forward's elementwise work (the model's elementwise terms,
#: `sharding.modeldesc.ModelDescription.layer_elementwise`, are of the forward pass).
ELEMENTWISE_BACKWARD_FACTOR = 2.0


# --- Layouts ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one step is laid out over the devices.

    Attributes:
      mesh: Mesh axis -> size over ``data, stage, fsdp, sequence, tensor`` (missing axes are 1).
      rules: Rules preset name (``dp``, ``fsdp``, ``tp``, ``fsdp_tp``) or a `Rules` table.
      microbatches: M, gradient-accumulation steps per global batch (pipeline microbatches when
        ``stage > 1``).
      remat: ``none``, ``dots`` or ``full`` (`models.config.REMAT_POLICIES`).
      stage_layers: Layers per pipeline stage, one per ``stage`` index, summing to the model's
        layers; None splits evenly (`sharding.pipeline.layout.plan_layout`).
      pipeline_repeats: R, stage chunks per device (circular schedule); 1 is GPipe.
      attention: ``reference`` or ``dot_product`` (full score matrix; ``jax.nn.dot_product_attention``'s
        XLA implementation is modelled as reference) or ``flash`` (masked tiles skipped).
      dtype: Compute dtype of activations, ``float32`` or ``bfloat16``.
      uneven_batch: The uneven data-parallel step (`train.strategies.UnevenGradients`): each
        data-parallel group loops over its own microbatches with the parameters gathered over the
        batch axes once before the loop (still split over ``tensor``), and the gradients are reduced
        once after it (``data``/``fsdp``/``tensor`` meshes; tensor collectives run per microbatch).
      logits: How the output projection and loss are laid out (`sharding.vocab`): ``gathered``,
        ``vocab_parallel`` or ``auto`` (what `sharding.vocab.choose_output` picks). Modelled for
        untied embeddings.
      skip_empty: Pipeline only: empty slots and bubble steps are skipped by conditionals
        (`sharding.pipeline.PipelinePlan.skip_empty`); False prices every slot of every step, which
        is also what a compiled program's loop trip counts say (a branch counted on every trip).
      one_f_one_b: Pipeline only: the 1F1B schedule (``--pipeline-schedule 1f1b``,
        `sharding.pipeline.onef1b`; interleaved with ``pipeline_repeats`` > 1) instead of GPipe/circular.

    Raises:
      ValueError: On an unknown axis, a size below 1, or an unknown remat/attention/dtype.
    """

    mesh: Mapping[str, int]
    rules: str | Rules = "fsdp_tp"
    microbatches: int = 1
    remat: str = "none"
    stage_layers: tuple[int, ...] | None = None
    pipeline_repeats: int = 1
    attention: str = "reference"
    dtype: str = "float32"
    uneven_batch: bool = False
    logits: str = "auto"
    skip_empty: bool = True
    one_f_one_b: bool = False

    def __post_init__(self) -> None:
        full = {a: 1 for a in ax.MESH_AXES}
        for name, size in dict(self.mesh).items():
            if name not in full:
                raise ValueError(f"mesh axis {name!r} unknown; known: {', '.join(ax.MESH_AXES)}")
            if int(size) < 1:
                raise ValueError(f"mesh axis {name}={size}: sizes must be >= 1")
            full[name] = int(size)
        object.__setattr__(self, "mesh", full)
        if self.stage_layers is not None:
            object.__setattr__(self, "stage_layers", tuple(int(n) for n in self.stage_layers))
        for field, allowed in (("remat", ("none", "dots", "full")), ("attention", ("reference", "flash", "dot_product")),
                               ("dtype", tuple(_DTYPE_BYTES)), ("logits", OUTPUT_IMPLS)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"--{field} {getattr(self, field)!r}: choose one of {', '.join(allowed)}")
        if self.microbatches < 1 or self.pipeline_repeats < 1:
            raise ValueError("--microbatches and --pipeline-repeats must be >= 1")

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def batch_split(self) -> int:
        """Devices the batch is split over (``data`` x ``fsdp``)."""
        return self.mesh[ax.DATA] * self.mesh[ax.FSDP]

    def rules_table(self) -> Rules:
        return self.rules if isinstance(self.rules, Rules) else _preset(self.rules)

    @property
    def rules_name(self) -> str:
        return self.rules.name if isinstance(self.rules, Rules) else self.rules


@functools.lru_cache(maxsize=None)
def _preset(name: str) -> Rules:
    return get_rules(name)


# --- The model's description -----------------------------------------------------------------


def describe_model(model: Any) -> ModelDescription:
    """``model`` as a `ModelDescription`: itself, or what its ``describe()`` returns
    (`models.config.ModelConfig.describe`).

    Raises:
      TypeError: When it is neither.
    """
    if isinstance(model, ModelDescription):
        return model
    describe = getattr(model, "describe", None)
    if describe is None:
        raise TypeError(f"expected a ModelDescription or an object with describe(), got {type(model).__name__}")
    return describe()


@dataclasses.dataclass(frozen=True)
class _Placed:
    """A parameter with its split under a mesh and rules.

    Attributes:
      param: The parameter (`sharding.modeldesc.Param`).
      split: Mesh axis -> size, for the axes that split it.
      local: Elements per device (one layer's slice for per-layer parameters).
    """

    param: Param
    split: dict[str, int]
    local: float

    def factor(self, *axes: str) -> int:
        out = 1
        for a in axes:
            out *= self.split.get(a, 1)
        return out


@functools.lru_cache(maxsize=4096)
def _place_cached(model: ModelDescription, rules: Rules, mesh_items: tuple) -> dict[str, _Placed]:
    """Path -> the placed parameter (shared between calls: do not modify)."""
    return {p.param.path: p for p in _place(model.params, rules, dict(mesh_items))}


def _place(params: Sequence[Param], rules: Rules, mesh: Mapping[str, int]) -> list[_Placed]:
    placed = []
    for p in params:
        pspec, _ = logical_to_spec(p.axes, rules, p.shape, mesh)
        split: dict[str, int] = {}
        for entry in pspec:
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                split[axis] = mesh[axis]
        placed.append(_Placed(p, split, p.size / math.prod(split.values())))
    return placed


def _split_of(logical: str, size: int, rules: Rules, mesh: Mapping[str, int]) -> int:
    """How many ways the rules split a dimension of ``size`` named ``logical``."""
    return math.prod(mesh[a] for a in _split_axes(logical, size, rules, tuple(mesh.items())))


@functools.lru_cache(maxsize=65536)
def _split_axes(logical: str, size: int, rules: Rules, mesh_items: tuple) -> tuple[str, ...]:
    """The mesh axes that split a dimension of ``size`` named ``logical``."""
    pspec, _ = logical_to_spec((logical,), rules, (size,), dict(mesh_items))
    entry = pspec[0] if len(pspec) else None
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


@functools.lru_cache(maxsize=4096)
def _model_splits(model: ModelDescription, rules: Rules, mesh_items: tuple) -> dict[str, tuple[str, ...]]:
    """Each of the model's logical axes -> the mesh axes that split it (shared: do not modify)."""
    return {a: _split_axes(a, size, rules, mesh_items) for a, size in model.axis_sizes.items()}


def _axis_split(model: ModelDescription, logical: str | None, rules: Rules, mesh: Mapping[str, int]) -> int:
    """How many ways the rules split the model's logical axis ``logical`` (1 for None)."""
    if logical is None:
        return 1
    return math.prod(mesh[a] for a in _model_splits(model, rules, tuple(mesh.items()))[logical])


def _tensor_split(model: ModelDescription, axes: Sequence[str], rules: Rules, mesh: Mapping[str, int]) -> bool:
    """Whether any of the model's logical ``axes`` is split over ``tensor``."""
    splits = _model_splits(model, rules, tuple(mesh.items()))
    return mesh[ax.TENSOR] > 1 and any(ax.TENSOR in splits[a] for a in axes)


def _per_token(model: ModelDescription, terms: str, rules: Rules, mesh: Mapping[str, int], keys: float,
               act_bytes: int | None = None, kept: tuple[str, ...] | None = None) -> float:
    """The sum of the description's ``terms`` (``layer_elementwise``, ``loss_elementwise`` or
    ``activations``) per token on one device: each divided by its axis's split, score terms times
    ``keys`` (0: the scores are not materialised); with ``act_bytes``, in bytes (the term's own bytes
    per element, else ``act_bytes``); with ``kept``, only terms that carry one of those tags."""
    return _per_token_cached(model, terms, rules, tuple(mesh.items()), keys, act_bytes, kept)


@functools.lru_cache(maxsize=65536)
def _per_token_cached(model: ModelDescription, terms: str, rules: Rules, mesh_items: tuple, keys: float,
                      act_bytes: int | None, kept: tuple[str, ...] | None) -> float:
    mesh = dict(mesh_items)
    total = 0.0
    for t in getattr(model, terms):
        if kept is not None and not set(t.kept) & set(kept):
            continue
        amount = t.amount * (keys if t.per_key else 1.0) / _axis_split(model, t.axis, rules, mesh)
        if act_bytes is not None:
            amount *= t.bytes or act_bytes
        total += amount
    return total


# --- Results ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Flops:
    """FLOPs of one device per step, by part.

    Attributes:
      layers: Matrix products of the transformer blocks' weights (forward and backward).
      attention: Score and value products (forward and backward).
      logits: Output projection (forward and backward).
      recompute: Forward products redone in the backward pass under remat (and always with
        pipeline stages, whose backward pass recomputes each layer).
      elementwise: Norms, activations, softmax, rotary, loss (as XLA counts them).
      optimizer: The update of this device's parameter shard.
    """

    layers: float
    attention: float
    logits: float
    recompute: float
    elementwise: float
    optimizer: float

    @property
    def matmul(self) -> float:
        return self.layers + self.attention + self.logits + self.recompute

    @property
    def total(self) -> float:
        return self.matmul + self.elementwise + self.optimizer


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes on one device.

    Attributes:
      parameters: float32 parameters (with a pipeline, the unpadded storage's rows: `_held_params`).
      gradients: float32 gradients (the accumulator when microbatching).
      optimizer: AdamW's two float32 moments.
      activations: Saved for the backward pass under the remat policy (one microbatch's); with
        pipeline stages, the saved slot inputs (GPipe/circular: every slot of every step; 1F1B: its
        ring of at most about S microbatches' chunk inputs) and one layer's activations (the backward
        pass recomputes each layer).
      logits: float32 logits and their gradient for one microbatch (with pipeline stages: one run of
        the head's rows).
      gathered: FSDP-gathered weights of one layer in flight (two buffers); with pipeline stages,
        the stage's working copy gathered once per step, in the compute dtype, alive through the step.
      batch: The step's input batch on this device.
    """

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    gathered: float
    batch: float

    @property
    def state(self) -> float:
        """Parameters plus optimizer state (the donated train state)."""
        return self.parameters + self.optimizer

    @property
    def total(self) -> float:
        return (self.parameters + self.gradients + self.optimizer + self.activations + self.logits
                + self.gathered + self.batch)


@dataclasses.dataclass(frozen=True)
class Comm:
    """One collective, as the compiled step runs it.

    Attributes:
      kind: ``all-gather``, ``reduce-scatter``, ``all-reduce``, ``all-to-all`` or
        ``collective-permute``.
      axes: Mesh axes of its device groups.
      group: Devices per group.
      result_bytes: Bytes of each device's result (``sharding.hlo.Collective.result_bytes``).
      count: Executions per step.
      what: What it moves (for reports).
      overlappable: Whether it can overlap compute (weight gathers and gradient reductions), or
        sits on the critical path (tensor-parallel activations, pipeline sends).
    """

    kind: str
    axes: tuple[str, ...]
    group: int
    result_bytes: float
    count: float
    what: str
    overlappable: bool = True

    @property
    def total_bytes(self) -> float:
        return self.result_bytes * self.count

    def wire_bytes(self) -> float:
        """Bytes each device sends per execution under ring algorithms (Thakur et al. 2005, section 4)."""
        n = self.group
        if n <= 1:
            return 0.0
        if self.kind == "all-gather":
            return self.result_bytes * (n - 1) / n
        if self.kind == "reduce-scatter":
            return self.result_bytes * (n - 1)
        if self.kind == "all-reduce":
            return 2.0 * self.result_bytes * (n - 1) / n
        if self.kind == "all-to-all":
            return self.result_bytes * (n - 1) / n
        return self.result_bytes  # collective-permute

    def steps(self) -> int:
        """Latency terms (ring steps) per execution."""
        n = self.group
        if n <= 1:
            return 0
        if self.kind == "all-reduce":
            return 2 * (n - 1)
        if self.kind == "collective-permute":
            return 1
        return n - 1


@dataclasses.dataclass(frozen=True)
class Cost:
    """Predicted cost of one device for one step.

    Attributes:
      flops: Per-step FLOPs by part (`Flops`).
      counted_flops: FLOPs as ``compiled.cost_analysis()`` counts them: the body of each ``while``
        loop once (one microbatch through one layer), everything outside the loops once.
      memory: Bytes by part (`Memory`).
      comms: The collectives (`Comm`).
      tokens: Tokens this device computes per step.
      layers: Layers this device computes per microbatch (its stage's share).
      argument_bytes: Bytes of the compiled step's arguments on this device (state, batch, signals).
    """

    flops: Flops
    counted_flops: float
    memory: Memory
    comms: tuple[Comm, ...]
    tokens: float
    layers: int
    argument_bytes: float

    @property
    def matmul_flops(self) -> float:
        return self.flops.matmul


def collective_bytes(comms: Sequence[Comm] | Sequence[Any]) -> dict[str, float]:
    """Kind -> per-device result bytes per step (``sum(result_bytes * count)``).

    Accepts `Comm` objects or `sharding.hlo.Collective` objects (``op``, ``total_bytes``).
    """
    out: dict[str, float] = {}
    for c in comms:
        kind = getattr(c, "kind", None) or c.op
        out[kind] = out.get(kind, 0.0) + float(c.total_bytes)
    return out


# --- The model --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Shape:
    """Per-device sizes of one step."""

    rows: float  # sequences per microbatch on this device
    seq: int  # T, the whole sequence length
    tok: float  # tokens per microbatch on this device (rows * T / sequence)
    micro: int  # microbatches this device runs
    layers: int  # layers computed per microbatch
    slots: int  # layer slots held without a pipeline (with one: `_held_params`)
    act_bytes: int


def device_cost(
    model: ModelDescription | Any,
    layout: Layout,
    *,
    seq_len: int,
    rows: float,
    microbatches: int | None = None,
    layers: int | None = None,
    slots: int | None = None,
    backend: str = "gpu",
    batch_rows: float | None = None,
) -> Cost:
    """The cost of one device that processes ``rows`` sequences per microbatch.

    The general form behind `estimate`, for devices whose work differs: a device of a faster kind
    runs more microbatches (uneven data parallelism, ``microbatches``), a pipeline stage computes its
    own number of layers (``layers``) while every device stores the same unpadded share of the stack.

    Args:
      model: The model's `ModelDescription` (or an object with ``describe()``, `describe_model`).
      layout: The layout.
      seq_len: T, tokens per sequence.
      rows: Sequences per microbatch on this device (after the ``data``/``fsdp`` split).
      microbatches: Microbatches this device runs per step; default ``layout.microbatches``.
      layers: Layers this device computes; default the model's layers over ``stage``.
      slots: Layer slots it holds (for memory) without a pipeline; default ``layers``. With one
        (``stage`` > 1) every device holds ``ceil(L / (S*G))`` unpadded rows instead (`_held_params`) and
        ``slots`` is the largest stage's (`StageLayout.slots`; the default when ``layers`` is not given),
        the size of the working copy each stage gathers per step.
      backend: ``gpu`` or ``cpu`` (how reduce-scatter is lowered; see the module docstring).
      batch_rows: The global batch in sequences, for the uneven step's batch re-layout.

    Returns:
      The `Cost`.

    Raises:
      ValueError: On an unknown backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    model = describe_model(model)
    mesh = layout.mesh
    if layers is None:
        stages = plan_layout(model.num_layers, mesh[ax.STAGE], layout.pipeline_repeats, layout.stage_layers)[0]
        layers = max(stages.stage_layers)
        slots = stages.slots if slots is None else slots
    shape = _Shape(
        rows=rows,
        seq=seq_len,
        tok=rows * seq_len / mesh[ax.SEQUENCE],
        micro=layout.microbatches if microbatches is None else microbatches,
        layers=layers,
        slots=layers if slots is None else slots,
        act_bytes=_DTYPE_BYTES[layout.dtype],
    )
    rules = layout.rules_table()
    placed = _place_cached(model, rules, tuple(mesh.items()))
    if mesh[ax.STAGE] > 1:
        pipe = _pipeline_of(model, layout, rules, shape)
        return _pipeline_cost(model, layout, rules, placed, shape, pipe, backend, batch_rows)
    flops, counted = _flops(model, layout, rules, placed, shape)
    memory = _memory(model, layout, rules, placed, shape)
    comms = tuple(c for c in _comms(model, layout, rules, placed, shape, backend, batch_rows)
                  if c.group > 1 and c.count > 0)
    arguments = memory.state + memory.batch + _INT_BYTES * 4 + _INT_BYTES  # + step, rng, count, signals
    return Cost(flops, counted, memory, comms, shape.tok * shape.micro, shape.layers, arguments)


def estimate(model: ModelDescription | Any, global_batch: int, seq_len: int, layout: Layout, *, backend: str = "gpu") -> Cost:
    """The cost of one device of a uniform layout (every device the same work).

    Args:
      model: The model's `ModelDescription` (or an object with ``describe()``).
      global_batch: B, sequences per step.
      seq_len: T, tokens per sequence.
      layout: The layout.
      backend: ``gpu`` or ``cpu``.

    Returns:
      The `Cost` of the device holding the largest stage.

    Raises:
      ValueError: When ``data x fsdp x microbatches`` does not divide ``global_batch``.
    """
    per = layout.batch_split * layout.microbatches
    if global_batch % per:
        raise ValueError(
            f"--batch-size {global_batch} is not divisible by data x fsdp x microbatches = {per}; "
            f"e.g. --batch-size {per * max(1, global_batch // per)}"
        )
    return device_cost(model, layout, seq_len=seq_len, rows=global_batch / per, backend=backend)


# --- FLOPs ------------------------------------------------------------------------------------


def _per_token_flops(model: ModelDescription, layout: Layout, rules: Rules, placed: dict[str, _Placed], s: _Shape,
                     recomputes: int = 0) -> dict[str, float]:
    """FLOPs per token, forward and backward: of one layer (``layers``: weight products, ``attention``,
    ``recompute``, ``elem_layer``) and of what runs once (``logits``, ``elem_loss``). ``recomputes``:
    extra forward passes of each layer in the backward pass beyond the remat policy's (the
    pipeline's backward pass recomputes every layer: 1)."""
    mesh = layout.mesh
    compute_axes = tuple(a for a in mesh if a not in ax.BATCH_MESH_AXES)  # gathered axes do not split work

    def forward(product: Product) -> float:
        return 2.0 * product.weight.size / placed[product.weight.path].factor(*compute_axes)

    layer_fwd = sum(forward(p) for p in model.products)
    # Full remat recomputes the block's forward except the products whose output no gradient
    # needs (XLA drops them as dead code); "dots" saves the weight products and recomputes the
    # attention products (they have batch dimensions).
    kept_fwd = layer_fwd - sum(forward(p) for p in model.products if not p.recomputed)
    geometry = model.attention
    heads = _axis_split(model, geometry.heads_axis, rules, mesh)
    whole = layout.attention in _WHOLE_SCORES
    attn_fwd = geometry.forward_flops(s.seq if whole else s.seq / 2) / heads
    attn_total = attn_fwd * (3.0 if whole else 3.5)  # flash bwd: 5 products
    logits = model.logits
    logits_fwd = 2.0 * logits.in_size * logits.out_size / math.prod(
        _axis_split(model, a, rules, mesh) for a in logits.out_axes)
    recompute = {"none": 0.0, "full": kept_fwd + attn_fwd, "dots": attn_fwd}[layout.remat]
    recompute += recomputes * (kept_fwd + attn_fwd)
    passes = 1.0 + ELEMENTWISE_BACKWARD_FACTOR + (1.0 if layout.remat != "none" else 0.0)
    return {
        "layers": 3.0 * layer_fwd,
        "attention": attn_total,
        "recompute": recompute,
        "elem_layer": passes * _per_token(model, "layer_elementwise", rules, mesh, s.seq if whole else 0.0),
        "logits": 3.0 * logits_fwd,
        "elem_loss": (1.0 + ELEMENTWISE_BACKWARD_FACTOR) * _per_token(model, "loss_elementwise", rules, mesh, 0.0),
    }


def _flops(model: ModelDescription, layout: Layout, rules: Rules, placed: dict[str, _Placed],
           s: _Shape) -> tuple[Flops, float]:
    """Per-step FLOPs and the loop-bodies-once count of ``cost_analysis`` (no pipeline)."""
    unit = _per_token_flops(model, layout, rules, placed, s)
    per_token_layer = unit["layers"] + unit["attention"] + unit["recompute"] + unit["elem_layer"]
    per_token_outside = unit["logits"] + unit["elem_loss"]
    optimizer = OPTIMIZER_FLOPS_PER_PARAM * _held_params(model, layout, rules, placed, s)
    tokens = s.tok * s.micro
    flops = Flops(
        layers=tokens * s.layers * unit["layers"],
        attention=tokens * s.layers * unit["attention"],
        logits=tokens * unit["logits"],
        recompute=tokens * s.layers * unit["recompute"],
        elementwise=tokens * (s.layers * unit["elem_layer"] + unit["elem_loss"]),
        optimizer=optimizer,
    )
    counted = s.tok * (per_token_layer + per_token_outside) + optimizer
    return flops, counted


# --- Memory -----------------------------------------------------------------------------------


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
        return sum(p.local * (s.slots if p.param.per_layer else 1) for p in placed.values())
    return _held_pipeline_params(model, rules, tuple(mesh.items()))


@functools.lru_cache(maxsize=4096)
def _held_pipeline_params(model: ModelDescription, rules: Rules, mesh_items: tuple) -> float:
    """`_held_params` with a pipeline (cached: the same for every stage device of a mesh)."""
    mesh = dict(mesh_items)
    placed = _place_cached(model, rules, mesh_items)
    layer = [p for p in placed.values() if p.param.per_layer]
    axes = storage_axes([(None, *p.param.axes) for p in layer], rules, mesh)
    rows = -(-model.num_layers // (mesh[ax.STAGE] * math.prod(mesh[a] for a in axes)))
    held = rows * sum(p.local * p.factor(*axes) for p in layer)
    for p in placed.values():
        if not p.param.per_layer:
            spec = spread_over_stage(logical_to_spec(p.param.axes, rules, p.param.shape, mesh)[0], p.param.shape, mesh)
            held += p.param.size / math.prod(mesh[a] for e in spec for a in ((e,) if isinstance(e, str) else e or ()))
    return held


def _memory(model: ModelDescription, layout: Layout, rules: Rules, placed: dict[str, _Placed], s: _Shape) -> Memory:
    params = _held_params(model, layout, rules, placed, s) * _PARAM_BYTES
    mesh = layout.mesh
    keys = s.seq if layout.attention in _WHOLE_SCORES else 0.0

    def saved_bytes(kept=None) -> float:  # per token of one layer
        return _per_token(model, "activations", rules, mesh, keys, s.act_bytes, kept)

    per_layer = saved_bytes()
    if layout.remat == "full":
        saved = s.tok * (s.layers * saved_bytes(("input",)) + per_layer)
    elif layout.remat == "dots":
        saved = s.tok * s.layers * saved_bytes(("input", "dot")) + s.tok * per_layer
    else:
        saved = s.tok * s.layers * per_layer
    out = model.logits
    logits = 2 * s.tok * out.out_size / math.prod(_axis_split(model, a, rules, mesh) for a in out.out_axes) * 4
    gathered = 0.0
    if mesh[ax.FSDP] > 1:
        gathered = 2 * sum(p.local * p.factor(ax.FSDP) for p in placed.values() if p.param.per_layer) * _PARAM_BYTES
    batch = _BATCH_FIELDS * s.rows * s.micro * s.seq / mesh[ax.SEQUENCE] * _INT_BYTES
    grads = params
    if layout.uneven_batch:  # whole parameters and a whole gradient accumulator during the loop
        whole = sum(p.param.size / p.factor(ax.TENSOR) * (s.slots if p.param.per_layer else 1)
                    for p in placed.values()) * _PARAM_BYTES  # whole over the batch axes, still split over tensor
        gathered = whole if mesh[ax.FSDP] > 1 else 0.0
        grads = whole
    return Memory(
        parameters=params,
        gradients=grads,
        optimizer=2 * params,
        activations=saved,
        logits=logits,
        gathered=gathered,
        batch=batch,
    )

# --- Collectives ------------------------------------------------------------------------------


def _axes(mesh: Mapping[str, int], *names: str) -> tuple[tuple[str, ...], int]:
    """The axes of ``names`` with size > 1, and their product."""
    kept = tuple(a for a in names if mesh[a] > 1)
    return kept, math.prod(mesh[a] for a in kept)


def _comms(model: ModelDescription, layout: Layout, rules: Rules, placed: dict[str, _Placed], s: _Shape, backend: str,
           batch_rows: float | None = None, embedding: bool = True) -> list[Comm]:
    if layout.uneven_batch:
        return _uneven_comms(model, layout, rules, placed, s, batch_rows)
    comms: list[Comm] = []
    split = _output_split(model, layout, rules, s)
    comms += _weight_gathers(layout, placed, s, split)
    comms += _gradient_reductions(layout, placed, s, backend, split)
    comms += _tensor_comms(model, layout, rules, s, split)
    comms += _vocab_parallel_comms(model, layout, placed, s, split)
    if embedding:
        comms += _embedding_comms(model, layout, placed, s)
    comms += _sequence_comms(model, layout, rules, s, backend)
    return comms


def _uneven_comms(model: ModelDescription, layout: Layout, rules: Rules, placed: dict[str, _Placed], s: _Shape,
                  batch_rows: float | None) -> list[Comm]:
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
        in_loop = (_tensor_comms(model, inner, rules, s, split)
                   + _vocab_parallel_comms(model, inner, inner_placed, s, split)
                   + _embedding_comms(model, inner, inner_placed, s))
    else:
        in_loop = []
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
            comms.append(Comm("all-reduce", rest, math.prod(mesh[a] for a in rest), local, layers, f"gradient of {what}"))
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


def _vocab_parallel_comms(model: ModelDescription, layout: Layout, placed: dict[str, _Placed], s: _Shape,
                          split: VocabSplit | None) -> list[Comm]:
    """The vocabulary-parallel loss (`models.output`), per microbatch, its collectives explicit.

    Over the group (f, the axes splitting the output weight's ``embed``): the weight shard traded
    for a vocabulary slice and its gradient traded back (two all-to-alls of the local shard
    ``[D/f, V/t]``), the group's activations gathered in float32 (``[f x tokens, D]``) with their
    targets, the activations' gradient reduce-scattered back (a reduce-scatter on both backends: it
    is written as one). Over the slices (group and ``tensor``): the softmax max, sum, target logit
    and the loss gradient of each group token (``[f x tokens]`` float32 each). Over ``tensor``: the
    local rows' input gradient. Over the token axes the weight is whole along (``data``): its
    gradient, the local shard.
    """
    if split is None:
        return []
    mesh, m, d = layout.mesh, s.micro, model.logits.in_size
    weight = placed[model.logits.weight.path]
    f, group = split.group, split.group_axes
    slices = split.vocab_axes + group
    shard = weight.local * _PARAM_BYTES
    comms = [
        Comm("all-to-all", group, f, shard, 1 + m, "output weight: shard to vocabulary slice (once: the "
             "partitioner hoists it out of the microbatch loop) and its gradient back"),
        Comm("all-gather", group, f, s.tok * f * d * 4, m, "loss: the group's activations", False),
        Comm("all-gather", group, f, s.tok * f * _INT_BYTES, m, "loss: the group's targets", False),
        Comm("reduce-scatter", group, f, s.tok * d * 4, m, "loss: activations' gradient", False),
        Comm("all-reduce", slices, split.shards, s.tok * f * 4, 4 * m, "loss: softmax max, sum, target, gradient",
             False),
    ]
    t = split.shards // f
    if t > 1:
        comms.append(Comm("all-reduce", split.vocab_axes, t, s.tok * d * 4, m, "loss: input gradient over tensor",
                          False))
    rest, n = _axes(mesh, *(a for a in (ax.DATA, ax.SEQUENCE) if a not in slices))
    if n > 1:
        comms.append(Comm("all-reduce", rest, n, shard, m, f"gradient of {weight.param.path}"))
    return comms


def _weight_gathers(layout: Layout, placed: dict[str, _Placed], s: _Shape, split: VocabSplit | None = None) -> list[Comm]:
    """FSDP: each weight split over ``fsdp`` is gathered before use, again in the backward pass.

    Per-layer weights are gathered inside the layer loop (forward and backward, recompute sharing
    the backward's gather) for every microbatch; the final norm and output projection outside it,
    once per step (the partitioner hoists them out of the microbatch loop), the output projection
    a second time in the backward pass when ``tensor`` is split and so is ``data`` or the batch
    (microbatches). The
    embedding table is handled in `_embedding_comms`.
    """
    mesh = layout.mesh
    comms = []
    for p in placed.values():
        n = p.factor(ax.FSDP)
        if n <= 1 or p.param.role == "embedding" or (split is not None and p.param.role == "output"):
            continue
        result = p.local * n * _PARAM_BYTES
        if p.param.per_layer:
            count = 2 * s.layers * s.micro
        elif p.param.role == "output":
            regather = mesh[ax.TENSOR] > 1 and (mesh[ax.DATA] > 1 or s.micro > 1)
            count = 2 if regather else 1
        else:
            count = 2
        comms.append(Comm("all-gather", (ax.FSDP,), n, result, count, f"gather {p.param.path}"))
    return comms


def _gradient_reductions(layout: Layout, placed: dict[str, _Placed], s: _Shape, backend: str,
                         split: VocabSplit | None = None) -> list[Comm]:
    """Gradients summed over the batch axes, per layer and per microbatch.

    GPU: a reduce-scatter over ``fsdp`` for weights split over it (result: the local shard), then
    an all-reduce of the shard over ``data``. CPU: the reduce-scatter is lowered to an all-reduce
    of the whole gradient over ``data`` x ``fsdp``, followed, when both are split, by an all-reduce
    of the shard over ``data`` (what XLA CPU emits). Weights not split over ``fsdp``: one all-reduce
    over the batch axes.
    """
    mesh = layout.mesh
    batch_axes, batch_n = _axes(mesh, ax.DATA, ax.FSDP, ax.SEQUENCE)  # tokens split over all three
    if batch_n <= 1:
        return []
    comms = []
    for p in placed.values():
        if p.param.role == "embedding" and _table_split(p) != (1, 1):
            continue  # see _embedding_comms
        if p.param.role == "output" and split is not None:
            continue  # see _vocab_parallel_comms
        count = s.micro * (s.layers if p.param.per_layer else 1)
        local = p.local * _PARAM_BYTES
        n_f = p.factor(ax.FSDP)
        what = f"gradient of {p.param.path}"
        if n_f <= 1:
            comms.append(Comm("all-reduce", batch_axes, batch_n, local, count, what))
            continue
        if backend == "gpu":
            comms.append(Comm("reduce-scatter", (ax.FSDP,), n_f, local, count, what))
        else:
            comms.append(Comm("all-reduce", batch_axes, batch_n, local * n_f, count, what))
        if mesh[ax.DATA] > 1 and (backend == "gpu" or not p.param.per_layer or p.param.matmul):
            comms.append(Comm("all-reduce", (ax.DATA,), mesh[ax.DATA], local, count, what + " (over data)"))
    return comms


def _tensor_comms(model: ModelDescription, layout: Layout, rules: Rules, s: _Shape,
                  output_split: VocabSplit | None = None, recomputes: int = 0,
                  with_logits: bool = True) -> list[Comm]:
    """Megatron-style tensor parallelism (Shoeybi et al., 2019, section 3).

    Forward: the row-parallel products (an input axis split over ``tensor``, e.g. the attention
    output and the MLP's down projection) end in partial sums, all-reduced over ``tensor`` ([tokens,
    out] each), again where full remat (or ``recomputes`` more times, the pipeline's backward pass)
    recomputes the product. Backward: the input gradients of the
    column-parallel products (an output axis split) are partial sums; the partitioner reduces each
    separately ([tokens, in]). The logits: the cross-entropy's max and sum over the split vocabulary
    ([tokens] float32 each) and the input gradient of the output projection (with the
    vocabulary-parallel loss, `_vocab_parallel_comms` instead), unless ``with_logits`` is False.
    """
    mesh = layout.mesh
    if mesh[ax.TENSOR] <= 1:
        return []
    t, n = mesh[ax.TENSOR], s.layers * s.micro
    forward: dict[float, int] = {}  # bytes of one all-reduce -> executions per layer and microbatch
    backward: dict[float, int] = {}
    for product in model.products:
        if _tensor_split(model, product.in_axes, rules, mesh):
            out = s.tok * product.out_size * s.act_bytes
            recomputed = ((layout.remat == "full") + recomputes) * product.recomputed
            forward[out] = forward.get(out, 0) + 1 + recomputed
        if _tensor_split(model, product.out_axes, rules, mesh):
            grad = s.tok * product.in_size * s.act_bytes
            backward[grad] = backward.get(grad, 0) + 1
    comms = [Comm("all-reduce", (ax.TENSOR,), t, b, c * n, "row-parallel outputs (forward)", False)
             for b, c in forward.items()]
    comms += [Comm("all-reduce", (ax.TENSOR,), t, b, c * n, "column-parallel input gradients", False)
              for b, c in backward.items()]
    logits = model.logits
    if not with_logits or output_split is not None or not _tensor_split(model, logits.out_axes, rules, mesh):
        return comms
    if s.micro > 1 and _partitioner() == "0.12":
        # jax 0.12 re-gathers the float32 logits' gradient [tokens, V] over tensor at the logits'
        # sharding constraint inside the microbatch loop.
        comms.append(Comm("all-gather", (ax.TENSOR,), t, s.tok * logits.out_size * 4, s.micro,
                          "logits gradient (jax 0.12, microbatches)", False))
    comms.append(Comm("all-reduce", (ax.TENSOR,), t, s.tok * 4, 2 * s.micro, "softmax max and sum", False))
    comms.append(Comm("all-reduce", (ax.TENSOR,), t, s.tok * logits.in_size * 4, s.micro,
                      "output projection input gradient", False))
    return comms


def _table_split(p: _Placed) -> tuple[int, int]:
    return p.factor(ax.TENSOR), p.factor(ax.FSDP)


def _embedding_comms(model: ModelDescription, layout: Layout, placed: dict[str, _Placed], s: _Shape) -> list[Comm]:
    """The token embedding lookup (a gather from the [V, D] table, the ``embedding`` parameter), as the
    partitioner lowers it.

    By how the rules split the table (``vocab`` over ``tensor``: t, ``embed`` over ``fsdp``: f):

    * not split: a local lookup; the gradient is all-reduced with the others (`_gradient_reductions`).
    * f only: whichever moves fewer bytes of (a) the rows: tokens gathered over ``fsdp``, rows
      gathered over ``data``, looked up locally and sent to the batch layout by an all-to-all (back
      again in the backward pass when ``data`` = 1, where the gradient lands in the local shard;
      with ``data`` > 1 the whole table's gradient is all-reduced), or (b) the table: gathered over
      ``fsdp``, its whole gradient all-reduced over ``data`` x ``fsdp``.
    * t only: vocabulary-parallel rows all-reduced over ``tensor``; the [V/t, D] gradient reduced
      over the batch axes.
    * t and f: the partitioner warns of "involuntary full rematerialization" and replicates pieces;
      the collectives below are those jax 0.10-0.12 emit, with and without ``data`` and
      microbatches.

    jax 0.12's partitioner (`_partitioner`) always takes (a) for f only, reducing the [V, D/f]
    gradient shard over ``data``, and in the t-and-f cases without ``data`` sends row gradients
    back with a collective-permute instead of a second all-to-all.
    """
    mesh = layout.mesh
    embedding = model.with_role("embedding")
    if embedding is None:
        return []
    table = placed[embedding.path]
    t, f = _table_split(table)
    if f <= 1 and t <= 1:
        return []
    if t <= 1:
        return _embedding_fsdp(table, mesh, s, f)
    if f <= 1:
        batch_axes, batch_n = _axes(mesh, ax.DATA, ax.FSDP)
        v, d = table.param.shape
        rows = s.tok * d * 4
        return [
            Comm("all-reduce", (ax.TENSOR,), t, rows, s.micro, "embedding: vocabulary-parallel rows", False),
            Comm("all-reduce", batch_axes, batch_n, v / t * d * 4, s.micro, f"gradient of {embedding.path}"),
        ]
    return _embedding_2d(table, mesh, s, t, f)


def _partitioner() -> str:
    """``"0.10"`` or ``"0.12"``: which jax's partitioner lowers the embedding lookup (they differ in
    its backward pass). jax 0.11 is assumed to behave as 0.12: not checked yet (it is installed only on
    the GPU machine)."""
    import jax

    return "0.10" if tuple(jax.__version_info__[:2]) < (0, 11) else "0.12"


def _embedding_fsdp(table: _Placed, mesh: Mapping[str, int], s: _Shape, f: int) -> list[Comm]:
    """Embedding table split over ``fsdp`` only (see `_embedding_comms`)."""
    (v, d), m, n_d = table.param.shape, s.micro, mesh[ax.DATA]
    grad = f"gradient of {table.param.path}"
    rows = s.tok * d * 4  # float32: the lookup reads the float32 table
    batch_axes, batch_n = _axes(mesh, ax.DATA, ax.FSDP)
    whole = v * d * 4
    if _partitioner() == "0.12":
        comms = [
            Comm("all-gather", (ax.FSDP,), f, s.tok * f * _INT_BYTES, m, "embedding: tokens"),
            Comm("all-to-all", (ax.FSDP,), f, rows, 2 * m, "embedding: rows to batch layout and back"),
        ]
        if n_d > 1:
            comms.append(Comm("all-reduce", (ax.DATA,), n_d, whole / f, m, grad))
        return comms
    if rows * (n_d + 1) >= whole and n_d > 1:
        return [
            Comm("all-gather", (ax.FSDP,), f, whole, 1, "embedding: table"),
            Comm("all-reduce", batch_axes, batch_n, whole, m, grad),
        ]
    comms = [
        Comm("all-gather", (ax.FSDP,), f, s.tok * f * _INT_BYTES, m, "embedding: tokens"),
        Comm("all-to-all", (ax.FSDP,), f, rows, m if n_d > 1 else 2 * m, "embedding: rows to batch layout"),
    ]
    if n_d > 1:
        comms.append(Comm("all-gather", (ax.DATA,), n_d, rows * n_d, m, "embedding: rows"))
        comms.append(Comm("all-reduce", batch_axes, batch_n, whole, m, grad))
    return comms


def _embedding_2d(table: _Placed, mesh: Mapping[str, int], s: _Shape, t: int, f: int) -> list[Comm]:
    """Embedding table split over ``tensor`` (vocab) and ``fsdp`` (embed); see `_embedding_comms`."""
    (v, d), m = table.param.shape, s.micro
    rows, tokens, shard = s.tok * d * 4, s.tok * _INT_BYTES, v * d / f * 4
    batch_axes, batch_n = _axes(mesh, ax.DATA, ax.FSDP)
    grad = f"gradient of {table.param.path}"
    if mesh[ax.DATA] <= 1 and _partitioner() == "0.12":
        comms = [
            Comm("all-gather", (ax.TENSOR,), t, tokens * t, m, "embedding: tokens"),
            Comm("collective-permute", (ax.TENSOR,), 2, tokens, m, "embedding: tokens"),
            Comm("all-reduce", (ax.TENSOR,), t, rows, m, "embedding: vocabulary-parallel rows", False),
            Comm("all-to-all", (ax.FSDP,), f, rows, m, "embedding: rows to batch layout"),
        ]
        if m == 1:
            return comms + [
                Comm("all-gather", (ax.FSDP,), f, tokens * f, m, "embedding: tokens"),
                Comm("collective-permute", (ax.FSDP,), 2, rows / f, m, "embedding: row gradients"),
                Comm("all-reduce", (ax.TENSOR,), t, rows, m, grad),
            ]
        return comms + [
            Comm("all-gather", (ax.TENSOR,), t, shard, 1, "embedding: table shard"),
            Comm("all-gather", (ax.TENSOR,), t, rows, m, "embedding: rows"),
            Comm("all-reduce", (ax.TENSOR,), t, 2 * tokens, m, "embedding: token masks", False),
        ]
    if mesh[ax.DATA] <= 1 and m == 1:
        return [
            Comm("all-gather", (ax.TENSOR,), t, tokens * t, m, "embedding: tokens"),
            Comm("all-gather", (ax.FSDP,), f, tokens * f, m, "embedding: tokens"),
            Comm("collective-permute", (ax.TENSOR,), 2, tokens, m, "embedding: tokens"),
            Comm("all-reduce", (ax.TENSOR,), t, rows, m, "embedding: vocabulary-parallel rows", False),
            Comm("all-to-all", (ax.FSDP,), f, rows, 2 * m, "embedding: rows to batch layout"),
            Comm("all-reduce", (ax.TENSOR,), t, shard, m, grad),
        ]
    if mesh[ax.DATA] <= 1:
        return [
            Comm("all-gather", (ax.TENSOR,), t, shard, 1, "embedding: table shard"),
            Comm("all-gather", (ax.TENSOR,), t, rows, m, "embedding: rows"),
            Comm("all-gather", (ax.TENSOR,), t, tokens * t, m, "embedding: tokens"),
            Comm("collective-permute", (ax.TENSOR,), 2, tokens, m, "embedding: tokens"),
            Comm("all-reduce", (ax.TENSOR,), t, 2 * tokens, m, "embedding: token masks", False),
            Comm("all-reduce", (ax.TENSOR,), t, rows, m, "embedding: vocabulary-parallel rows", False),
            Comm("all-to-all", (ax.FSDP,), f, rows, 2 * m, "embedding: rows to batch layout"),
        ]
    if m == 1:
        return [
            Comm("all-gather", batch_axes, batch_n, rows, 2, "embedding: rows"),
            Comm("collective-permute", (ax.FSDP,), 2, rows / f, 2, "embedding: rows"),
            Comm("all-reduce", (ax.TENSOR,), t, tokens, 1, "cross-entropy: target logits", False),
            Comm("all-reduce", batch_axes, batch_n, shard, 1, grad),
        ]
    return [
        Comm("all-gather", (ax.TENSOR,), t, shard, 1, "embedding: table shard"),
        Comm("all-gather", batch_axes, batch_n, s.tok * batch_n * d / f * 4, m, "embedding: rows"),
        Comm("all-gather", batch_axes, batch_n, rows * batch_n, 2 * m, "embedding: rows"),
        Comm("collective-permute", (ax.TENSOR,), 2, tokens, m, "embedding: tokens"),
        Comm("all-reduce", (ax.TENSOR,), t, 2 * tokens, m, "embedding: token masks", False),
        Comm("all-reduce", batch_axes, batch_n, shard, m, grad),
    ]


def _sequence_comms(model: ModelDescription, layout: Layout, rules: Rules, s: _Shape, backend: str) -> list[Comm]:
    """Context parallelism over ``sequence`` as the partitioner does it for reference attention:
    keys and values gathered over ``sequence`` before the score product (forward, and again in the
    backward pass), their gradients reduce-scattered back (CPU: all-reduced whole)."""
    mesh = layout.mesh
    n = mesh[ax.SEQUENCE]
    if n <= 1:
        return []
    geometry = model.attention
    kv = _axis_split(model, geometry.kv_axis, rules, mesh)
    one = s.tok * n * geometry.num_kv_heads / kv * geometry.head_dim * s.act_bytes  # k or v, gathered
    count = s.layers * s.micro
    comms = [Comm("all-gather", (ax.SEQUENCE,), n, one, 4 * count, "keys and values", False)]
    if backend == "gpu":
        comms.append(Comm("reduce-scatter", (ax.SEQUENCE,), n, 2 * one / n, count, "key and value gradients", False))
    else:
        comms.append(Comm("all-reduce", (ax.SEQUENCE,), n, 2 * one, count, "key and value gradients", False))
    return comms


# --- Pipeline ---------------------------------------------------------------------------------
#
# Prices the compiled pipeline of `sharding.pipeline` (GPipe, circular and 1F1B) as main builds it:
#
# * the layer stack stored unpadded (`sharding.pipeline.storage`): every device holds ``q`` whole-layer rows
#   (`_held_params`); per step each stage's working copy of ``R*K'`` slots is assembled in the compute dtype
#   (`_gather_bytes`) from the rows other devices store for it (one ppermute per distance that moves any), a
#   pick of this device's ``R*K'/G`` slots and one all-gather over the storage's group axes; the gradients go
#   back the same way (`_pipeline_weight_comms`);
# * the layers applied `_Pipe.applications` times per step to one microbatch's rows; activations moved by two
#   ppermutes per pipeline step (GPipe/circular: ``R*M + S - 1`` steps, one each way; 1F1B: `_Pipe.steps`
#   ticks, two per tick) and, for GPipe/circular, one psum over ``stage`` of the outputs (`_stage_comms`);
# * the embedding on the device's whole batch, replicated over ``stage``; the final norm, output projection
#   and loss (the head) on 1/S of those rows per stage (`sharding.pipeline.head_parallelism`) after
#   GPipe/circular, on one microbatch per tick inside the loop for 1F1B (`_pipeline_outside`); the
#   non-layer parameters stored split over ``stage`` too (`spread_over_stage`).
#
# Where a schedule keeps its saved inputs: `_Pipe.saved_inputs` (GPipe: every slot of every step; 1F1B: the
# ring of `one_f_one_b_ticks(...).slots` chunk inputs).


def _gather_bytes(layout: Layout) -> int:
    """Bytes per element of the pipeline's gathered working copy of the stage's layers: the compute dtype
    (`sharding.pipeline.schedule._Weights.dtype`, the activations' dtype). The one place to change when
    the gather's dtype changes."""
    return _DTYPE_BYTES[layout.dtype]


@dataclasses.dataclass(frozen=True)
class _Pipe:
    """One stage device's pipeline (`sharding.pipeline.PipelinePlan` with its `StageStorage`).

    Attributes:
      stages: S.
      repeats: R (1: GPipe or 1F1B; more: circular or interleaved 1F1B).
      micro: M, microbatches per step.
      layers: Layers this stage runs per microbatch (over its repeats).
      working: Slots of the stage's gathered working copy, ``R * K'`` (`Placement.chunk_slots`: the
        layout's K rounded up so that the storage's G devices divide ``R * K'``).
      groups: G, the devices of a stage the stored rows are spread over (`storage_axes`).
      moved: Rows each device sends per ppermute of the storage, one entry per distance that moves any.
      skip_empty: Empty slots and bubble steps are skipped (`PipelinePlan.skip_empty`).
      ticks: 1F1B: the loop's ticks (`one_f_one_b_ticks`); 0 for GPipe/circular.
      ring: 1F1B: the chunk inputs a stage keeps at once (`Ticks.slots`); 0 for GPipe/circular.
    """

    stages: int
    repeats: int
    micro: int
    layers: int
    working: int
    groups: int
    moved: tuple[int, ...]
    skip_empty: bool
    ticks: int = 0
    ring: int = 0

    @property
    def one_f_one_b(self) -> bool:
        return self.ticks > 0

    @property
    def steps(self) -> int:
        """Loop trips per step: GPipe/circular ``R*M + S - 1`` per pass (`PipelinePlan.steps`), 1F1B its ticks."""
        return self.ticks or self.repeats * self.micro + self.stages - 1

    @property
    def chunk_slots(self) -> int:
        """K', slots run per step."""
        return self.working // self.repeats

    @property
    def applications(self) -> int:
        """Forward layer applications of this device per step (`PipelinePlan.layer_applications`):
        ``M * layers`` when empty slots and bubbles are skipped, else every slot of every step (1F1B:
        every tick, as the compiled program's trip counts say: its forward and backward branches are
        each counted on every tick)."""
        return self.micro * self.layers if self.skip_empty else self.steps * self.chunk_slots

    @property
    def saved_inputs(self) -> int:
        """Slot inputs kept for the backward pass: GPipe/circular every slot of every step, 1F1B the ring's."""
        return (self.ring or self.steps) * self.chunk_slots


def _pipeline_of(model: ModelDescription, layout: Layout, rules: Rules, s: _Shape) -> _Pipe:
    """The `_Pipe` of a device computing ``s.layers`` layers with a working copy of ``s.slots`` slots (the
    layout's largest stage, `StageLayout.slots`), the stored rows it receives from the layout's split."""
    mesh = layout.mesh
    stages, repeats = mesh[ax.STAGE], layout.pipeline_repeats
    groups = math.prod(mesh[a] for a in _storage_axes(model, rules, mesh))
    chunk = -(-s.slots // repeats)  # K' (`Placement.chunk_slots`): K rounded up so that G divides R*K'
    while (repeats * chunk) % groups:
        chunk += 1
    moved, ticks, ring = _pipeline_tables(model.num_layers, stages, repeats, layout.stage_layers, groups, s.micro,
                                          layout.one_f_one_b)
    return _Pipe(stages, repeats, s.micro, s.layers, repeats * chunk, groups, moved, layout.skip_empty, ticks, ring)


@functools.lru_cache(maxsize=4096)
def _pipeline_tables(num_layers: int, stages: int, repeats: int, stage_layers: tuple[int, ...] | None, groups: int,
                     micro: int, one_f_one_b: bool) -> tuple[tuple[int, ...], int, int]:
    """``(moved, ticks, ring)`` of `_Pipe` from the static tables (`Placement.sends`, `one_f_one_b_ticks`);
    cached: the planner prices many devices of one split. A split the run refuses (a planner's trial)
    moves no stored rows."""
    from sharding.pipeline.storage import StageStorage

    try:
        placement = StageStorage(plan_layout(num_layers, stages, repeats, stage_layers)[0], groups).placement
        moved = tuple(int(send.shape[-1]) for send in placement.sends if send is not None)
    except ValueError:
        moved = ()
    return (moved, *(_ticks_and_ring(stages, micro, repeats) if one_f_one_b else (0, 0)))


@functools.lru_cache(maxsize=1024)
def _ticks_and_ring(stages: int, micro: int, repeats: int) -> tuple[int, int]:
    """1F1B's ticks and ring slots (`one_f_one_b_ticks`; raises the run's ValueError for an interleaved
    1F1B it refuses)."""
    from sharding.pipeline.layout import one_f_one_b_ticks

    table = one_f_one_b_ticks(stages, micro, repeats)
    return table.ticks, table.slots


def _storage_axes(model: ModelDescription, rules: Rules, mesh: Mapping[str, int]) -> tuple[str, ...]:
    """The batch axes the stored layer rows are spread over besides ``stage`` (`storage_axes`)."""
    return _storage_axes_cached(model, rules, tuple(mesh.items()))


@functools.lru_cache(maxsize=4096)
def _storage_axes_cached(model: ModelDescription, rules: Rules, mesh_items: tuple) -> tuple[str, ...]:
    return storage_axes([(None, *p.axes) for p in model.params if p.per_layer], rules, dict(mesh_items))


def _pipeline_cost(model: ModelDescription, layout: Layout, rules: Rules, placed: dict[str, _Placed], s: _Shape,
                   pipe: _Pipe, backend: str, batch_rows: float | None) -> Cost:
    """The `Cost` of one stage device (see the section comment above)."""
    layer = dataclasses.replace(s, micro=1, layers=pipe.applications)  # one microbatch's rows per application
    embed, head, head_runs = _pipeline_outside(s, pipe)
    unit = _per_token_flops(model, layout, rules, placed, s, recomputes=1)
    optimizer = OPTIMIZER_FLOPS_PER_PARAM * _held_params(model, layout, rules, placed, s)
    inside = layer.tok * pipe.applications
    flops = Flops(
        layers=inside * unit["layers"],
        attention=inside * unit["attention"],
        logits=head.tok * head_runs * unit["logits"],
        recompute=inside * unit["recompute"],
        elementwise=inside * unit["elem_layer"] + head.tok * head_runs * unit["elem_loss"],
        optimizer=optimizer,
    )
    # cost_analysis: the loops' bodies once (one application forward, one backward; 1F1B: the head once).
    counted = (s.tok * (unit["layers"] + unit["attention"] + unit["recompute"] + unit["elem_layer"])
               + head.tok * (unit["logits"] + unit["elem_loss"]) + optimizer)
    memory = _pipeline_memory(model, layout, rules, placed, s, pipe, head)
    comms = _pipeline_head_comms(model, layout, rules, head, pipe, backend, batch_rows)
    comms += _pipeline_embedding_comms(model, layout, placed, embed)
    comms += _pipeline_weight_comms(layout, rules, placed, pipe, model)
    comms += _stage_comms(model, layout, s, pipe, head)
    comms += _tensor_comms(model, layout, rules, layer, recomputes=1, with_logits=False)
    comms += _sequence_comms(model, layout, rules, layer, backend)
    comms = tuple(c for c in comms if c.group > 1 and c.count > 0)
    arguments = memory.state + memory.batch + _INT_BYTES * 4 + _INT_BYTES
    return Cost(flops, counted, memory, comms, s.tok * s.micro, s.layers, arguments)


def _stage_folded(model: ModelDescription, layout: Layout, rules: Rules) -> tuple[Layout, dict[str, _Placed]]:
    """The head's layout: the mesh with ``stage`` folded into ``fsdp`` (the head's rows are split over both,
    `head_parallelism`, and the non-layer parameters stored over both, `spread_over_stage`), one microbatch."""
    mesh = layout.mesh
    flat = dataclasses.replace(layout, mesh={**mesh, ax.STAGE: 1, ax.FSDP: mesh[ax.FSDP] * mesh[ax.STAGE]},
                               microbatches=1, stage_layers=None, pipeline_repeats=1, one_f_one_b=False)
    return flat, _place_cached(model, rules, tuple(flat.mesh.items()))


def _pipeline_outside(s: _Shape, pipe: _Pipe) -> tuple[_Shape, _Shape, int]:
    """``(embedding, head, runs)``: the embedding's shape (the device's whole batch, replicated over
    ``stage``), the head's per run and how many runs: after GPipe/circular once on 1/S of the whole
    batch's rows (`head_parallelism`; all of them when S does not divide them), in 1F1B once per tick on
    one microbatch's rows (under a conditional counted on every tick; with ``skip_empty`` M times)."""
    whole = dataclasses.replace(s, rows=s.rows * s.micro, tok=s.tok * s.micro, micro=1, layers=0)
    if pipe.one_f_one_b:
        one = dataclasses.replace(s, micro=1, layers=0)
        return whole, one, (pipe.micro if pipe.skip_empty else pipe.ticks)
    split = pipe.stages if whole.rows % pipe.stages == 0 else 1
    return whole, dataclasses.replace(whole, rows=whole.rows / split, tok=whole.tok / split), 1


def _pipeline_memory(model: ModelDescription, layout: Layout, rules: Rules, placed: dict[str, _Placed],
                     s: _Shape, pipe: _Pipe, head: _Shape) -> Memory:
    """Bytes of a stage device: the stored rows' state; in flight, the gathered working copy of the stage's
    slots (`_gather_bytes`) and their float32 gradient sums, the saved slot inputs (`_Pipe.saved_inputs`),
    one layer's activations, and the head's logits (one run's rows)."""
    base = _memory(model, layout, rules, placed, s)
    keys = s.seq if layout.attention in _WHOLE_SCORES else 0.0
    saved_input = _per_token(model, "activations", rules, layout.mesh, keys, s.act_bytes, ("input",))
    per_layer = _per_token(model, "activations", rules, layout.mesh, keys, s.act_bytes)
    whole_layer = sum(p.local * _batch_factor(p, layout.mesh) for p in placed.values() if p.param.per_layer)
    return dataclasses.replace(
        base,
        gradients=base.gradients + pipe.working * whole_layer * _PARAM_BYTES,
        activations=s.tok * (pipe.saved_inputs * saved_input + per_layer),
        logits=base.logits * head.tok / s.tok,
        gathered=pipe.working * whole_layer * _gather_bytes(layout),
    )


def _pipeline_embedding_comms(model: ModelDescription, layout: Layout, placed: dict[str, _Placed],
                              embed: _Shape) -> list[Comm]:
    """The embedding lookup on the device's whole batch (replicated over ``stage``) from a table stored
    split over ``stage`` too (`spread_over_stage`).

    A table split over ``fsdp`` only by the rules (``embed``; stored over ``fsdp`` x ``stage``), no
    ``data``, as jax 0.10 emits it (seen on ``stage=2,fsdp=4`` and ``stage=4,fsdp=2``): the tokens
    gathered over ``fsdp``, the table gathered whole, its stored shard ``[V, D/(f S)]`` moved by a
    collective-permute and 1/S of the looked-up rows ``[rows, T, D]`` (float32) by an all-to-all.
    Other splits: priced as without stages on the mesh with ``stage`` folded into ``fsdp``
    (`_embedding_comms`), not checked against the compiler.
    """
    embedding = model.with_role("embedding")
    if embedding is None:
        return []
    mesh = layout.mesh
    table = placed[embedding.path]
    if mesh[ax.DATA] > 1 or mesh[ax.FSDP] <= 1 or _table_split(table) != (1, mesh[ax.FSDP]):
        flat, flat_placed = _stage_folded(model, layout, layout.rules_table())
        return _embedding_comms(model, flat, flat_placed, embed)
    (v, d), f, stages = table.param.shape, mesh[ax.FSDP], mesh[ax.STAGE]
    whole = v * d * _PARAM_BYTES
    return [
        Comm("all-gather", (ax.FSDP,), f, embed.tok * f * _INT_BYTES, 1, "embedding: tokens"),
        Comm("all-gather", (ax.FSDP, ax.STAGE), f * stages, whole, 1, "embedding: table"),
        Comm("all-to-all", (ax.FSDP,), f, embed.tok * d * _PARAM_BYTES / stages, 1, "embedding: 1/S of the rows"),
        Comm("collective-permute", (ax.STAGE,), 2, whole / (f * stages), 1, "embedding: stored table shard"),
    ]


def _pipeline_head_comms(model: ModelDescription, layout: Layout, rules: Rules, head: _Shape, pipe: _Pipe,
                         backend: str, batch_rows: float | None) -> list[Comm]:
    """See `_pipeline_head_comms_cached` (the same for every stage device of a layout: cached)."""
    return list(_pipeline_head_comms_cached(model, rules, tuple(layout.mesh.items()), layout.remat, layout.attention,
                                            layout.dtype, layout.logits, head, pipe.one_f_one_b, backend, batch_rows))


@functools.lru_cache(maxsize=16384)
def _pipeline_head_comms_cached(model: ModelDescription, rules: Rules, mesh_items: tuple, remat: str, attention: str,
                                dtype: str, logits: str, head: _Shape, one_f_one_b: bool, backend: str,
                                batch_rows: float | None) -> tuple[Comm, ...]:
    """The head's weights (final norm, output projection) and collectives.

    GPipe/circular: the head runs under `head_parallelism` outside the pipeline, as the step without
    stages on the mesh with ``stage`` folded into ``fsdp`` prices it (`_comms`, the head's rows). 1F1B:
    its weights are gathered explicitly once per step (`sharding.pipeline.onef1b`), each over ``stage``
    (to ``1/f`` of it) and over ``fsdp`` (whole), its gradients reduce-scattered over ``fsdp`` and
    summed over ``stage``.
    """
    layout = Layout(dict(mesh_items), rules, remat=remat, attention=attention, dtype=dtype, logits=logits)
    flat, flat_placed = _stage_folded(model, layout, rules)
    if not one_f_one_b:
        comms = _comms(model, flat, rules, flat_placed, dataclasses.replace(head, slots=0), backend, batch_rows,
                       embedding=False)
        # (its layer terms count 0: no layers on that shape)
        for p in flat_placed.values():  # stored over ``stage`` alone (rules without fsdp): gathered over it
            if p.param.per_layer or p.param.role == "embedding" or p.factor(ax.FSDP) > 1:
                continue
            spec = spread_over_stage(logical_to_spec(p.param.axes, rules, p.param.shape, layout.mesh)[0],
                                     p.param.shape, layout.mesh)
            if any(ax.STAGE in ((e,) if isinstance(e, str) else e or ()) for e in spec):
                comms.append(Comm("all-gather", (ax.STAGE,), layout.mesh[ax.STAGE], p.local * _PARAM_BYTES,
                                  1 if p.param.role == "output" else 2, f"gather {p.param.path} over stage"))
        return tuple(comms)
    mesh, comms = layout.mesh, []
    f, stages = mesh[ax.FSDP], mesh[ax.STAGE]
    for p in flat_placed.values():
        if p.param.per_layer or p.param.role == "embedding":
            continue
        whole, what = p.param.size * _PARAM_BYTES, p.param.path
        comms += [
            Comm("all-gather", (ax.STAGE,), stages, whole / f, 1, f"gather {what} over stage"),
            Comm("all-gather", (ax.FSDP,), f, whole, 1, f"gather {what}"),
            Comm("reduce-scatter", (ax.FSDP,), f, whole / f, 1, f"gradient of {what}"),
            Comm("all-reduce", (ax.STAGE,), stages, whole / f, 1, f"gradient of {what} over stage"),
        ]
    return tuple(comms)


def _batch_factor(p: _Placed, mesh: Mapping[str, int]) -> int:
    """How many ways the batch axes (``data``, ``fsdp``) split a parameter."""
    return p.factor(*(a for a in ax.BATCH_MESH_AXES if mesh[a] > 1))


def _pipeline_weight_comms(layout: Layout, rules: Rules, placed: dict[str, _Placed], pipe: _Pipe,
                           model: ModelDescription) -> list[Comm]:
    """See `_pipeline_weight_comms_cached` (the same for every device of a split: cached)."""
    return list(_pipeline_weight_comms_cached(model, rules, tuple(layout.mesh.items()), _gather_bytes(layout),
                                              pipe.stages, pipe.working, pipe.groups, pipe.moved))


@functools.lru_cache(maxsize=16384)
def _pipeline_weight_comms_cached(model: ModelDescription, rules: Rules, mesh_items: tuple, gather_bytes: int,
                                  stages: int, working: int, groups_n: int, moved: tuple[int, ...]) -> tuple[Comm, ...]:
    """The stage's layer weights: the working copy assembled once per step, the gradients returned once.

    Explicit collectives of the stage program (`jax.shard_map`, so both backends emit them as written;
    `sharding.pipeline.schedule._Weights`), per layer parameter: the rows stored for other devices sent
    by one ppermute per distance (compute dtype) and their gradients sent back (float32); this device's
    ``R*K'/G`` slots all-gathered over the storage's group axes into the ``R*K'`` slots (compute dtype)
    and their float32 gradient sums reduce-scattered back; the ``q`` stored rows' gradients all-reduced
    over the batch axes that do not store rows.
    """
    mesh = dict(mesh_items)
    placed = _place_cached(model, rules, mesh_items)
    summed = tuple(a for a in ax.BATCH_MESH_AXES if mesh[a] > 1)
    groups = _storage_axes(model, rules, mesh)
    rest = tuple(a for a in summed if a not in groups)
    q = -(-model.num_layers // (stages * groups_n))
    devices = (ax.STAGE, *groups)
    comms = []
    for p in placed.values():
        if not p.param.per_layer:
            continue
        row, what = p.local * p.factor(*groups), p.param.path  # one stored row's elements on a device
        for rows in moved:
            comms.append(Comm("collective-permute", devices, 2, rows * row * gather_bytes, 1,
                              f"stored rows of {what} to their stage"))
            comms.append(Comm("collective-permute", devices, 2, rows * row * _PARAM_BYTES, 1,
                              f"gradient of {what} back to its row"))
        if groups_n > 1:
            comms.append(Comm("all-gather", groups, groups_n, working * row * gather_bytes, 1,
                              f"gather {what} (working copy)"))
            comms.append(Comm("reduce-scatter", groups, groups_n, working // groups_n * row * _PARAM_BYTES,
                              1, f"gradient of {what}"))
        if rest:
            comms.append(Comm("all-reduce", rest, math.prod(mesh[a] for a in rest), q * row * _PARAM_BYTES, 1,
                              f"gradient of {what} (stored rows)"))
    return tuple(comms)


def _stage_comms(model: ModelDescription, layout: Layout, s: _Shape, pipe: _Pipe, head: _Shape) -> list[Comm]:
    """Activations between stages: two ppermutes of one microbatch's rows ``[rows, T, D]`` per loop trip
    (GPipe/circular: one forward, one backward per step; 1F1B: the forward output and the input's
    cotangent per tick), bubble steps included: the transfers sit outside the conditionals; the inputs'
    cotangent ``[M, rows, T, D]`` summed over ``stage`` (the inputs were made stage-varying). GPipe/circular
    also: one psum over ``stage`` of all microbatches' outputs after the forward loop (the last stage's
    outputs to every stage) and its transpose, and the head's input cotangent all-gathered over ``stage``
    (`head_parallelism`)."""
    stages = layout.mesh[ax.STAGE]
    act = s.tok * model.hidden * s.act_bytes
    comms = [Comm("collective-permute", (ax.STAGE,), stages, act, 2 * pipe.steps, "stage activations", False)]
    if pipe.one_f_one_b:  # the inputs' cotangent, summed over stage (they were made stage-varying)
        return comms + [Comm("all-reduce", (ax.STAGE,), stages, act * s.micro, 1, "pipeline input cotangent", False)]
    return comms + [
        Comm("all-reduce", (ax.STAGE,), stages, act * s.micro, 2, "pipeline outputs to every stage", False),
        Comm("all-gather", (ax.STAGE,), stages, head.tok * stages * model.hidden * s.act_bytes, 1,
             "head input cotangent over stage", False),
    ]


# --- Time -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What one device and its links can do.

    Attributes:
      peak_flops: Dense peak of the compute dtype, FLOP/s.
      memory_bytes: Device memory, bytes.
      memory_bandwidth: Bytes/s.
      intra_bandwidth: Bytes/s one device sends to a peer on its host, one direction.
      inter_bandwidth: Bytes/s one device gets of its host's network, one direction (the host's
        bandwidth over its devices).
      intra_latency: Seconds per ring step inside a host (alpha).
      inter_latency: Seconds per ring step across hosts (alpha).
      efficiency: Fraction of peak the matrix products reach (MFU of a well-tuned step).
    """

    peak_flops: float
    memory_bytes: float
    memory_bandwidth: float
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float = 5e-6
    inter_latency: float = 15e-6
    efficiency: float = 0.5


def hardware_for(kind: Any, devices_per_host: int, inter_host_bandwidth: float, efficiency: float = 0.5) -> Hardware:
    """`Hardware` from a `sharding.devices.DeviceKind` and its host.

    Alphas: about 5 us per step over NVLink/PCIe and 15 us across hosts, the small-message
    latencies nccl-tests reports for all-reduce on DGX-class systems (NCCL PERFORMANCE.md).

    Raises:
      ValueError: When the kind's figures are unknown (e.g. a detected CPU).
    """
    if not getattr(kind, "is_known", False):
        raise ValueError(f"device kind {getattr(kind, 'name', kind)!r} has unknown figures; "
                         f"give --cluster or --simulate-cluster with a known kind, e.g. h100:8")
    return Hardware(
        peak_flops=kind.peak_bf16_flops,
        memory_bytes=kind.memory_bytes,
        memory_bandwidth=kind.memory_bandwidth,
        intra_bandwidth=kind.intra_host_bandwidth,
        inter_bandwidth=inter_host_bandwidth / max(devices_per_host, 1),
        efficiency=efficiency,
    )


def link_classes(mesh: Mapping[str, int], devices_per_host: int) -> dict[str, str]:
    """Mesh axis -> ``intra`` or ``inter``: whether its groups cross hosts.

    Devices are laid out as `sharding.mesh.split_outer_inner` does by default: the innermost axes
    (``tensor``, ``sequence``, ``fsdp``, ``stage``, ``data``) fill a host first.
    """
    classes, remaining = {}, devices_per_host
    for axis in reversed(ax.MESH_AXES):
        size = mesh.get(axis, 1)
        inner = math.gcd(size, remaining)
        remaining //= inner
        classes[axis] = "intra" if inner == size else "inter"
    return classes


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step on one device.

    Attributes:
      compute: Matrix products and elementwise work at ``efficiency x peak``.
      optimizer: The update's memory traffic (read gradient, parameter, moments; write them).
      exposed_comm: Collectives on the critical path (tensor, sequence, stage).
      overlapped_comm: Collectives that can overlap compute (weight gathers, gradient reductions).
      total: ``max(compute, overlapped_comm) + exposed_comm + optimizer``.
      by_kind: Seconds per collective kind.
    """

    compute: float
    optimizer: float
    exposed_comm: float
    overlapped_comm: float
    total: float
    by_kind: dict[str, float]


def comm_seconds(comm: Comm, hw: Hardware, links: Mapping[str, str]) -> float:
    """Alpha-beta time of one collective's executions per step on the slowest link of its axes."""
    inter = any(links.get(a) == "inter" for a in comm.axes)
    bandwidth = hw.inter_bandwidth if inter else hw.intra_bandwidth
    alpha = hw.inter_latency if inter else hw.intra_latency
    return comm.count * (comm.steps() * alpha + comm.wire_bytes() / bandwidth)


def step_time(cost: Cost, hw: Hardware, links: Mapping[str, str]) -> StepTime:
    """Step time of one device from its `Cost`.

    Args:
      cost: From `estimate` or `device_cost` (``backend="gpu"``).
      hw: The device (`Hardware`).
      links: Mesh axis -> ``intra``/``inter`` (`link_classes`).

    Returns:
      The `StepTime` (seconds).
    """
    compute = cost.flops.total / (hw.peak_flops * hw.efficiency)
    optimizer = 7 * cost.memory.parameters / hw.memory_bandwidth  # read 4 arrays, write 3
    exposed = overlapped = 0.0
    by_kind: dict[str, float] = {}
    for c in cost.comms:
        seconds = comm_seconds(c, hw, links)
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + seconds
        if c.overlappable:
            overlapped += seconds
        else:
            exposed += seconds
    total = max(compute, overlapped) + exposed + optimizer
    return StepTime(compute, optimizer, exposed, overlapped, total, by_kind)
