"""The layout of one step as the cost model reads it, and where it puts the model's parameters.

`Layout` (mesh sizes over ``data, stage, fsdp, context, sequence, tensor``, a rules preset, microbatches,
remat, stage split, attention, dtype, the uneven and pipeline switches) and `layout_of`, which derives
it from a run's `sharding.parallel.Parallelism`; `describe_model`; how a
layout's rules split each parameter (`_Placed`, `_place_cached`) and each logical axis
(`_axis_split`, `_tensor_split`); the per-token terms of the model's description on one device
(`_per_token`); the per-device sizes of one step (`_Shape`); the byte sizes every part shares.

Units: elements, bytes. Imports nothing of the project outside `sharding`, never the model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from sharding import axes as ax
from sharding.balance import tokens_for_speeds
from sharding.errors import ConfigError, Field
from sharding.expert_placement import ExpertPlacement, expert_placement
from sharding.modeldesc import AttentionTraits, ModelDescription, Param
from sharding.parallel import CONTIGUOUS, OPTIMIZER_SHARDINGS, REPLICATED, ZIGZAG, Parallelism
from sharding.pipeline.layout import GATHERS, SCHEDULES, Schedule
from sharding.rules import Rules, get_rules, logical_to_spec
from sharding.vocab import OUTPUT_IMPLS

_PARAM_BYTES = 4  # parameters, gradients and AdamW moments are float32
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_INT_BYTES = 4  # int32 tokens, positions, segment ids
_BATCH_FIELDS = 5  # tokens, targets, positions, segment_ids (int32), loss_mask (float32)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one step is laid out over the devices.

    Attributes:
      mesh: Mesh axis -> size over ``data, stage, fsdp, context, sequence, tensor`` (missing axes are 1).
      rules: Rules preset name (``dp``, ``fsdp``, ``tp``, ``fsdp_tp``, ``tp_sp``, ``fsdp_tp_sp``) or a `Rules` table.
      microbatches: M, gradient-accumulation steps per global batch (pipeline microbatches when
        ``stage > 1``).
      remat: ``none``, ``dots`` or ``full`` (`models.config.REMAT_POLICIES`).
      stage_layers: Layers per pipeline stage, one per ``stage`` index, summing to the model's
        layers; None splits evenly (`sharding.pipeline.layout.plan_layout`).
      pipeline_repeats: R, stage chunks per device (circular schedule); 1 is GPipe.
      attention: The name of an attention kernel of the model (``ModelConfig.attention``); what it costs
        is the model's to say (`sharding.modeldesc.ModelDescription.attention_kernel`, its
        `sharding.modeldesc.AttentionTraits`), so it is checked when the layout is priced: a kernel that
        splits the length is priced without a ``sequence`` axis only (`unpriced_attention`).
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
      pipeline_schedule: Pipeline only: the `sharding.pipeline.layout.Schedule` (``--pipeline-schedule``; its
        string is taken too). GPipe and circular follow ``pipeline_repeats`` (`Schedule.for_repeats`); the 1F1B
        family (``1f1b``, interleaved with ``pipeline_repeats`` > 1; ``1f1b-fused``; ``zb``, zero bubble, whose
        backward's two halves each recompute the layer) runs `sharding.pipeline.onef1b` from its tick table
        (`Schedule.tick_table`).
      pipeline_gather: Pipeline only: when the stage's layer weights are gathered (``--pipeline-gather``,
        `sharding.pipeline.layout.GATHERS`): ``once`` per step, or per ``microbatch`` one block at a time.
      stream_edges: Pipeline only: the 1F1B family gathers its head's and its entry's (the embedding's)
        weights per microbatch inside their conditionals (`sharding.pipeline.PipelinePlan.streams_head`); None
        derives it as the plan does (a 1F1B-family ``pipeline_schedule``, ``pipeline_gather`` ``microbatch``,
        ``skip_empty``), so that a layout changed by `dataclasses.replace` stays consistent. Set it only to
        price, every slot priced (``skip_empty`` False), a compiled program that streams them
        (``bench/costmodel_grid.py``).
      context_layout: How tokens lie along a split length (``--context-layout``): ``zigzag`` balances
        the causal work of a ring; ``contiguous`` leaves its last device the most (priced: the busiest).
      context_shares: Uneven sequence shards (``--context-shares``, ring attention in the zigzag layout):
        one share per device of the length's split, in ring order (``context`` major, then ``sequence``),
        either the real tokens of a sequence (even ints summing to the length the layout is priced at) or
        relative shares (turned into tokens by `sharding.balance.tokens_for_speeds`); None: even shards.
        Every device runs a padded block of ``max`` share tokens (`ring_tokens`).
      optimizer_sharding: ``replicated`` or ``data`` (`sharding.parallel.Parallelism.optimizer_sharding`): with
        ``data``, the float32 parameters and moments split over ``data`` too (`sharding.costmodel.zero`).

    Raises:
      ValueError: On an unknown axis, a size below 1, or an unknown remat/dtype/logits.
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
    pipeline_schedule: Schedule = Schedule.GPIPE
    pipeline_gather: str = "once"
    stream_edges: bool | None = None
    context_layout: str = ZIGZAG
    context_shares: tuple[float, ...] | None = None
    optimizer_sharding: str = REPLICATED

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
        for field, allowed in (
            ("remat", ("none", "dots", "full")),
            ("dtype", tuple(_DTYPE_BYTES)),
            ("logits", OUTPUT_IMPLS),
            ("pipeline_gather", GATHERS),
            ("pipeline_schedule", SCHEDULES),
            ("context_layout", (CONTIGUOUS, ZIGZAG)),
            ("optimizer_sharding", OPTIMIZER_SHARDINGS),
        ):
            if getattr(self, field) not in allowed:
                raise ConfigError(Field(field, repr(getattr(self, field))), f": choose one of {', '.join(allowed)}")
        object.__setattr__(
            self, "pipeline_schedule", Schedule(self.pipeline_schedule).for_repeats(self.pipeline_repeats)
        )
        if self.context_shares is not None:
            shares = tuple(self.context_shares)
            if len(shares) != self.length_split or not all(s >= 0 for s in shares) or not any(shares):
                raise ValueError(
                    f"context_shares {list(shares)}: give one share >= 0 per device of the split length "
                    f"({self.length_split}), not all 0, e.g. {tuple([1] * max(self.length_split, 2))}"
                )
            object.__setattr__(self, "context_shares", shares)
        for field in ("microbatches", "pipeline_repeats"):  # fields a command line names by their flags
            if getattr(self, field) < 1:
                raise ConfigError(Field(field, getattr(self, field)), ": must be >= 1, e.g. ", Field(field, 1))

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def length_split(self) -> int:
        """Devices each sequence's tokens are split over: the mesh axes the rules map ``length`` to
        (`Rules.length_split`; ``context`` x ``sequence`` under every preset)."""
        return self.rules_table().length_split(self.mesh)

    @property
    def batch_split(self) -> int:
        """Devices the batch is split over: the mesh axes the rules map ``batch`` to (`Rules.batch_split`;
        ``data`` x ``fsdp`` x ``expert`` under every preset)."""
        return self.rules_table().batch_split(self.mesh)

    def rules_table(self) -> Rules:
        return self.rules if isinstance(self.rules, Rules) else _preset(self.rules)

    @property
    def rules_name(self) -> str:
        return self.rules.name if isinstance(self.rules, Rules) else self.rules


@functools.cache
def _preset(name: str) -> Rules:
    return get_rules(name)


def ring_tokens(layout: Layout, seq_len: int) -> tuple[int, ...] | None:
    """Real tokens of one sequence on each device of the length's split (ring order) under uneven shares,
    or None for even shards (``layout.context_shares`` None).

    Shares that are already even token counts summing to ``seq_len`` are taken as they are; other shares
    are relative and shared out in whole zigzag chunk pairs (`sharding.balance.tokens_for_speeds`, as
    ``--context-shares`` does). Every device then holds a block of ``max(tokens)`` positions, its own
    tokens and padding (`models.kernels.ring_attention.uneven_zigzag_layout`), so the step runs
    ``P * max(tokens)`` positions per sequence.

    Raises:
      ValueError: Relative shares with a zero among them, or an odd ``seq_len``.
    """
    shares = layout.context_shares
    if shares is None:
        return None
    if sum(shares) == seq_len and all(float(s).is_integer() and int(s) % 2 == 0 for s in shares):
        return tuple(int(s) for s in shares)
    if seq_len % 2 or not all(s > 0 for s in shares):
        raise ValueError(
            f"context_shares {list(shares)} over {seq_len} tokens: relative shares must be positive and the "
            f"length even (two zigzag chunks a device), e.g. context_shares={tuple([1] * len(shares))}"
        )
    return tokens_for_speeds(seq_len, shares)


def unpriced_attention(
    kernel: AttentionTraits,
    mesh: Mapping[str, int],
    kernels: Sequence[AttentionTraits] = (),
    length_axes: Sequence[str] = ax.LENGTH_MESH_AXES,
) -> str | None:
    """Why the cost model cannot price attention ``kernel`` on ``mesh``, or None when it can.

    A kernel that splits the length (ring, all-to-all or USP attention, its ``context_exchange``) is
    priced on any ``context`` x ``sequence`` split: its traffic is `sharding.costmodel.context`'s, its
    FLOPs and activations those of its share of the tokens. One that needs the length whole is priced
    over ``sequence`` as the partitioner runs it (keys and values gathered), but not over ``context``,
    whose gathers the cost model does not model.

    Args:
      kernel: The attention's traits (`sharding.modeldesc.ModelDescription.attention_kernel`).
      mesh: Mesh axis -> size (missing axes are 1).
      kernels: The model's kernels (`sharding.modeldesc.ModelDescription.attention_kernels`): the reason names
        those that split the length, the ones that would be priced.
      length_axes: The mesh axes the rules map ``length`` to (`sharding.rules.Rules.mesh_axes`); the default is
        every preset's: a ``context`` axis outside them splits no sequence and is priced as any other.
    """
    context = mesh.get(ax.CONTEXT, 1) if ax.CONTEXT in length_axes else 1
    if context > 1 and not kernel.splits_length:
        splitting = ", ".join(k.name for k in kernels if k.splits_length)
        return (
            f"attention {kernel.name!r} over context={context}: the cost model prices the context axis for the "
            f"attentions that split the length{f' ({splitting})' if splitting else ''} only"
        )
    return None


def attention_of(model: ModelDescription, layout: Layout) -> AttentionTraits:
    """The traits of ``layout``'s attention, as the model describes it.

    Raises:
      ValueError: When the model has no attention of that name, or the cost model cannot price it on the
        layout's mesh (`unpriced_attention`); each names the attention.
    """
    kernel = model.attention_kernel(layout.attention)
    reason = unpriced_attention(kernel, layout.mesh, model.attention_kernels, layout.rules_table().mesh_axes(ax.LENGTH))
    if reason:
        raise ValueError(reason)
    return kernel


def layout_of(par: Parallelism, config: Any = None, **fields: Any) -> Layout:
    """The `Layout` the cost model prices for a run's `sharding.parallel.Parallelism`: the one way from a
    run's layout to the cost model's (the planner's plans, the benches and ``--dry-run`` use it).

    The mesh and rules are the run's; the strategy and pipeline give the rest: `Accumulation` its microbatches,
    `UnevenBatch` the uneven step (``uneven_batch``, microbatches the per-device average), uneven context
    shares their real tokens per ring device (``context_shares``; ``auto`` before it is measured prices even
    shards), a pipeline (`sharding.parallel.Parallelism.pipeline`, a `sharding.pipeline.PipelinePlan`) its
    stage split, repeats, microbatches, schedule (``pipeline_schedule``), gather mode (``pipeline_gather``)
    and ``skip_empty``.

    Args:
      par: The run's parallelism (bound to a mesh or not).
      config: Optional: an object with the model's execution settings as attributes ``remat``,
        ``attention``, ``dtype`` and ``logits`` (`models.config.ModelConfig`); each one present is used.
      **fields: `Layout` fields that override the above (e.g. ``remat="full"``).

    Returns:
      The `Layout`.

    Raises:
      ValueError: As `Layout`.
    """
    values = {f: getattr(config, f) for f in ("remat", "attention", "dtype", "logits") if hasattr(config, f)}
    plan = par.pipeline
    if plan is not None:
        values.update(
            microbatches=plan.microbatches,
            stage_layers=plan.layout.stage_layers,
            pipeline_repeats=plan.layout.repeats,
            skip_empty=plan.skip_empty,
            pipeline_schedule=plan.schedule,
            pipeline_gather=plan.gather,
        )
    else:
        values.update(microbatches=par.microbatches, uneven_batch=par.strategy.uneven)
    if par.length_shards > 1 and par.context_layout in (CONTIGUOUS, ZIGZAG):  # "auto" until the mesh is resolved
        values.update(context_layout=par.context_layout)
    if isinstance(par.context_shares, tuple):  # "auto" until measured at start-up: priced even
        values.update(context_shares=par.context_shares)
    values.update(optimizer_sharding=par.optimizer_sharding)
    values.update(fields)
    return Layout(dict(par.mesh_shape), par.rules, **values)


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
    """How many ways the rules split the model's logical axis ``logical`` (1 for None; ``act_length``: the
    residual stream's split beyond the per-device tokens', `sharding.rules.Rules.sequence_split`)."""
    if logical is None:
        return 1
    if logical == ax.ACT_LENGTH:
        return rules.sequence_split(mesh)
    return math.prod(mesh[a] for a in _model_splits(model, rules, tuple(mesh.items()))[logical])


def _fsdp_gather_bytes(layout: Layout, backend: str) -> int:
    """Bytes per element of an FSDP weight gather of the (GSPMD) step: on GPU the compute dtype. The model
    casts each float32 weight to the compute dtype where it is used; the cast is elementwise, so it runs on
    the shard, and the partitioner gathers at the use, the product's operand, which is the cast's result
    (torchtitan's FSDP2 gathers in ``param_dtype`` bfloat16 the same way). XLA's CPU backend upcasts
    bfloat16 collectives, so on CPU float32. The distributed optimizer's gather of the parameters over ``data``
    moves the same (`sharding.costmodel.zero.zero_comms`: the slices are rounded to the compute dtype before it)."""
    return _DTYPE_BYTES[layout.dtype] if backend == "gpu" else _PARAM_BYTES


def _in_stack(path: str) -> str:
    """A layer weight's path inside its stack: ``attention/q`` for ``layers/attention/q`` and for
    ``dense_layers/attention/q`` (a mixture's dense layers, whose products the description gives once)."""
    return path.split("/", 1)[-1]


def _stack_share(model: ModelDescription, param: Param, layers: int) -> float:
    """The fraction of ``layers`` layers that run ``param``'s product: 1 (the int) for a stack over every
    layer; for a mixture, the layers of the stacks that hold it (its dense layers' MLP, its MoE layers'
    experts; the attention both stacks hold: every layer), as `sharding.modeldesc.Param.copies` counts them."""
    if param.stack is None or not layers:
        return 1
    name = _in_stack(param.path)
    held = sum(q.copies(layers) for q in model.params if q.per_layer and _in_stack(q.path) == name)
    return min(held, layers) / layers


def _tensor_split(model: ModelDescription, axes: Sequence[str], rules: Rules, mesh: Mapping[str, int]) -> bool:
    """Whether any of the model's logical ``axes`` is split over ``tensor`` (an unnamed one never is)."""
    splits = _model_splits(model, rules, tuple(mesh.items()))
    return mesh[ax.TENSOR] > 1 and any(ax.TENSOR in splits.get(a, ()) for a in axes)


def _per_token(
    model: ModelDescription,
    terms: str,
    rules: Rules,
    mesh: Mapping[str, int],
    keys: float,
    act_bytes: int | None = None,
    kept: tuple[str, ...] | None = None,
) -> float:
    """The sum of the description's ``terms`` (``layer_elementwise``, ``loss_elementwise`` or
    ``activations``) per token on one device: each divided by its axis's split, score terms times
    ``keys`` (0: the scores are not materialised); with ``act_bytes``, in bytes (the term's own bytes
    per element, else ``act_bytes``); with ``kept``, only terms that carry one of those tags."""
    return _per_token_cached(model, terms, rules, tuple(mesh.items()), keys, act_bytes, kept)


@functools.lru_cache(maxsize=65536)
def _per_token_cached(
    model: ModelDescription,
    terms: str,
    rules: Rules,
    mesh_items: tuple,
    keys: float,
    act_bytes: int | None,
    kept: tuple[str, ...] | None,
) -> float:
    mesh = dict(mesh_items)
    total = 0.0
    for t in getattr(model, terms):
        if kept is not None and not set(t.kept) & set(kept):
            continue
        amount = t.amount * (keys if t.per_key else 1.0) / _axis_split(model, t.axis, rules, mesh)
        if t.per_copy:
            amount *= _copies_held(model, rules, mesh)
        if act_bytes is not None:
            amount *= t.bytes or act_bytes
        total += amount
    return total


def _copies_held(model: ModelDescription, rules: Rules, mesh: Mapping[str, int]) -> int:
    """A mixture of experts' routed copies one device computes per token of its own
    (`sharding.expert_placement.ExpertPlacement.copies_held` of `expert_placement_of`); 0 for a dense model."""
    experts = model.experts
    if experts is None:
        return 0
    return expert_placement_of(model, rules, mesh).copies_held(experts.experts_per_token)


def expert_placement_of(
    model: ModelDescription, rules: Rules, mesh: Mapping[str, int], tokens: tuple[int, int] | None = None
) -> ExpertPlacement:
    """Where the model's mixture of experts sits on ``mesh`` under ``rules`` and which dispatch it runs, as the
    model decides it (`sharding.expert_placement.expert_placement`): inside pipeline stages (``stage`` > 1) the
    layer runs locally, each stage device computing every expert (`models.moe` inside the pipeline's map).

    Args:
      model: A description with experts (``model.experts`` not None).
      rules: The rules table.
      mesh: Mesh axis -> size.
      tokens: ``[batch, length]`` of one call of the layer (a microbatch's sequences and positions, whole over
        the mesh); None takes the rules' axes as dividing them (what `Layout`'s checks of the batch ensure).
    """
    return _expert_placement_cached(model.experts, rules, tuple(mesh.items()), tokens)


@functools.lru_cache(maxsize=4096)
def _expert_placement_cached(experts, rules: Rules, mesh_items: tuple, tokens) -> ExpertPlacement:
    mesh = dict(mesh_items)
    return expert_placement(experts, rules, mesh if mesh.get(ax.STAGE, 1) == 1 else {}, tokens)


@dataclasses.dataclass(frozen=True)
class _Shape:
    """Per-device sizes of one step."""

    rows: float  # sequences per microbatch on this device
    seq: int  # positions per sequence the step runs: T, or with uneven context shares P * max(share) (padded)
    tok: float  # positions per microbatch on this device (rows * seq / (context * sequence)), padding included
    micro: int  # microbatches this device runs
    layers: int  # layers computed per microbatch
    slots: int  # layer slots held without a pipeline (with one: `_held_params`)
    act_bytes: int
    keys: int | None = None  # with uneven context shares: T, the real tokens a sequence's queries attend
    real: float = 1.0  # with uneven context shares: this device's real tokens over its positions (share / max)
