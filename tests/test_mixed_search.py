"""The mixed-cluster search against brute force: the uneven splits start from the clock's priced speeds and
end at the cost model's optimum over the same space, whatever the clock's constants.

No devices are needed: every plan is priced by the cost model. Small models and clusters keep the brute
force within seconds.
"""

import dataclasses
import itertools
import random

import pytest

from models.config import ModelConfig, get_config
from models.spec import describe
from sharding import costmodel as cm
from sharding import devices, planner
from sharding.planner import search
from sharding.splits import min_max_classes

SMALL = describe(ModelConfig(32000, 8, 1024, 4096, 16, 16, 64))
OPTIONS = planner.PlanOptions(attentions=("flash",), remats=("none", "full"), max_microbatches=4, max_stages=4)

#: Small mixed clusters: a fast network (uneven data parallelism wins) and a slow one (pipelines across the
#: kinds win), two H100 and two A100 hosts of two, and one host of each kind.
CLUSTERS = ("h100:2x2,a100:2x2@400Gbps", "h100:2x2,a100:2x2@10Gbps", "h100:1,a100:1@10Gbps")


def _key(p):
    """Fitting first, then faster (how the search compares plans)."""
    return (not p.fits, p.step_time)


def test_min_max_classes_is_exact_for_any_nondecreasing_times():
    """Random nondecreasing step functions (plateaus, jumps, counts over a cap marked infinite), 1-3 classes of
    1-4 bins, every start: the slowest class's time equals the best over every split of the units."""
    rng = random.Random(0)
    for _ in range(400):
        groups = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        total = rng.randint(0, 20)
        tables = []
        for _k in groups:
            value, row = rng.random(), []
            for _n in range(total + 1):
                value += rng.choice([0.0, 0.0, rng.random(), 3 * rng.random()])
                row.append(value)
            cap = rng.choice([None, rng.randint(0, total)])
            tables.append([v if cap is None or n <= cap else float("inf") for n, v in enumerate(row)])

        def worst(split, tables=tables, groups=groups):
            return max(tables[k][-(-n // groups[k])] for k, n in enumerate(split))

        splits = [s for s in itertools.product(range(total + 1), repeat=len(groups)) if sum(s) == total]
        best = min(worst(s) for s in splits)
        for start in [None, *rng.sample(splits, min(3, len(splits)))]:
            got = min_max_classes(total, groups, lambda k, n, tables=tables: tables[k][n], start)
            assert sum(got) == total and worst(got) == best, (groups, total, start, got)


@pytest.mark.parametrize("cluster", CLUSTERS[:1] + CLUSTERS[2:])
def test_each_uneven_layout_takes_the_best_split_of_its_microbatches(cluster):
    """For every uneven layout the search prices (mesh, rules, microbatches, remat), its counts are priced
    exactly as the best of every split of the microbatches between the kinds; and each kind's time does not
    fall as it takes more microbatches (what the exact search relies on)."""
    inventory = devices.parse_cluster(cluster)
    ev = planner._Evaluator(SMALL, inventory, 64, 1024, OPTIONS)
    checked = 0
    for layout, tag in search._candidates(ev):
        if tag != "uneven":
            continue
        for remat in OPTIONS.remats[:1]:  # the remat policy changes each kind's line, not the search
            lay = dataclasses.replace(layout, remat=remat)
            total = lay.batch_split * lay.microbatches
            rows = 64 / total
            every = [ev.uneven(lay, counts, rows) for counts in search._kind_counts(ev, lay)]
            best = min(every, key=_key)
            got = planner.uneven_counts(ev, lay, total, rows)
            assert _key(got) == _key(best), (lay.mesh, lay.microbatches, remat, got.counts, best.counts)
            for kind in {k.name: k for k in ev.batch_kinds(lay.mesh)}.values():
                seconds = [
                    ev.time(
                        cm.device_cost(SMALL, lay, seq_len=1024, rows=rows, microbatches=n, batch_rows=64),
                        kind,
                        lay.mesh,
                    ).total
                    for n in range(0, total + 1, max(1, total // 8))
                ]
                assert seconds == sorted(seconds), (kind.name, lay.mesh, seconds)
            checked += 1
    assert checked >= 3


@pytest.mark.parametrize("cluster", CLUSTERS[1:])
def test_each_pipeline_layout_takes_the_best_stage_split(cluster):
    """For every pipeline layout whose stages hold different kinds (mesh, rules, microbatches, repeats) under every
    schedule, with the weights gathered once and per microbatch, the split it picks is priced exactly as
    the best of every split of the layers (where one fits memory)."""
    inventory = devices.parse_cluster(cluster)
    ev = planner._Evaluator(SMALL, inventory, 64, 1024, OPTIONS)
    checked = 0
    for layout, tag in search._candidates(ev):
        if tag != "pipeline" or len(set(ev.stage_kind_sets(layout.mesh))) == 1:  # alike stages stay even
            continue
        for remat, schedule, gather in itertools.product(OPTIONS.remats[:1], OPTIONS.schedules, ("once", "microbatch")):
            lay = dataclasses.replace(layout, remat=remat, pipeline_schedule=schedule, pipeline_gather=gather)
            every = [
                ev.uniform(dataclasses.replace(lay, stage_layers=split))
                for split in search._compositions(SMALL.num_layers, lay.mesh["stage"], 10**6)
            ]
            every = [p for p in every if p is not None]
            got = planner.stage_split(ev, lay)
            if not every:
                assert got is None
                continue
            best = min(every, key=_key)
            if not best.fits:  # no split fits: the plan is listed by how far over memory it is, not by time
                continue
            assert _key(got) == _key(best), (lay.mesh, lay.microbatches, remat, schedule, gather, got.stage_layers)
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("cluster", CLUSTERS[1:])
def test_the_plan_is_the_best_of_brute_force(cluster):
    """The search's best plan is priced exactly as brute force's best over the same space (every mesh,
    rules, microbatches, remat, schedule, split of the microbatches and split of the layers)."""
    inventory = devices.parse_cluster(cluster)
    options = dataclasses.replace(OPTIONS, max_microbatches=2)
    best = planner.brute_force(SMALL, inventory, 64, 1024, options)
    plans = planner.plan(SMALL, inventory, 64, 1024, options)
    assert best is not None and plans[0].fits
    assert plans[0].step_time == pytest.approx(best.step_time, rel=1e-12), (plans[0].key(), best.key())


def test_a_7b_step_on_h100_and_a100_hosts_splits_by_the_clocks_speeds():
    """32 H100 and 32 A100 (hosts of 8, 400 Gb/s), a 7B model, ``fsdp=64``, 16 microbatches a device: the
    counts the search gives are priced no slower than any one-count-per-kind split (the brute force over the
    flags ``--hetero-batch h100_sxm=N,a100_80gb=32-N`` accept), and the H100s take the share the clock's
    priced times give them, not their 3.2x datasheet peak."""
    model = describe(get_config("7b"))
    inventory = devices.parse_cluster("h100:8x4,a100:8x4@400Gbps")
    ev = planner._Evaluator(model, inventory, 1024, 4096, planner.PlanOptions())
    mesh = {"data": 1, "stage": 1, "fsdp": 64, "context": 1, "sequence": 1, "tensor": 1}
    layout = cm.Layout(mesh, "fsdp", 16, "dots", attention="flash", dtype="bfloat16", uneven_batch=True)
    got = planner.uneven_counts(ev, layout, 1024, 1.0)
    names = [k.name for k in ev.batch_kinds(layout.mesh)]
    every = [ev.uneven(layout, [n if name == "h100_sxm" else 32 - n for name in names], 1.0) for n in range(33)]
    assert got.fits and got.step_time == pytest.approx(min(p.step_time for p in every if p.fits), rel=1e-12)
    h100, a100 = dict(got.kind_counts)["h100_sxm"], dict(got.kind_counts)["a100_80gb"]
    slope = {}
    for kind in {k.name: k for k in ev.batch_kinds(layout.mesh)}.values():
        at = [
            ev.time(
                cm.device_cost(model, layout, seq_len=4096, rows=1.0, microbatches=n, batch_rows=1024),
                kind,
                layout.mesh,
            ).total
            for n in (16, 17)
        ]
        slope[kind.name] = at[1] - at[0]
    ratio = slope["a100_80gb"] / slope["h100_sxm"]  # the clock's H100/A100 speed on this step's microbatch
    assert abs(h100 / a100 - ratio) <= 0.2 * ratio, (h100, a100, ratio)


@pytest.mark.parametrize("gather", ["once", "microbatch"])
def test_a_stage_cost_priced_from_its_base_is_the_whole_cost_to_the_bit(gather):
    """The evaluator prices a stage's split-independent part once and adds the stored rows each split moves
    (`cm.stage_cost_base`, `cm.StageBase.with_moved`, the clock's sums carried on, `cm.comm_totals`): for every
    split of 8 layers over 4 stages (mixed kinds, both optimizer-state layouts on one mesh, GPipe and 1F1B), each
    stage's memory, FLOPs and time equal those of `cm.device_cost` priced from scratch, to the bit."""
    inventory = devices.parse_cluster("h100:2x2,a100:2x2@10Gbps")
    ev = planner._Evaluator(SMALL, inventory, 64, 1024, OPTIONS)
    checked = 0
    # on data=2 both optimizer-state layouts, alike but for it (a cache keyed without it served one for the other)
    layouts = (({"data": 2, "stage": 4}, "dp"), ({"stage": 4, "fsdp": 2}, "fsdp"))
    for schedule, (mesh, rules), sharding in itertools.product(("gpipe", "1f1b"), layouts, ("replicated", "data")):
        for split in search._compositions(8, 4, 1000):
            layout = cm.Layout(
                mesh,
                rules,
                4,
                stage_layers=split,
                attention="flash",
                dtype="bfloat16",
                pipeline_schedule=schedule,
                pipeline_gather=gather,
                optimizer_sharding=sharding,
            )
            rows = 64 / (layout.batch_split * layout.microbatches)
            for s, kinds in enumerate(ev.stage_kind_sets(layout.mesh)):
                for kind in kinds:
                    cost, time = ev.stage_cost(layout, kind, rows, split[s], max(split))
                    whole = cm.device_cost(
                        SMALL, layout, seq_len=1024, rows=rows, layers=split[s], slots=max(split), backend="gpu"
                    )
                    assert cost.memory == whole.memory and cost.flops == whole.flops
                    assert time == ev.time(whole, kind, layout.mesh), (split, s, kind.name)
                    checked += 1
    assert checked > 1600
