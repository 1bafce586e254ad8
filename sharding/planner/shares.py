"""Uneven work on a mixed cluster, from the clock: microbatches per data-parallel group, layers per pipeline
stage and real tokens per ring device.

Every split starts from the speeds the cost model prices for each kind doing that work (its seconds for the
step's local work at the even share, `sharding.planner.evaluator._Evaluator.time`), never from datasheet
peaks: the clock's ratio between two kinds (an H100 against an A100 on a 7B step) is whatever the clock
says, not the 3.2x of their dense bf16 peaks. Then each split is refined on exact prices:

* `uneven_counts`: the exact optimum over per-kind totals (`sharding.splits.min_max_classes`), relying
  only on each kind's priced time being nondecreasing in its microbatches (checked by a test on every
  layout it prices);
* `stage_split`: a local search over moves of 1 or 2 layers between any two stages (both directions) from
  the clock's min-max split, until no move improves; the pipeline's time is not a min-max of the stages
  (the lockstep tick clock sums the busiest stage of each tick, the working copy holds the largest stage),
  so this is a local optimum, checked against every split by brute force on small cases;
* `context_shares`: a one-parameter family between even shards and shards proportional to the clock's
  speeds, scanned and then halved around the best.

Imports nothing of the project outside `sharding`, never the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from sharding import axes as ax
from sharding import costmodel as cm
from sharding.balance import tokens_for_speeds
from sharding.pipeline.layout import Schedule, parse_schedule
from sharding.planner.evaluator import Plan, _Evaluator
from sharding.splits import even_split, largest_remainder, min_max_assign, min_max_classes, spread


def _affine(seconds_at, near: int) -> tuple[float, float]:
    """``(a, b)`` of ``seconds(n) ~ a + b n`` around ``n = near``, from ``near`` and ``near + 1``: the priced
    time of a kind's work and what one more unit adds (its speed on the clock)."""
    n = max(near, 1)
    at, after = seconds_at(n), seconds_at(n + 1)
    return at - (after - at) * n, after - at


def _line_start(total: int, groups: list[int], lines: list[tuple[float, float]]) -> list[int]:
    """Per-class totals where the fitted lines ``a_k + b_k n`` of every class meet (water filling: classes
    whose line lies above the level at 0 get nothing), rounded by largest remainder."""
    active = list(range(len(groups)))
    slope = [max(b, 1e-12) for _, b in lines]
    while True:
        level = (total + sum(groups[k] * lines[k][0] / slope[k] for k in active)) / sum(
            groups[k] / slope[k] for k in active
        )
        low = [k for k in active if lines[k][0] >= level]
        if not low or len(low) == len(active):
            break
        active = [k for k in active if k not in low]
    weights = [
        groups[k] * max((level - lines[k][0]) / slope[k], 0.0) if k in active else 0.0 for k in range(len(groups))
    ]
    if not any(w > 0 for w in weights):
        return list(largest_remainder(total, [float(g) for g in groups]))
    floor = min(w for w in weights if w > 0) * 1e-9  # largest_remainder wants positive weights
    return largest_remainder(total, [max(w, floor) for w in weights])


