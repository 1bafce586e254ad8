"""Reports of the planner's results: the table of plans (`format_table`), each plan's split of the work
(`split_of`) and why each lost to the best (`why_lost`).

Sizes in decimal gigabytes (1 GB = 1e9 bytes), times in seconds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from sharding import axes as ax
from sharding.mesh import format_mesh
from sharding.planner.evaluator import Plan


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


_REMAT_COST = {"none": 0, "dots": 1, "full": 2}


def _binding(p: Plan) -> dict[str, float]:
    """The slowest device's time as it adds up: compute with the overlappable traffic no compute hides and
    what the hidden traffic slows it by (`sharding.costmodel.time.overlap`), then the exposed traffic, the
    optimizer and the pipeline bubble."""
    parts = p.parts
    return {
        "busy": parts["compute"] + parts["overlap_exposed"] + parts["contention"],
        "exposed_comm": parts["exposed_comm"],
        "optimizer": parts["optimizer"],
        "bubble": parts["bubble"],
    }


def exposed_traffic(mesh) -> str:
    """What carries a layout's traffic on the critical path, from its mesh: ``tensor`` (the all-reduces inside
    each layer), ``context`` (a split length's ring hops and all-to-all, over ``context`` and ``sequence``) and
    ``pipeline`` (stage sends), joined by ``/`` for those of size > 1."""
    groups = (((ax.TENSOR,), "tensor"), ((ax.CONTEXT, ax.SEQUENCE), "context"), ((ax.STAGE,), "pipeline"))
    names = [label for axes, label in groups if any(mesh.get(a, 1) > 1 for a in axes)]
    return "/".join(names) or "collective"


def _even(p: Plan) -> bool:
    """Whether every device of the plan does the same work (no uneven counts, stage split or sequence shares)."""
    return p.counts is None and p.layout.stage_layers is None and p.layout.context_shares is None


def why_lost(p: Plan, best: Plan) -> str:
    """A short reason a plan is slower than the best one: the term of the slowest device's time
    that grew most against the best plan's, in one clause (``+3%: REASON``)."""
    if not p.fits:
        over = max(p.memory, key=lambda k: p.memory[k] / p.memory_limit[k])
        return f"does not fit: {_gb(p.memory[over])} GB on {over} > {_gb(p.memory_limit[over])} GB usable"
    if p is best:
        return "best"
    mine, theirs = _binding(p), _binding(best)
    name = max(mine, key=lambda k: mine[k] - theirs[k])
    if name == "busy":
        reason = _busy_reason(p, best)
    else:
        reason = {
            "exposed_comm": f"{exposed_traffic(p.layout.mesh)} traffic on the critical path",
            "optimizer": "larger optimizer shard",
            "bubble": (
                f"{p.layout.pipeline_schedule} ticks and bubble {p.parts['bubble'] / p.step_time:.0%}"
                if p.layout.pipeline_schedule.one_f_one_b
                else f"pipeline bubble {p.parts['bubble'] / p.step_time:.0%}"
            ),
        }[name]
    return f"+{(p.step_time / best.step_time - 1):.0%}: {reason}"


def _busy_reason(p: Plan, best: Plan) -> str:
    """Why the slowest device's busy time (compute, the overlappable traffic compute does not hide, and the
    compute the hidden traffic slows) is longer than the best plan's, in one clause that names the plan's own
    split (`_named_split`) where it is the cause, or where it shares the work as the best's does and something
    else is the cause:

    - the same work on every device against a best plan with uneven work: the slow kind paces the step;
    - more compute under a heavier remat policy: the recomputed forward pass;
    - a split that gives the pacing kind more rows per device than the best's: more work than its speed
      warrants;
    - more overlappable traffic than compute hides: the weight gathers and gradient reductions outlast it;
    - more compute slowed by hidden traffic: the collective that grew most (a data axis's all-reduce);
    - more compute for the same work: the layout fields that differ (microbatches, rules, attention).
    """
    split, paced = _named_split(p), p.paced_by
    grew = {k: p.parts[k] - best.parts[k] for k in ("compute", "overlap_exposed", "contention")}
    largest = max(grew, key=grew.get)
    if _even(p) and not _even(best):
        return f"the same work on every device: {paced} paces the step"
    if largest == "compute" and _REMAT_COST[p.layout.remat] > _REMAT_COST[best.layout.remat]:
        return f"remat {p.layout.remat} recomputes the forward pass to fit memory"
    mine, theirs, kind = _rows_by_kind(p), _rows_by_kind(best), paced.split("/")[0]
    if mine is not None and theirs is not None and kind in mine and kind in theirs:
        more = mine[kind] > theirs[kind] * (1 + 1e-9)
        same = not more and all(abs(mine[k] - theirs.get(k, -1.0)) <= 1e-9 * mine[k] for k in mine)
    else:  # no rows by kind to compare (sequence shares, stages): the cell's text
        same = split == _named_split(best)
        more = not same and grew["compute"] > 1e-9 * best.parts["compute"]
    if more and split != "even":
        return f"{paced} gets more work than its speed warrants under {split}"
    as_best = f"{split} shares the work as #1 does, but " if same and split != "even" else ""
    if largest == "overlap_exposed":
        return f"{as_best}weight gathers and gradient reductions outlast the compute that hides them"
    if largest == "contention":
        grown = {c: t - best.comm.get(c, 0.0) for c, t in p.comm.items()}
        what = f"hidden {max(grown, key=grown.get)} traffic" if grown else "hidden traffic"
        return f"{as_best}{what} slows {paced}'s compute"
    lay, other = p.layout, best.layout
    fields = [
        f"M {lay.microbatches}" if lay.microbatches != other.microbatches else "",
        f"rules {lay.rules_name}" if lay.rules_name != other.rules_name else "",
        f"attention {lay.attention}" if lay.attention != other.attention else "",
    ]
    differs = ", ".join(f for f in fields if f)
    slower = f"{grew['compute'] / max(best.parts['compute'], 1e-12):.0%}"
    return f"{as_best}{paced}'s compute takes {slower} longer" + (f" with {differs}" if differs else "")


def _named_split(p: Plan) -> str:
    """The split as a reason names it: `split_of`'s cell, a pipeline's as its layers per stage only
    (``stages 8x8,2x8``)."""
    if p.kind_counts is None and p.counts is None and p.layout.context_shares is None and p.layout.mesh[ax.STAGE] > 1:
        return "stages " + _compress(p.layout.stage_layers)
    return split_of(p)


def _rows_by_kind(p: Plan) -> dict[str, float] | None:
    """Sequences each device of a kind computes per step under uneven counts by kind (its group's count x
    the microbatch rows, over the devices of a group); None for any other split."""
    if p.kind_counts is None:
        return None
    mesh = p.layout.mesh
    per_group = math.prod(mesh.values()) // (mesh.get(ax.DATA, 1) * mesh.get(ax.FSDP, 1))
    return {k: n * p.microbatch_rows / per_group for k, n in p.kind_counts}


def split_of(p: Plan) -> str:
    """The table's shares / stages cell: ``uneven h100_sxm=23,a100_80gb=9`` (counts by kind, else per
    data-parallel group), ``context 3x4,1x4`` (sequence shares), ``stages 24,8 x2 1f1b on h100_sxm 0,
    a100_80gb 1``, or ``even``."""
    lay = p.layout
    if p.kind_counts is not None:
        return "uneven " + ",".join(f"{k}={n}" for k, n in p.kind_counts)
    if p.counts is not None:
        return "uneven " + _compress(p.counts)
    if lay.context_shares is not None:
        return "context " + _compress([int(n) for n in lay.context_shares])
    if lay.mesh[ax.STAGE] > 1:
        split = (
            "stages "
            + ",".join(map(str, lay.stage_layers))
            + (f" x{lay.pipeline_repeats}" if lay.pipeline_repeats > 1 else "")
        )
        split += f" {lay.pipeline_schedule}" if lay.pipeline_schedule.one_f_one_b else ""
        split += " gather/mb" if lay.pipeline_gather == "microbatch" else ""
        if p.stage_kinds is not None and len(set(p.stage_kinds)) > 1:
            split += " on " + stage_holders(p.stage_kinds)
        return split
    return "even"


def format_table(plans: Sequence[Plan]) -> list[str]:
    """Rows: rank, mesh, rules, microbatches, remat, attention, shares/stages, step time, tokens/s,
    MFU, memory per kind, why it lost."""
    if not plans:
        return ["no layout found"]
    best = plans[0]
    kinds = list(dict.fromkeys(k for p in plans for k in p.memory))
    header = ["#", "mesh", "rules", "M", "remat", "attn", "shares / stages", "step s", "tokens/s", "MFU"]
    header += [f"GB {k}" for k in kinds] + ["why it lost"]
    rows = [header]
    for i, p in enumerate(plans, 1):
        lay = p.layout
        rows.append(
            [
                str(i),
                format_mesh(lay.mesh),
                lay.rules_name,
                str(lay.microbatches),
                lay.remat,
                lay.attention,
                split_of(p),
                f"{p.step_time:.3f}",
                f"{p.tokens_per_second:,.0f}",
                f"{p.mfu:.1%}",
            ]
            + [_gb(p.memory[k]) if k in p.memory else "-" for k in kinds]
            + [why_lost(p, best)]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return lines


def stage_holders(stage_kinds: Sequence[str]) -> str:
    """Which kind holds which stages: ``('h100_sxm', 'h100_sxm', 'a100_80gb')`` -> ``h100_sxm 0-1, a100_80gb 2``."""
    out, start = [], 0
    for i in range(1, len(stage_kinds) + 1):
        if i == len(stage_kinds) or stage_kinds[i] != stage_kinds[start]:
            out.append(f"{stage_kinds[start]} {start}" + (f"-{i - 1}" if i - 1 > start else ""))
            start = i
    return ", ".join(out)


def _compress(counts: Sequence[int]) -> str:
    """``3,3,3,3,1,1,1,1`` -> ``3x4,1x4``."""
    out = []
    for value, group in itertools.groupby(counts):
        n = len(list(group))
        out.append(f"{value}x{n}" if n > 1 else str(value))
    return ",".join(out)
