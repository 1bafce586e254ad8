"""The search: the fastest layouts of one training step on a (mixed) cluster.

`plan` walks the search space (`_candidates`: meshes whose ``tensor`` and ``sequence`` groups stay
inside a host, rules presets, attentions, microbatches, pipeline repeats and schedules), fills in
the remat policy (without stages the cheapest that fits; a pipeline every policy under both optimizer-state
layouts), the per-kind batch shares (uneven data parallelism), the
stage splits per pipeline schedule and, for ring attention over a length split across device kinds,
uneven sequence shards (all three in `sharding.planner.shares`: started from each kind's priced time,
refined on exact prices), and prices each on an `_Evaluator` (`sharding.planner.evaluator`): the layouts
without stages first, then the pipelines lowest floor first, skipping a pipeline variant or schedule whose floor
cannot reach the answer (`sharding.planner.prune`; the answer is the exhaustive search's to the bit);
`brute_force` enumerates every split of the same space, for tests. `uniform_baseline` is the best plan with the same work on every
device, `evaluate` prices one given layout, `no_plan_reason` says why no plan came back.

Imports nothing of the project outside `sharding`, never the model.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from sharding import axes as ax
from sharding import costmodel as cm
from sharding.costmodel.context import context_groups
from sharding.errors import ConfigError, Field, FieldText
from sharding.mesh import format_mesh
from sharding.modeldesc import AttentionTraits, ModelDescription
from sharding.parallel import REPLICATED, counts_of_kinds
from sharding.pipeline.layout import plan_layout
from sharding.planner import shares
from sharding.planner.evaluator import Plan, PlanOptions, _Cluster, _Evaluator, over_memory
from sharding.planner.prune import Cutoff, pipeline_floor, schedule_floors
from sharding.rules import get_rules
from sharding.splits import even_split, spread


def _factorizations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, parts - 1):
                yield (d,) + rest


def _meshes(model: ModelDescription, cluster: _Cluster, options: PlanOptions) -> Iterator[dict[str, int]]:
    """Mesh shapes: tensor and sequence groups inside a host; the model's ``heads``, ``mlp`` and
    ``vocab`` divisible by ``tensor``. With ``options.sequence``, the length split over ``sequence``
    (inside a host) and ``context`` (which may span hosts). For a mixture of experts, pipeline stages only
    where a run allows them (`sharding.modeldesc.ExpertGeometry.pipelined`: every layer a mixture, dropless),
    and besides each mesh without stages its variants with ``expert`` = e taken from ``fsdp`` (e dividing
    ``fsdp`` and the experts; inside a stage ``expert`` splits the experts' storage only, each device computing
    all of them, which prices as the mesh without it)."""
    shapes = (
        _factorizations(cluster.size, 6)
        if options.sequence
        else ((d, p, f, 1, 1, t) for d, p, f, t in _factorizations(cluster.size, 4))
    )
    for data, stage, fsdp, context, sequence, tensor in shapes:
        if tensor * sequence > cluster.per_host or cluster.per_host % (tensor * sequence):
            continue
        if (sequence > 1 or context > 1) and not options.sequence:
            continue
        if stage > 1 and (
            not options.pipeline
            or stage > model.num_layers
            or (options.max_stages is not None and stage > options.max_stages)
        ):
            continue
        if tensor > 1 and any(model.axis_sizes[a] % tensor for a in (ax.HEADS, ax.MLP, ax.VOCAB)):
            continue
        mesh = {
            ax.DATA: data,
            ax.STAGE: stage,
            ax.FSDP: fsdp,
            ax.CONTEXT: context,
            ax.SEQUENCE: sequence,
            ax.TENSOR: tensor,
        }
        if model.experts is None:
            yield mesh
            continue
        if stage > 1 and not model.experts.pipelined(model.num_layers):
            continue
        yield mesh
        if stage > 1:
            # Inside a stage ``expert`` only splits the experts' storage (every device computes all of them):
            # priced as this mesh with ``fsdp * expert``, so its variants would only tie with it.
            continue
        # Expert parallelism borrows devices of fsdp (torchtitan's rule): expert=e divides the experts.
        for e in range(2, fsdp + 1):
            if fsdp % e == 0 and model.experts.num_experts % e == 0:
                yield {**mesh, ax.FSDP: fsdp // e, ax.EXPERT: e}


def _rules_for(model: ModelDescription, mesh: Mapping[str, int], options: PlanOptions) -> list[str]:
    """Presets that differ on this mesh: ``fsdp*`` only with ``fsdp`` > 1, ``*tp`` and ``*tp_sp`` (sequence
    parallelism) only with ``tensor`` > 1; the ``_sp`` ones for dense models (a mixture of experts runs with
    them, but its layers' collectives under them are not checked against the compiler)."""
    out = []
    for name in options.rules:
        wants_fsdp, wants_tp = name.startswith("fsdp"), "tp" in name.split("_")
        zero = mesh[ax.FSDP] * mesh.get(ax.EXPERT, 1)  # the weights' embed goes over fsdp and expert
        if wants_fsdp != (zero > 1) or wants_tp != (mesh[ax.TENSOR] > 1):
            continue
        if wants_fsdp and model.axis_sizes[ax.EMBED] % zero:
            continue
        if name.endswith("_sp") and model.experts is not None:  # a MoE layer's traffic with it is unchecked
            continue
        out.append(name)
    return out


#: Pipelines: microbatches searched up to this many per stage (or `PIPELINE_MICROBATCHES_FLOOR`), where
#: ``max_microbatches`` is None. Past 12 per stage the bubble is under 1/13 of the step and each further
#: microbatch adds its own traffic; Megatron-LM's published layouts (SC'21, Table 1) run 8 to 24 per stage
#: (48 on 2 stages, 512 on 64), all within the bound. Without it the search priced thousands of long
#: pipelines no faster (3x the time of a 16-device plan).
PIPELINE_MICROBATCHES_PER_STAGE = 12
PIPELINE_MICROBATCHES_FLOOR = 64


def _microbatch_options(per_device_rows: int, limit: int | None, at_least: int = 1) -> list[int]:
    """Every divisor of a data-parallel device's rows from ``at_least`` up to ``limit`` (None: all)."""
    top = per_device_rows if limit is None else min(per_device_rows, limit)
    return [m for m in range(max(at_least, 1), top + 1) if per_device_rows % m == 0]


def _best_fitting(plans: Iterable[Plan | None]) -> Plan | None:
    """The fastest plan that fits (the first of equals), or None."""
    return min((p for p in plans if p is not None and p.fits), key=lambda p: p.step_time, default=None)


def _candidates(ev: _Evaluator) -> Iterator[tuple[cm.Layout, str]]:
    """The search space, the one loop every search walks: each mesh, rules preset, attention and
    layout skeleton (`_layouts`), tagged ``uniform``, ``uneven``, ``context`` (uneven sequence shards) or ``pipeline``."""
    for mesh in _meshes(ev.model, ev.cluster, ev.options):
        for rules in _rules_for(ev.model, mesh, ev.options):
            for attention in _attentions_for(ev, mesh):
                yield from _layouts(ev, mesh, rules, attention)


def _attentions_for(ev: _Evaluator, mesh: Mapping[str, int]) -> tuple[str, ...]:
    """The attentions tried on ``mesh``. With the length whole: those asked for (``ev.attentions``). With it
    split over ``context`` x ``sequence``: the kernels that split it (ring, all-to-all, USP; every one the
    model has when none were asked for), each where its heads allow (`_splits_heads_evenly`), and a kernel
    the partitioner runs (reference) over ``sequence`` alone; a kernel needing the length whole under its
    own ``shard_map`` (flash) would gather it, which is not context parallelism, and is left out."""
    model = ev.model
    if math.prod(mesh[a] for a in ax.LENGTH_MESH_AXES) <= 1:  # the search's presets all map length to these
        return tuple(ev.attentions)
    names = list(ev.attentions)
    if ev.options.attentions is None:
        names += [k.name for k in model.attention_kernels if k.splits_length and k.name not in names]
    out = []
    for name in names:
        kernel = model.attention_kernel(name)
        if cm.unpriced_attention(kernel, mesh) is not None:
            continue
        if kernel.splits_length and _splits_heads_evenly(model, kernel, mesh) and _canonical_split(kernel, mesh, ev):
            out.append(name)
        elif not kernel.splits_length and not kernel.under_shard_map:
            out.append(name)
    return tuple(out)


def _canonical_split(kernel: AttentionTraits, mesh: Mapping[str, int], ev: _Evaluator) -> bool:
    """Whether ``mesh`` is the one way the search prices a split of the length for ``kernel``: USP needs both
    axes (its all-to-all over ``sequence``, its ring over ``context``); ring and all-to-all attention treat
    ``context`` x ``sequence`` as one group, so they take ``sequence`` alone when the group fits inside a host
    and ``context`` alone when it does not (the same program under another name is not priced twice)."""
    context, sequence = mesh[ax.CONTEXT], mesh[ax.SEQUENCE]
    if kernel.exchange.ring and kernel.exchange.all_to_all:
        return context > 1 and sequence > 1
    if context > 1 and sequence > 1:
        return False
    inside = context * mesh[ax.TENSOR]
    return context == 1 or inside > ev.cluster.per_host or ev.cluster.per_host % inside != 0


def _splits_heads_evenly(model: ModelDescription, kernel: AttentionTraits, mesh: Mapping[str, int]) -> bool:
    """Whether a context-parallel kernel's all-to-all divides the query heads of a ``tensor`` shard (KV heads
    are repeated as needed, `sharding.costmodel.context`); a ring needs nothing of the heads."""
    _, a2a_axes = context_groups(kernel, mesh, ax.LENGTH_MESH_AXES)  # every preset's length axes (per mesh)
    inner = math.prod(mesh[a] for a in a2a_axes)
    heads = model.attention.num_heads // max(1, mesh[ax.TENSOR])
    return inner <= 1 or (heads % inner == 0 and heads >= inner)


def _layouts(ev: _Evaluator, mesh: dict[str, int], rules: str, attention: str) -> Iterator[tuple[cm.Layout, str]]:
    """Layout skeletons for a mesh (remat and split filled in later), tagged uniform/uneven/context/pipeline."""
    opts, model = ev.options, ev.model
    n_batch = get_rules(rules).batch_split(mesh)
    if ev.batch % n_batch:
        return
    per_device = ev.batch // n_batch
    stages = mesh[ax.STAGE]
    limit = opts.max_microbatches
    if limit is None and stages > 1:
        limit = max(PIPELINE_MICROBATCHES_FLOOR, PIPELINE_MICROBATCHES_PER_STAGE * stages)
    for m in _microbatch_options(per_device, limit, at_least=stages if stages > 1 else 1):
        for r in opts.repeats if stages > 1 else (1,):
            if stages > 1 and stages * r > model.num_layers:
                continue
            base = cm.Layout(mesh, rules, m, "none", pipeline_repeats=r, attention=attention, dtype=opts.dtype)
            yield base, "pipeline" if stages > 1 else "uniform"
            uneven_ok = (
                opts.hetero
                and _uneven_fits(mesh, rules, model.attention_kernel(attention))
                and len({k.name for k in ev.kinds_in(mesh)}) > 1
            )
            if uneven_ok:
                yield dataclasses.replace(base, uneven_batch=True), "uneven"
            if opts.hetero and _shares_fit(ev, mesh, rules, model.attention_kernel(attention)):
                yield base, "context"


def _shares_fit(ev: _Evaluator, mesh: Mapping[str, int], rules: str, attention: AttentionTraits) -> bool:
    """Whether uneven sequence shards (``--context-shares``) are worth pricing: ring attention (the kernel
    that skips padding; the layout is zigzag) over a length split whose ring positions are paced by
    different device kinds, without pipeline stages, on an even length (zigzag chunk pairs)."""
    if not attention.exchange.takes_shares or mesh[ax.STAGE] > 1 or ev.seq % 2:
        return False
    length_axes = get_rules(rules).length_axes(mesh)
    if not length_axes:
        return False
    return len({k.name for k in ev.ring_kinds(mesh, length_axes)}) > 1


def _uneven_fits(mesh: Mapping[str, int], rules: str, attention: AttentionTraits) -> bool:
    """Whether the uneven step (`train.strategies.UnevenGradients`) runs this layout as the cost model
    prices it: meshes over ``data``, ``fsdp`` and ``tensor`` (tensor inside each data-parallel group, one
    count per group). With ``tensor``, the attention must be one GSPMD partitions (not ``under_shard_map``,
    as ``reference`` and ``dot_product``: a kernel's own `jax.shard_map` cannot sit inside the step's,
    `train.setup.checks`). Left
    out: parameters split over ``fsdp`` and ``tensor`` at once (``fsdp``/``fsdp_tp`` rules with both axes
    > 1), which the step runs exactly but whose parameter gathers the partitioner lays out with extra
    traffic the model does not count (tests/test_hetero.py)."""
    # the uneven step's meshes, whatever the rules (`train.strategies.uneven.check_uneven`): no length axis
    if any(mesh.get(a, 1) > 1 for a in (ax.STAGE, ax.EXPERT, *ax.LENGTH_MESH_AXES)):
        return False
    if mesh[ax.TENSOR] > 1 and attention.under_shard_map:
        return False
    if rules.endswith("_sp"):  # the uneven step's traffic is priced without sequence parallelism
        return False
    return not (mesh[ax.TENSOR] > 1 and mesh[ax.FSDP] > 1 and rules in ("fsdp", "fsdp_tp"))


def _price(ev: _Evaluator, layout: cm.Layout, tag: str, cutoff: Cutoff | None = None) -> Plan | None:
    """The cheapest remat policy that fits (policies are tried cheapest first). A pipeline is priced under
    GPipe and each 1F1B-family schedule, each with its own stage split, and with the weights gathered per
    microbatch where gathering once does not fit (`sharding.planner.shares.pipeline_plans`); heavier remat
    policies are tried until GPipe gathering once fits, and the fastest fitting plan of all of them wins. Inside
    stages the choice trades memory for compute both ways (``none`` keeps each layer's residuals per in-flight
    microbatch, ``full`` recomputes the layer: `sharding.pipeline.layout.keeps`), and a heavier policy may buy a
    faster split or schedule, so a pipeline tries every policy under both optimizer-state layouts. Either
    way both layouts are priced at a policy (the split state gathers parameters in the compute dtype, so it can
    be the faster one, not only the smaller).

    With a ``cutoff`` (`sharding.planner.prune.Cutoff`), a pipeline variant whose floor under every schedule
    (`sharding.planner.prune.schedule_floors`) is above it is skipped, and so is each schedule whose floor is
    (where `shares.pipeline_plans` allows): none of their plans could enter `plan`'s answer, and the plan kept here then changes only where it is slower than the cutoff or does not fit, which
    leaves the answer as it is. Each fitting plan priced here is offered to it (what is kept is no slower, in
    the same group)."""
    last, fitting, fit_remat = None, [], None
    for lay in _state_variants(layout, ev.options.remats, tag):
        if fit_remat is not None and lay.remat != fit_remat:  # a lighter recompute already fits
            break
        if tag == "pipeline":
            skip = None
            if cutoff is not None:
                floors = schedule_floors(ev, lay)
                if cutoff.prunes(min(floors.values(), default=math.inf)):
                    continue
                skip = lambda schedule, floors=floors: cutoff.prunes(floors.get(schedule, math.inf))  # noqa: E731
            plans = shares.pipeline_plans(ev, lay, skip)
            fitting += [one for one in plans if one.fits]
            for one in plans if cutoff is not None else ():
                cutoff.offer(one)
            last = min(plans, key=over_memory, default=last)
            continue
        if tag == "uneven":
            total = lay.batch_split * lay.microbatches
            plan_ = shares.uneven_counts(ev, lay, total, ev.batch / total)
        elif tag == "context":
            plan_ = shares.context_shares(ev, lay)
        else:
            plan_ = ev.uniform(lay)
        if plan_ is None:
            continue
        if plan_.fits:  # the other optimizer-state layout at this recompute is still priced: it may be faster
            fitting.append(plan_)
            fit_remat = lay.remat
            continue
        last = plan_
    return min(fitting, key=lambda p: p.step_time) if fitting else last


def _state_variants(layout: cm.Layout, remats: Iterable[str], tag: str) -> Iterator[cm.Layout]:
    """``layout`` under each remat policy, cheapest first, each first with the optimizer state replicated, then
    (``data`` > 1, not the uneven step, which lays its parameters out itself) split over ``data``
    (`sharding.zero`): it saves the state's memory for no compute and about the same traffic (less where the
    compute dtype is narrower), so it is tried before the next, costlier recompute; `_price` keeps the faster
    of the two that fit at the lightest recompute that fits."""
    shardings = [REPLICATED] + ([ax.DATA] if layout.mesh[ax.DATA] > 1 and tag != "uneven" else [])
    for remat in remats:
        for sharding in shardings:
            yield dataclasses.replace(layout, remat=remat, optimizer_sharding=sharding)


def plan(
    model: Any,
    inventory,
    global_batch: int,
    seq_len: int,
    options: PlanOptions | None = None,
    top: int = 5,
    *,
    _exhaustive: bool = False,
) -> list[Plan]:
    """The best layouts of one training step, fastest first.

    Args:
      model: The model's `sharding.modeldesc.ModelDescription` (or an object with ``describe()``).
      inventory: A `sharding.devices.Inventory` (hosts of equal size).
      global_batch: B, sequences per step.
      seq_len: T, tokens per sequence.
      options: The search space (`PlanOptions`).
      top: How many plans to return (the best of each mesh and rules, then the rest).
      _exhaustive: Price every pipeline variant (for tests that hold the pruned search to it).

    The layouts without stages are priced first, then the pipelines, lowest floor first
    (`sharding.planner.prune.pipeline_floor`); a pipeline variant whose floor is above the slowest of the
    ``top`` answers so far (`sharding.planner.prune.Cutoff`) is skipped, which changes no plan returned (the
    module's proof; the plans are kept in the search space's order, so ties fall as without the prune).

    Returns:
      Plans that fit memory, fastest first, then (where fewer than ``top`` fit) those that do not, least
      over memory first (`over_memory`), with ``fits=False``; at most ``top``.

    Raises:
      ValueError: On hosts of unequal size or unknown device figures (naming the field ``cluster``), or
        ``top`` < 1.
    """
    if top < 1:
        raise ValueError(f"top must be at least 1 (got {top}), e.g. top=8")
    ev = _Evaluator(model, inventory, global_batch, seq_len, options or PlanOptions())
    candidates = list(_candidates(ev))
    cutoff = None if _exhaustive else Cutoff(top, _group)
    priced: list[Plan | None] = [None] * len(candidates)
    for i in range(len(candidates)) if cutoff is None else _search_order(ev, candidates):
        priced[i] = _price(ev, *candidates[i], cutoff)
        if cutoff is not None:
            cutoff.offer(priced[i])
    # in the search space's order: plans of different skeletons never share a key (their mesh, rules, attention,
    # microbatches, repeats, stages, counts or shares differ), and equal step times sort as they were found
    found: dict[tuple, Plan] = {p.key(): p for p in priced if p is not None}
    fitting = sorted((p for p in found.values() if p.fits), key=lambda p: p.step_time)
    closest = sorted((p for p in found.values() if not p.fits), key=lambda p: (over_memory(p), p.step_time))
    return (_diverse(fitting, top) + _diverse(closest, top))[:top]


def _search_order(ev: _Evaluator, candidates: Sequence[tuple[cm.Layout, str]]) -> list[int]:
    """The order `plan` prices ``candidates`` in (indices): the layouts without stages as they come (cheap, and
    they set a cutoff), then the pipelines by the floor of their first variant (`pipeline_floor`), lowest first,
    so that fast plans lower the cutoff early."""
    flat = [i for i, (_, tag) in enumerate(candidates) if tag != "pipeline"]
    first = ev.options.remats[0]
    floors = [
        (pipeline_floor(ev, dataclasses.replace(layout, remat=first)), i)
        for i, (layout, tag) in enumerate(candidates)
        if tag == "pipeline"
    ]
    return flat + [i for _, i in sorted(floors)]


def _group(p: Plan) -> tuple:
    """What `_diverse` shows one plan of first: its mesh, rules (a preset and its sequence-parallel variant,
    ``tp`` and ``tp_sp``, count as one), uneven counts or not, uneven shares or not."""
    return (
        format_mesh(p.layout.mesh),
        p.layout.rules_name.removesuffix("_sp"),
        p.counts is not None,
        p.layout.context_shares is not None,
    )


def _diverse(plans: list[Plan], top: int) -> list[Plan]:
    """The best plan of each group (`_group`) first, then the rest."""
    seen, first, rest = set(), [], []
    for p in plans:
        key = _group(p)
        (rest if key in seen else first).append(p)
        seen.add(key)
    return (first + rest)[:top]


def uniform_baseline(
    model: Any,
    inventory,
    global_batch: int,
    seq_len: int,
    options: PlanOptions | None = None,
    optimizer_sharding: str | None = None,
) -> Plan | None:
    """The best plan where every device does the same work (no uneven shares, even stages): the plan a user
    would otherwise run, against which the planner reports its gain.

    Each layout is priced under every remat policy and both optimizer-state layouts (replicated, and split over
    ``data`` where ``data`` > 1: `sharding.zero`, which every equal-work step runs), as `_price` tries them, so
    the baseline is not a plan slower than one the user could pick. ``optimizer_sharding`` pins one of them:
    the baseline at the uneven step's own state layout (replicated: it lays its parameters out itself), for
    measuring what uneven work alone gains.

    Args:
      model, inventory, global_batch, seq_len, options: As `plan` takes them (``options.hetero`` is ignored).
      optimizer_sharding: ``replicated`` or ``data`` to price that layout only; None (the default): the faster.

    Returns:
      The fastest fitting plan, or None when none fits.

    Raises:
      ValueError: On an ``optimizer_sharding`` other than those.
    """
    if optimizer_sharding not in (None, REPLICATED, ax.DATA):
        raise ValueError(f"optimizer_sharding must be {REPLICATED!r}, {ax.DATA!r} or None (got {optimizer_sharding!r})")
    options = dataclasses.replace(options or PlanOptions(), hetero=False)
    ev = _Evaluator(model, inventory, global_batch, seq_len, options)

    def even(layout: cm.Layout, tag: str) -> cm.Layout:
        if tag != "pipeline":
            return layout
        stages, _ = plan_layout(ev.model.num_layers, layout.mesh[ax.STAGE])
        return dataclasses.replace(layout, stage_layers=stages.stage_layers)

    def states(layout: cm.Layout) -> list[str]:
        both = [REPLICATED] + ([ax.DATA] if layout.mesh[ax.DATA] > 1 else [])
        return [z for z in both if optimizer_sharding in (None, z)]

    return _best_fitting(
        ev.uniform(even(dataclasses.replace(layout, remat=remat, optimizer_sharding=z), tag))
        for layout, tag in _candidates(ev)
        for remat in options.remats
        for z in states(layout)
    )


def evaluate(
    model: Any,
    inventory,
    global_batch: int,
    seq_len: int,
    layout: cm.Layout,
    counts: Sequence[int] | None = None,
    options: PlanOptions | None = None,
) -> Plan | None:
    """Prices one given layout (and uneven counts), as the planner does.

    Args:
      model, inventory, global_batch, seq_len: As for `plan`.
      layout: The layout; with ``stage > 1`` and no ``stage_layers``, the layers split evenly
        (`sharding.pipeline.layout.plan_layout`: the first stages take the rest).
      counts: Microbatches per data-parallel device (uneven data parallelism), or per kind as a mapping of
        kind name to count (each data-parallel group gets its slowest device's kind's), or None.
      options: As for `plan` (its clock: efficiency, backend, 1F1B clock).

    Returns:
      The `Plan`, or None when the batch does not split over the layout.

    Raises:
      ValueError: As `plan`, or from `plan_layout` for fewer layers than stages; counts per kind that miss a
        kind of the mesh (naming the field ``hetero_batch``).
    """
    ev = _Evaluator(model, inventory, global_batch, seq_len, options or PlanOptions())
    if isinstance(counts, Mapping):
        kinds = [k.name for k in ev.batch_kinds(layout.mesh)]
        resolved, problem, example = counts_of_kinds(counts, kinds)
        if problem:
            raise ConfigError(Field("hetero_batch"), f": {problem}; e.g. ", Field("hetero_batch", example))
        counts = list(resolved)
    if layout.mesh[ax.STAGE] > 1 and layout.stage_layers is None:
        stages, _ = plan_layout(ev.model.num_layers, layout.mesh[ax.STAGE], layout.pipeline_repeats)
        layout = dataclasses.replace(layout, stage_layers=stages.stage_layers)
    if counts is None:
        return ev.uniform(layout)
    return ev.uneven(layout, counts, global_batch / sum(counts))


def brute_force(
    model: Any, inventory, global_batch: int, seq_len: int, options: PlanOptions | None = None, max_splits: int = 20000
) -> Plan | None:
    """The best fitting plan by exhaustive search (for tests) over the space `plan` searches: every mesh,
    rules, attention, microbatches and remat; for uneven data parallelism every split of the microbatches
    between the kinds (`_kind_counts`); for a pipeline, under GPipe and each 1F1B-family schedule, every
    stage split where the stages hold different kinds (else the even one, as the search) (compositions of the layers into ``stage`` parts of at least 1, when there are at most
    ``max_splits`` of them), and where that schedule's best split does not fit with the weights gathered
    once, every split with the per-microbatch gather. Splits are compared by their clock and fit
    (`_Evaluator.pipeline_seconds`, the figures `_Evaluator.uniform` gives), so only the best fitting split
    of each becomes a `Plan`."""
    ev = _Evaluator(model, inventory, global_batch, seq_len, options or PlanOptions())

    def best_split(layout: cm.Layout) -> tuple[cm.Layout | None, bool]:
        """The fastest fitting split of ``layout`` (the first of equals), and whether any split was priced."""
        best: tuple[float, cm.Layout] | None = None
        priced = False
        splits = _compositions(ev.model.num_layers, layout.mesh[ax.STAGE], max_splits)
        if len(set(ev.stage_kind_sets(layout.mesh))) == 1:  # every stage alike: the search keeps them even
            splits = [even_split(ev.model.num_layers, layout.mesh[ax.STAGE])]
        for split in splits:
            staged = dataclasses.replace(layout, stage_layers=split)
            clocked = ev.pipeline_seconds(staged)
            if clocked is None:
                continue
            priced = True
            if clocked[1] and (best is None or clocked[0] < best[0]):
                best = (clocked[0], staged)
        return (None if best is None else best[1]), priced

    def every(layout: cm.Layout, tag: str) -> Iterator[Plan | None]:
        if tag == "uniform":
            yield ev.uniform(layout)
        elif tag == "context":
            yield shares.context_shares(ev, layout)
        elif tag == "uneven":
            for counts in _kind_counts(ev, layout):
                yield ev.uneven(layout, counts, global_batch / sum(counts))
        else:
            for schedule in shares.pipeline_schedules(ev, layout):
                once, priced = best_split(dataclasses.replace(layout, pipeline_schedule=schedule))
                if once is None and priced:
                    once, _ = best_split(
                        dataclasses.replace(layout, pipeline_schedule=schedule, pipeline_gather="microbatch")
                    )
                if once is not None:
                    yield ev.uniform(once)

    return _best_fitting(
        plan_
        for layout, tag in _candidates(ev)
        for variant in _state_variants(layout, ev.options.remats, tag)
        for plan_ in every(variant, tag)
    )


def _kind_counts(ev: _Evaluator, layout: cm.Layout) -> Iterator[list[int]]:
    """Every split of the batch's microbatches between the kinds, each kind's spread over its data-parallel
    groups as evenly as they go (the first groups one more), as `sharding.planner.shares.uneven_counts` gives
    them: for counts that take no less time when they grow, every per-group split is no faster than one
    of these."""
    kinds = [k.name for k in ev.batch_kinds(layout.mesh)]
    names = list(dict.fromkeys(kinds))
    classes = [names.index(k) for k in kinds]
    total = layout.batch_split * layout.microbatches

    def rec(i, left):
        if i == len(names) - 1:
            yield [left]
            return
        for c in range(left + 1):
            for rest in rec(i + 1, left - c):
                yield [c] + rest

    for units in rec(0, total):
        yield spread(units, classes)


def _compositions(total: int, parts: int, limit: int) -> Iterator[tuple[int, ...]]:
    if math.comb(total - 1, parts - 1) > limit:
        return
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0,) + cuts + (total,)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def no_plan_reason(
    model: Any, inventory, global_batch: int, seq_len: int, options: PlanOptions | None = None
) -> FieldText:
    """Why `plan` returned no plan, in one line that names a value that works where one is knowable.

    Args:
      model, inventory, global_batch, seq_len, options: As for `plan`.

    Returns:
      The reason: the batch does not divide over the data-parallel devices (``data`` x ``fsdp``) of any
      mesh the search allows (naming the smallest larger ``global_batch`` that does), or a generic hint; its
      fields as `sharding.errors.FieldText` names them.

    Raises:
      ValueError: As `plan` (hosts of unequal size, unknown device figures).
    """
    options = options or PlanOptions()
    ev = _Evaluator(model, inventory, global_batch, seq_len, options)
    meshes = list(_meshes(ev.model, ev.cluster, options))
    splits = sorted({get_rules(r).batch_split(m) for m in meshes for r in options.rules})
    if splits and not any(True for _ in _candidates(ev)):
        for batch in range(
            global_batch + 1, global_batch + 2 * max(splits) * max(options.max_microbatches or 64, 1) + 1
        ):
            if any(True for _ in _candidates(_Evaluator(model, inventory, batch, seq_len, options))):
                shown = ", ".join(str(n) for n in splits)
                return FieldText(
                    Field("global_batch", global_batch),
                    f" does not divide over the data-parallel devices of any layout (data x fsdp is {shown} on "
                    "this cluster, with enough rows per device for each pipeline's microbatches); try ",
                    Field("global_batch", batch),
                )
    return FieldText(
        "no layout fits ",
        Field("global_batch", global_batch),
        " ",
        Field("seq_len", seq_len),
        "; try a smaller ",
        Field("global_batch"),
        " or ",
        Field("seq_len"),
    )