def uneven_counts(ev: _Evaluator, layout: cm.Layout, total: int, rows: float) -> Plan:
    """Microbatches per data-parallel group (uneven data parallelism), the cost model's optimum.

    Each kind's time for ``n`` microbatches per group is priced exactly (`_Evaluator.uneven_class`, `cm.device_cost` with
    ``microbatches=n`` on the kind's hardware; memoised per kind and count); a count whose memory does not fit
    the kind counts as infinitely slow. The start is where the kinds' priced lines (fitted at the even share,
    `_affine`) meet; `sharding.splits.min_max_classes` then finds the exact optimum over how many
    microbatches each kind takes (spread as evenly as they go over its groups, the first groups of a kind one
    more), relying on each kind's time not falling with more microbatches. Where no split fits memory, the
    fastest regardless of memory. One evaluation of the whole layout prices the answer (`_Evaluator.uneven`).

    Args:
      ev: The evaluator.
      layout: An ``uneven_batch`` layout.
      total: Microbatches per step over every group (``batch_split x microbatches``).
      rows: Sequences per microbatch.

    Returns:
      The priced `Plan`, counts per group along ``data`` x ``fsdp`` (data major).
    """
    kinds = ev.batch_kinds(layout.mesh)
    names = list(dict.fromkeys(k.name for k in kinds))
    by_name = {k.name: k for k in kinds}
    classes = [names.index(k.name) for k in kinds]
    groups = [classes.count(k) for k in range(len(names))]
    priced: dict[tuple[str, int], tuple[float, bool]] = {}

    def exact(k: int, n: int) -> tuple[float, bool]:
        key = (names[k], n)
        if key not in priced:
            kind = by_name[names[k]]
            _, cost, time = ev.uneven_class(layout, rows, kind, n)
            priced[key] = (time.total, cost.memory.total <= ev.limit[kind.name])
        return priced[key]

    near = max(total // len(kinds), 1)
    lines = [_affine(lambda n, k=k: exact(k, n)[0], near) for k in range(len(names))]
    start = _line_start(total, groups, lines)
    fitting = min_max_classes(total, groups, lambda k, n: exact(k, n)[0] if exact(k, n)[1] else float("inf"), start)
    if all(exact(k, -(-t // groups[k]))[1] for k, t in enumerate(fitting)):
        units = fitting
    else:
        units = min_max_classes(total, groups, lambda k, n: exact(k, n)[0], start)
    return ev.uneven(layout, spread(units, classes), rows)


def _better(candidate: Plan | None, best: Plan | None) -> bool:
    """Whether ``candidate`` beats ``best``: fitting first, then faster."""
    if candidate is None:
        return False
    return best is None or (candidate.fits, -candidate.step_time) > (best.fits, -best.step_time)


def same_stages(ev: _Evaluator, mesh) -> bool:
    """Whether every stage of ``mesh`` holds the same device kinds (`stage_split` then keeps the split even)."""
    return len({tuple(k.name for k in kinds) for kinds in ev.stage_kind_sets(mesh)}) == 1


#: Up to this many stages the split's local search moves layers between any two stages; past it only between
#: the first and last stage, the slowest and fastest by their lines and the largest and smallest (each move is
#: an exact price, a 1F1B tick table at thousands of devices takes 0.1 s, and the pairs grow as S^2).
FULL_NEIGHBOURHOOD = 4


def stage_split(ev: _Evaluator, layout: cm.Layout, start: tuple[int, ...] | None = None) -> Plan | None:
    """Layers per stage for ``layout``'s schedule and gather mode, or None where the run refuses them.

    Where every stage holds the same kinds, the even split (`sharding.pipeline.layout.plan_layout`'s, the first stages
    taking the rest). Else each set of stage kinds gets a line of its priced stage time (the stage's slowest
    kind, `_Evaluator.stage_cost`, at the even split's layers and one more: the clock's speed of that kind on
    that work); the min-max split on those lines (at least ``pipeline_repeats`` layers a stage), and the same
    with the largest stage capped one layer tighter at a time while that improves (every stage's working copy
    holds the largest stage), and ``start`` where given (another schedule's split), priced exactly, give the
    start; then moves of 1 or 2 layers from any stage to any other, the best first, while the exact predicted step
    (`_Evaluator.uniform`: bubble, tick table, working copy of the largest stage, memory) improves (fitting
    first, then faster). The pipeline's time is not a min-max of independent stages, so the result is a local
    optimum of that neighbourhood, which tests hold against every split on small cases.
    """
    mesh, stages, repeats = layout.mesh, layout.mesh[ax.STAGE], layout.pipeline_repeats
    layers = ev.model.num_layers
    try:
        cm.tick_table(layout.pipeline_schedule, stages, layout.microbatches, repeats)
    except ValueError:
        return None
    sets = [tuple(k.name for k in kinds) for kinds in ev.stage_kind_sets(mesh)]
    if same_stages(ev, mesh) or layers < repeats * stages:
        return ev.uniform(dataclasses.replace(layout, stage_layers=even_split(layers, stages)))
    by_name = {k.name: k for kinds in ev.stage_kind_sets(mesh) for k in kinds}
    rows = ev.batch / (layout.batch_split * layout.microbatches)
    lines = {}
    for names in dict.fromkeys(sets):

        def seconds(n, names=names):  # a stage is as fast as its slowest kind
            return max(ev.stage_cost(layout, by_name[name], rows, n, n)[1].total for name in names)

        lines[names] = _affine(seconds, layers // stages)
    priced: dict[tuple[int, ...], Plan | None] = {}

    def price(candidate: tuple[int, ...]) -> Plan | None:
        if candidate not in priced:
            priced[candidate] = ev.uniform(dataclasses.replace(layout, stage_layers=candidate))
        return priced[candidate]

    def on_lines(cap: int | None) -> tuple[int, ...] | None:
        split = min_max_assign(
            layers,
            [repeats] * stages,
            lambda i, n: (lines[sets[i]][0] + lines[sets[i]][1] * n, n),
            None if cap is None else [cap] * stages,
        )
        return None if split is None else tuple(split)

    # Every stage's working copy holds the largest stage's layers, which the lines do not see: the min-max
    # split on the lines is also tried with each smaller cap on the largest stage, down to the even split's.
    split = on_lines(None)
    best = price(split)
    for cap in range(max(split) - 1, -(-layers // stages) - 1, -1):
        capped = on_lines(cap)
        if capped is None or not _better(price(capped), best):
            break  # a tighter cap only moves more layers onto the slower stages
        split, best = capped, price(capped)
    if start is not None and _better(price(start), best):
        split, best = start, price(start)
    # and the even split: where the stages keep their layers' residuals (`sharding.pipeline.layout.keeps`) the
    # faster splits may all be over memory, and the moves below, faster first among those, never reach it
    even = tuple(even_split(layers, stages))
    if _better(price(even), best):
        split, best = even, price(even)
    while True:
        ends = range(stages)
        if stages > FULL_NEIGHBOURHOOD:
            line = [lines[sets[i]][0] + lines[sets[i]][1] * split[i] for i in range(stages)]
            picks = (
                0,
                stages - 1,
                *(f(range(stages), key=k) for f in (min, max) for k in (line.__getitem__, split.__getitem__)),
            )
            ends = sorted(set(picks))
        moves = []
        for i in ends:
            for j in ends:
                for n in (1, 2):
                    if i != j and split[i] - n >= repeats:
                        trial = list(split)
                        trial[i] -= n
                        trial[j] += n
                        moves.append(tuple(trial))
        chosen = None
        for trial in moves:
            candidate = price(trial)
            if _better(candidate, best if chosen is None else priced[chosen]):
                chosen = trial
        if chosen is None:
            return best
        split, best = chosen, priced[chosen]


def pipeline_schedules(ev: _Evaluator, layout: cm.Layout) -> list[Schedule]:
    """The schedules a pipeline skeleton is priced under, in order: its own (GPipe, circular with repeats), then
    each 1F1B-family one `PlanOptions.schedules` allows."""
    return list(
        dict.fromkeys(
            [layout.pipeline_schedule]
            + [s for s in map(parse_schedule, ev.options.schedules) if s.one_f_one_b and s != layout.pipeline_schedule]
        )
    )


def pipeline_plans(ev: _Evaluator, layout: cm.Layout, skip: Callable[[Schedule], bool] | None = None) -> list[Plan]:
    """A pipeline skeleton's plans: under each of its schedules (`pipeline_schedules`), each with its own stage
    split (`stage_split`, also tried from the first schedule's split); where a schedule's best
    split does not fit with the weights gathered once, also with the stage's weights gathered per microbatch
    (``pipeline_gather``: a gather per chunk pass, priced in `sharding.costmodel.pipeline`). Schedules the
    run refuses (zero bubble with repeats, interleaved 1F1B with M not a multiple of S) are left out, and so is a
    schedule ``skip`` names (a search's prune, `sharding.planner.prune`) where that changes no other schedule's
    plans: once a split to start from is set, or where every stage holds the same kinds (the split is even)."""
    same = same_stages(ev, layout.mesh)
    out, start = [], None
    for schedule in pipeline_schedules(ev, layout):
        if skip is not None and (start is not None or same) and skip(schedule):
            continue
        once = stage_split(ev, dataclasses.replace(layout, pipeline_schedule=schedule), start)
        if once is not None:
            out.append(once)
            start = start or once.stage_layers
        if once is None or not once.fits:
            streamed = stage_split(
                ev, dataclasses.replace(layout, pipeline_schedule=schedule, pipeline_gather="microbatch"), start
            )
            if streamed is not None:
                out.append(streamed)
    return out


#: Where uneven sequence shards are tried between even shards (0) and shares proportional to the ring
#: positions' speeds on the clock (1). Every device runs padded blocks of the largest share,
#: so the projections and the MLP grow on every device as the shares spread while only attention shrinks on
#: the slow ones: the best shares lie between the two, nearer proportional the more of the step attention is.
SHARE_STEPS = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)


def context_shares(ev: _Evaluator, layout: cm.Layout) -> Plan | None:
    """The fastest uneven sequence shards for ``layout`` (ring attention over device kinds of unequal speed),
    or None when none beats even shards. A ring position's speed is the inverse of its slowest kind's priced
    step on the even shards (the clock's time of that kind's work); position r gets real tokens in
    proportion to ``1 + t (speed_r / slowest - 1)`` (`sharding.balance.tokens_for_speeds`: whole zigzag
    chunk pairs) for each ``t`` of `SHARE_STEPS`, then ``t`` halfway to each neighbour of the best, three
    times; each priced exactly (`_Evaluator.uniform`). The search covers that family, not every token vector."""
    even = ev.uniform(layout)
    if even is None:
        return None
    mesh = layout.mesh
    ring_kinds = ev.ring_kinds(mesh, layout.rules_table().length_axes(mesh))
    seconds = {}
    for kind in {k.name: k for k in ring_kinds}.values():
        cost = cm.device_cost(ev.model, layout, seq_len=ev.seq, rows=even.microbatch_rows, backend=ev.options.backend)
        seconds[kind.name] = ev.time(cost, kind, mesh).total
    speeds = [1.0 / seconds[k.name] for k in ring_kinds]
    slowest = min(speeds)
    priced: dict[tuple[int, ...], Plan | None] = {}

    def at(t: float) -> Plan | None:
        tokens = tokens_for_speeds(ev.seq, [max(1 + t * (s / slowest - 1), 1e-3) for s in speeds])
        if len(set(tokens)) == 1:
            return None
        if tokens not in priced:
            priced[tokens] = ev.uniform(dataclasses.replace(layout, context_shares=tokens))
        return priced[tokens]

    best_t, best = None, None
    for t in SHARE_STEPS:
        if _better(at(t), best):
            best_t, best = t, at(t)
    step = SHARE_STEPS[1] - SHARE_STEPS[0]
    for _ in range(3):
        if best_t is None:
            break
        step /= 2
        for t in (best_t - step, min(best_t + step, 1.0)):
            if _better(at(t), best):
                best_t, best = t, at(t)
    if best is None or (even.fits and not best.fits) or best.step_time >= even.step_time:
        return None
    return best
