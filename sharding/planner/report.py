"""Reports of the planner's results: the table of plans (`format_table`) and why each lost to the
best (`why_lost`).

Sizes in decimal gigabytes (1 GB = 1e9 bytes), times in seconds.
"""

from __future__ import annotations

import itertools
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
    that grew most against the best plan's."""
    if not p.fits:
        over = max(p.memory, key=lambda k: p.memory[k] / p.memory_limit[k])
        return f"does not fit: {_gb(p.memory[over])} GB on {over} > {_gb(p.memory_limit[over])} GB usable"
    if p is best:
        return "best"
    mine, theirs = _binding(p), _binding(best)
    name = max(mine, key=lambda k: mine[k] - theirs[k])
    heavier = _REMAT_COST[p.layout.remat] > _REMAT_COST[best.layout.remat]
    even = _even(p)
    if name == "busy" and p.parts["overlap_exposed"] - best.parts["overlap_exposed"] > (
        p.parts["compute"] - best.parts["compute"]
    ):
        reason = "weight gathers and gradient reductions outlast the compute that hides them"
    elif name == "busy" and even and not _even(best):
        reason = f"the same work on every device: {p.paced_by} paces the step"
    elif name == "busy" and heavier:
        reason = f"remat {p.layout.remat} recomputes the forward pass to fit memory"
    elif name == "busy":
        reason = f"{p.paced_by} gets more work than its speed warrants"
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
        if p.kind_counts is not None:
            split = "uneven " + ",".join(f"{k}={n}" for k, n in p.kind_counts)
        elif p.counts is not None:
            split = "uneven " + _compress(p.counts)
        elif lay.context_shares is not None:
            split = "context " + _compress([int(n) for n in lay.context_shares])
        elif lay.mesh[ax.STAGE] > 1:
            split = (
                "stages "
                + ",".join(map(str, lay.stage_layers))
                + (f" x{lay.pipeline_repeats}" if lay.pipeline_repeats > 1 else "")
            )
            split += f" {lay.pipeline_schedule}" if lay.pipeline_schedule.one_f_one_b else ""
            split += " gather/mb" if lay.pipeline_gather == "microbatch" else ""
            if p.stage_kinds is not None and len(set(p.stage_kinds)) > 1:
                split += " on " + stage_holders(p.stage_kinds)
        else:
            split = "even"
        rows.append(
            [
                str(i),
                format_mesh(lay.mesh),
                lay.rules_name,
                str(lay.microbatches),
                lay.remat,
                lay.attention,
                split,
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
