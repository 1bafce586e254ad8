"""Pruning the planner's pipeline search without changing its answer: a lower bound on a pipeline's step time
(`pipeline_floor`) against the slowest of the ``top`` plans `sharding.planner.search.plan` would return so far
(`Cutoff`).

Why the answer cannot change. `plan` returns, of the fitting plans, the fastest of each group (mesh, rules,
uneven counts or not, uneven shares or not: `sharding.planner.search._group`) first, fastest first, then the
rest, ``top`` in all, and plans that do not fit only where fewer than ``top`` fit. Say ``top`` groups each
already hold a fitting plan no slower than ``c`` seconds (`Cutoff.seconds`). Then a plan slower than ``c``
(fitting or not) takes no place in the answer and moves no other plan out of it: every group whose best is
slower than ``c`` comes after those ``top`` groups, and a plan slower than ``c`` is never its own group's best
where that group has one no slower. Adding, dropping or replacing such plans leaves the answer as it was, to
the bit. A pipeline layout under one remat policy and optimizer-state layout (one call of
`sharding.planner.shares.pipeline_plans`: every schedule, split and gather) is skipped when its floor under every
schedule exceeds ``c``, and so is each schedule of it whose floor does where no other schedule's split starts from
that one's (`shares.pipeline_plans`): every plan they could give is slower than ``c``. ``c`` only falls as plans are found, and a layout's plans
stand for their group only while they are what the search keeps (`Cutoff.offer`), so a plan the prune changed is
never one that sets ``c``.

Why the floors (`schedule_floors`) are below every such plan's step time. A pipeline's step (`_Evaluator._pipeline_clock`) is
its busy time plus the largest optimizer time; the busy time is at least the busiest stage device's own work
(GPipe divides it by one less the bubble; the fused 1F1B clock multiplies it by more than one; the lockstep tick
clock sums each tick's busiest stage, at least one stage's ``R M`` chunk passes, whose op shares sum to one);
a device's time is its compute, its critical-path collectives and non-negative further terms
(`cm.step_time_from`); its compute is at least ``n`` times `cm.compute_floor` of `cm.stage_floor`'s per-layer
work for its ``n`` layers, on its kind, and its critical-path collectives (a sum of non-negative seconds, one per
collective its cost lists, `cm.comm_totals`) at least those of two disjoint parts of that list: ``n`` times
`cm.stage_floor`'s per-layer tensor- and sequence-parallel ones, and the ones every stage device of the layout
lists whatever the split, its own layers and the largest stage's (`cm.stage_fixed_comms`: the sends between
stages under the schedule, and each layer parameter's stored rows' gradient all-reduce over the batch axes that
store no rows, after the loop, which the distributed optimizer's reduce-scatter replaces only where
`sharding.costmodel.zero.replaced_all_reduce` says), of which the floor takes the least over the weight
gathers, either of which a plan may use. So a device of kind ``k`` with ``n`` layers is busy at least
``n a_k + b_k``, the step at least the busiest stage's ``max_k (n_s a_k + b_k)`` over its kinds, and over every
split at least the least such maximum (`sharding.splits.min_max_assign`, exact for stage costs that grow with
the layers: it takes the ``L`` smallest of the stages' increments). Where every stage holds the same kinds the
split is the even one, and each schedule's clock of those stage floors is a floor too (it grows with every
stage's busy time, `_Evaluator.pipeline_busy`). `SLACK` covers the rounding between these sums. Tests hold each
figure against the priced ones, each stage device's collectives against `cm.stage_fixed_comms`, and the pruned
search against the exhaustive one.

Imports nothing of the project outside `sharding`, never the model.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Hashable

from sharding import axes as ax
from sharding import costmodel as cm
from sharding.pipeline.layout import GATHERS, Schedule
from sharding.planner import shares
from sharding.planner.evaluator import Plan, _Evaluator
from sharding.splits import even_split, min_max_assign

#: Relative margin under the floor: the step time and the floor are sums of the same positive terms in
#: different orders and groupings (each rounding within about 1e-16 of its sum).
SLACK = 1e-9


def schedule_floors(ev: _Evaluator, layout: cm.Layout) -> dict[Schedule, float]:
    """Lower bounds, in seconds, on the step time of every plan of ``layout`` (a pipeline skeleton with its remat
    policy and optimizer-state layout) under each schedule `shares.pipeline_plans` prices it under, whatever the
    weight gather and stage split (module docstring); a schedule the run refuses is left out.

    A device of kind ``k`` computing ``n`` layers takes at least ``n a_k + b_k`` seconds before its optimizer:
    ``a_k`` its `cm.compute_floor` per layer and its critical-path collectives per layer (`cm.stage_floor`),
    ``b_k`` its critical-path seconds of the collectives every stage device lists under the schedule, the least
    over the weight gathers (`fixed_seconds`). A stage takes the most of its kinds', and the clock grows with each
    stage's (`_Evaluator.pipeline_busy`). Where every stage holds the same kinds the split is the even one
    (`shares.stage_split`): the clock of those stage floors. Else the split is searched: the least over splits of
    the busiest stage's floor (`sharding.splits.min_max_assign`, exact for floors that grow with the layers),
    with GPipe's bubble and the fused clock's factor (both scale the busiest stage), without the lockstep clock's
    (it sums over ticks, which a split may balance differently).

    Args:
      ev: The evaluator.
      layout: A layout with ``stage`` > 1.

    Returns:
      Schedule -> seconds; empty where the batch does not split over the layout (`_Evaluator.uniform` prices
      nothing).
    """
    mesh, stages = layout.mesh, layout.mesh[ax.STAGE]
    per = layout.batch_split * layout.microbatches
    if ev.batch % per:
        return {}
    rows = ev.batch / per
    sets = ev.stage_kind_sets(mesh)
    per_layer = _per_layer(ev, layout, rows)
    names = [tuple(k.name for k in kinds) for kinds in sets]
    layers, same = ev.model.num_layers, shares.same_stages(ev, mesh)
    out = {}
    for schedule in shares.pipeline_schedules(ev, layout):
        try:
            table = cm.tick_table(schedule, stages, layout.microbatches, layout.pipeline_repeats)
        except ValueError:
            continue
        clocked = dataclasses.replace(layout, pipeline_schedule=schedule)
        fixed = fixed_seconds(ev, clocked, rows)

        def floor(i: int, n: int, fixed=fixed) -> float:  # stage i's busiest device holding n layers
            return max(n * per_layer[k] + fixed[k] for k in names[i])

        if same:
            busiest = [floor(0, n) for n in even_split(layers, stages)]
        else:
            split = min_max_assign(layers, [0] * stages, floor)
            busiest = [max(floor(i, n) for i, n in enumerate(split))] * stages
        if schedule.one_f_one_b and ev.options.one_f_one_b_clock == "lockstep" and not same:
            out[schedule] = busiest[0]
        else:
            out[schedule] = ev.pipeline_busy(clocked, table, busiest)
    return {schedule: (1.0 - SLACK) * seconds for schedule, seconds in out.items()}


def _per_layer(ev: _Evaluator, layout: cm.Layout, rows: float) -> dict[str, float]:
    """Kind name -> ``a_k``: `cm.compute_floor` of `cm.stage_floor`'s per-layer work and the critical-path seconds
    of its per-layer collectives, on each kind of the mesh; memoised on ``ev`` (`cm.stage_floor` reads neither the
    schedule, the gather nor the optimizer state's layout)."""
    mesh = layout.mesh
    key = ("layer", tuple(mesh.items()), *(getattr(layout, f) for f in _LAYER_FIELDS), rows)
    out = ev.floor_memo.get(key)
    if out is None:
        flops, gemms, comms = cm.stage_floor(ev.model, layout, seq_len=ev.seq, rows=rows, backend=ev.options.backend)
        out = {}
        for kind in {k.name: k for kinds in ev.stage_kind_sets(mesh) for k in kinds}.values():
            hw, memo = ev.hardware[kind.name], ev.clock_memo(kind, mesh)
            exposed = cm.comm_totals(comms, hw, ev.links(mesh), ev.shares(mesh), ev.options.overlaps, memo).exposed
            out[kind.name] = cm.compute_floor(flops, gemms, hw, memo) + exposed
        ev.floor_memo[key] = out
    return out


def fixed_seconds(ev: _Evaluator, layout: cm.Layout, rows: float) -> dict[str, float]:
    """Kind name -> ``b_k``: the least, over the weight gathers (`sharding.pipeline.layout.GATHERS`), of the
    critical-path seconds (`cm.comm_totals`) of `cm.stage_fixed_comms` of ``layout`` under its schedule: what every
    stage device of that kind spends on the sends between stages and its stored rows' gradient sums, whatever
    the split; memoised on ``ev`` (`cm.stage_fixed_comms` does not read the remat policy)."""
    mesh = layout.mesh
    key = ("fixed", tuple(mesh.items()), *(getattr(layout, f) for f in _FIXED_FIELDS), rows)
    out = ev.floor_memo.get(key)
    if out is None:
        kinds = {k.name: k for kinds in ev.stage_kind_sets(mesh) for k in kinds}
        out = dict.fromkeys(kinds, math.inf)
        for gather in GATHERS:
            comms = cm.stage_fixed_comms(
                ev.model,
                dataclasses.replace(layout, pipeline_gather=gather),
                seq_len=ev.seq,
                rows=rows,
                backend=ev.options.backend,
            )
            for name, kind in kinds.items():
                hw, memo = ev.hardware[name], ev.clock_memo(kind, mesh)
                totals = cm.comm_totals(comms, hw, ev.links(mesh), ev.shares(mesh), ev.options.overlaps, memo)
                out[name] = min(out[name], totals.exposed)
        ev.floor_memo[key] = out
    return out


_FIELDS = tuple(f.name for f in dataclasses.fields(cm.Layout) if f.name not in ("mesh", "stage_layers"))
#: The `cm.Layout` fields `_per_layer` and `fixed_seconds` key their memos by, besides the mesh.
_LAYER_FIELDS = tuple(f for f in _FIELDS if f not in ("pipeline_schedule", "pipeline_gather", "optimizer_sharding"))
_FIXED_FIELDS = tuple(f for f in _FIELDS if f not in ("pipeline_gather", "remat"))


def pipeline_floor(ev: _Evaluator, layout: cm.Layout) -> float:
    """The least of ``layout``'s `schedule_floors` (``inf`` where it has none): no plan of it is faster."""
    return min(schedule_floors(ev, layout).values(), default=math.inf)


class Cutoff:
    """The step time under which `plan`'s answer is decided: the ``top``-th smallest of the best fitting step
    times of the groups seen so far (module docstring), ``inf`` until ``top`` groups hold a fitting plan.

    Args:
      top: How many plans `plan` returns.
      group: The group of a plan (`sharding.planner.search._group`).
    """

    def __init__(self, top: int, group: Callable[[Plan], Hashable]):
        self.top, self.group = top, group
        self.best: dict[Hashable, float] = {}
        self.seconds = math.inf
        self.pruned = (
            0  # pipeline variants and schedules skipped (tests read it: a prune that never prunes proves nothing)
        )

    def offer(self, plan: Plan | None) -> None:
        """Counts ``plan`` for its group: a plan the search keeps, or one no faster than what it keeps for the
        same group (a skeleton's variant: the skeleton keeps its fastest fitting one)."""
        if plan is None or not plan.fits:
            return
        key = self.group(plan)
        if plan.step_time < self.best.get(key, math.inf):
            self.best[key] = plan.step_time
            if len(self.best) >= self.top:
                self.seconds = heapq.nsmallest(self.top, self.best.values())[-1]

    def prunes(self, floor: float) -> bool:
        """Whether a pipeline variant or schedule whose plans all take more than ``floor`` seconds can be skipped
        (and counts it)."""
        if floor > self.seconds:
            self.pruned += 1
            return True
        return False
