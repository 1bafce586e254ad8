"""The planner's pruned pipeline search (`sharding.planner.prune`) against the exhaustive one, and the floors it
prunes by against every plan and stage device the search prices.

No devices are needed: the planner prices layouts with the cost model.
"""

import collections
import dataclasses

import pytest
from test_planner import _described, _inventory

from sharding import axes as ax
from sharding import costmodel as cm
from sharding import planner
from sharding.planner import prune, search, shares
from sharding.planner.evaluator import _STAGE_KEY_FIELDS, _Evaluator

# A model whose 16 layers make a pipeline pay on a slow network (1 GB/s between single-device hosts), and memory
# tight enough that a heavier remat policy buys the winning pipeline.
MODEL = _described(32000, 16, 2048, 5632, 16, 16, 128)
OPTIONS = planner.PlanOptions(attentions=("flash",), max_microbatches=8, rules=("dp", "fsdp"))

CASES = {
    # 2 fast + 2 slow kinds, one per host: the stages hold different kinds, so the split is searched; the best
    # plan is a zero-bubble pipeline under --remat full with uneven stages
    "mixed kinds, pipeline with remat full wins": (_inventory(2, 2, 1, 2.0, fast_gb=18, slow_gb=12, network=1e9), 3),
    # one kind: every split even; the best plan is a pipeline under --remat full (--remat none does not fit)
    "one kind, pipeline with remat full wins": (_inventory(4, 0, 1, 1.0, fast_gb=12, network=1e9), 3),
    "one kind, top 1": (_inventory(4, 0, 1, 1.0, fast_gb=12, network=1e9), 1),
}


def _worst_first(order):
    """`search._search_order` with the pipelines in the opposite order: the fast ones last, where the cutoff
    (set by slower plans) is tested against their floors."""

    def reordered(ev, candidates):
        indices = order(ev, candidates)
        flat = [i for i in indices if candidates[i][1] != "pipeline"]
        return flat + [i for i in indices if candidates[i][1] == "pipeline"][::-1]

    return reordered


def _counting(monkeypatch):
    """The `prune.Cutoff` objects `plan` makes, to read how much it pruned."""
    made = []
    original = prune.Cutoff.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(prune.Cutoff, "__init__", init)
    return made


@pytest.mark.parametrize("case", sorted(CASES))
def test_pruned_search_returns_the_exhaustive_plans(case, monkeypatch):
    inventory, top = CASES[case]
    cutoffs = _counting(monkeypatch)
    exhaustive = planner.plan(MODEL, inventory, 16, 2048, OPTIONS, top=top, _exhaustive=True)
    pruned = planner.plan(MODEL, inventory, 16, 2048, OPTIONS, top=top)
    monkeypatch.setattr(search, "_search_order", _worst_first(search._search_order))
    late = planner.plan(MODEL, inventory, 16, 2048, OPTIONS, top=top)
    assert len(cutoffs) == 2 and min(c.pruned for c in cutoffs) > 0  # it pruned, else this compares nothing
    assert [p.key() for p in pruned] == [p.key() for p in exhaustive]
    assert [p.step_time for p in pruned] == [p.step_time for p in exhaustive]  # to the bit
    assert pruned == exhaustive and late == exhaustive  # every field of every plan, in either order
    if "remat full wins" in case:
        best = exhaustive[0].layout
        assert best.mesh[ax.STAGE] > 1 and best.remat == "full" and exhaustive[0].fits
    if "mixed" in case and "wins" in case:
        assert len(set(exhaustive[0].stage_layers)) > 1  # the split was searched, not kept even


def test_pruned_search_matches_on_the_eight_device_mixed_cluster(monkeypatch):
    """4 fast + 4 slow devices in hosts of 4, every schedule and remat policy: uneven data parallelism, uneven
    stages and plain layouts all among the 8 plans."""
    model = _described(32000, 12, 768, 2048, 12, 12, 64)
    options = planner.PlanOptions(attentions=("flash",), max_microbatches=4, rules=("dp", "fsdp"), max_stages=4)
    cutoffs = _counting(monkeypatch)
    inventory = _inventory(4, 4, 4, 2.0)
    exhaustive = planner.plan(model, inventory, 64, 1024, options, top=8, _exhaustive=True)
    pruned = planner.plan(model, inventory, 64, 1024, options, top=8)
    assert cutoffs[0].pruned > 0 and pruned == exhaustive
    assert {p.counts is not None for p in exhaustive} == {True, False}


def _pipeline_variants(ev):
    for layout, tag in search._candidates(ev):
        if tag == "pipeline":
            yield from search._state_variants(layout, ev.options.remats, tag)


FLOOR_CASES = {
    "mixed kinds, one per host": (MODEL, CASES["mixed kinds, pipeline with remat full wins"][0], 16, 2048, OPTIONS),
    "one kind, one per host": (MODEL, CASES["one kind, pipeline with remat full wins"][0], 16, 2048, OPTIONS),
    # hosts of 4: tensor parallelism (and sequence parallelism) inside the stages
    "mixed kinds, tensor inside stages": (
        _described(32000, 12, 768, 2048, 12, 12, 64),
        _inventory(4, 4, 4, 2.0),
        64,
        1024,
        planner.PlanOptions(attentions=("flash",), max_microbatches=4, rules=("tp", "tp_sp", "fsdp_tp_sp")),
    ),
}


@pytest.mark.parametrize("case", sorted(FLOOR_CASES))
def test_schedule_floors_are_below_every_pipeline_plan(case):
    """Every plan `shares.pipeline_plans` prices (every schedule, split, gather) takes at least its schedule's
    floor, and every stage device of every split the split search priced computes at least its layers times
    the per-layer floor and spends at least its layers times the per-layer collectives' floor on the critical
    path; the floors are not vacuous (the tightest above 30% of its plan)."""
    model, inventory, batch, seq, options = FLOOR_CASES[case]
    ev = _Evaluator(model, inventory, batch, seq, options)
    checked, tightest = 0, 0.0
    for lay in _pipeline_variants(ev):
        floors = prune.schedule_floors(ev, lay)
        for one in shares.pipeline_plans(ev, lay):
            floor = floors[one.layout.pipeline_schedule]
            assert one.step_time >= floor, (one.key(), one.step_time, floor)
            tightest = max(tightest, floor / one.step_time)
            checked += 1
    assert checked > 100 and tightest > 0.3
    # the stage devices themselves: compute at least n layers' floor, on each kind; critical-path collectives at
    # least n layers' and the fixed ones, which every device lists (its whole cost, moved rows included)
    stages = tensor = sends = stored = 0
    for key, (_, _, by_moved) in ev._stage_bases.items():
        items, fields, rows, layers, slots = key[0], key[1:-3], key[-3], key[-2], key[-1]
        layout = cm.Layout(dict(items), **dict(zip(_STAGE_KEY_FIELDS, fields)))
        flops, gemms, comms = cm.stage_floor(model, layout, seq_len=seq, rows=rows)
        fixed = cm.stage_fixed_comms(model, layout, seq_len=seq, rows=rows)
        base = cm.stage_cost_base(model, layout, seq_len=seq, rows=rows, layers=layers, slots=slots)
        links, shares_ = ev.links(layout.mesh), ev.shares(layout.mesh)
        for moved, (_, times) in by_moved.items():
            listed = collections.Counter(map(_signature, base.with_moved(moved).comms))
            assert not collections.Counter(map(_signature, fixed)) - listed, key  # each one the device lists
            for kind_name, st in times.items():
                hw = ev.hardware[kind_name]
                compute = cm.compute_floor(flops, gemms, hw)
                exposed = cm.comm_totals(comms, hw, links, shares_).exposed
                edges = cm.comm_totals(fixed, hw, links, shares_).exposed
                assert st.compute >= layers * compute * (1 - prune.SLACK), (key, kind_name)
                assert st.exposed_comm >= (layers * exposed + edges) * (1 - prune.SLACK), (key, kind_name)
                assert st.total - st.optimizer >= st.compute + st.exposed_comm
                tensor += bool(comms)
                stages += 1
        sends += any(ax.STAGE in c.axes for c in fixed)
        stored += any(ax.STAGE not in c.axes for c in fixed)
    assert stages > 100 and (tensor > 10) == ("tensor" in case)  # the collectives' floor is checked too
    assert sends > 10 and stored > 10  # and both kinds of fixed collectives


def _signature(c: cm.Comm) -> tuple:
    """What prices a collective (`cm.comm_totals`): its kind, axes, group, bytes, count and whether it overlaps."""
    return (c.kind, c.axes, c.group, c.result_bytes, c.count, c.overlappable, c.layer_loop)


def test_stage_fixed_comms_take_the_gather_and_optimizer_state_into_account():
    """The fixed collectives follow the weight gather (the stored rows: ``ceil(L / S)`` of them with the
    per-microbatch gather, ``ceil(L / (S G))`` gathering once) and are kept under the distributed optimizer (as
    `sharding.costmodel.zero.replaced_all_reduce` keeps them); none on ``cpu``; a layout without stages is
    refused."""
    model = _described(32000, 12, 768, 2048, 12, 12, 64)  # 12 layers: ceil(12 / 8) = 2 rows over fsdp=4, or 6
    layout = cm.Layout({ax.DATA: 2, ax.STAGE: 2, ax.FSDP: 4}, "fsdp", 4, "none", dtype="bfloat16")
    kwargs = dict(seq_len=1024, rows=1.0)

    def stored(lay):
        return [c for c in cm.stage_fixed_comms(model, lay, **kwargs) if ax.STAGE not in c.axes]

    once, streamed = stored(layout), stored(dataclasses.replace(layout, pipeline_gather="microbatch"))
    assert once and len(once) == len(streamed)
    assert {c.axes for c in once} == {(ax.DATA,)} and all(not c.overlappable for c in once)
    assert [4 * c.result_bytes for c in streamed] == [3 * c.result_bytes for c in once]  # 6 rows, 2 rows of 4
    # the distributed optimizer's reduce-scatter replaces other gradients' all-reduce over data, not these
    assert stored(dataclasses.replace(layout, optimizer_sharding=ax.DATA)) == once
    assert cm.stage_fixed_comms(model, layout, backend="cpu", **kwargs) == ()
    with pytest.raises(ValueError, match="stage=1"):
        cm.stage_fixed_comms(model, dataclasses.replace(layout, mesh={ax.DATA: 4, ax.FSDP: 4}), **kwargs)


def test_a_floor_above_the_plans_would_change_the_answer(monkeypatch):
    """The comparison above can fail: floors ten times too high (above the plans: the tightest floor is under
    half its plan here) prune plans the answer holds."""
    inventory, top = CASES["one kind, pipeline with remat full wins"]
    exhaustive = planner.plan(MODEL, inventory, 16, 2048, OPTIONS, top=top, _exhaustive=True)
    floors = prune.schedule_floors
    monkeypatch.setattr(search, "schedule_floors", lambda ev, lay: {s: 10 * f for s, f in floors(ev, lay).items()})
    assert planner.plan(MODEL, inventory, 16, 2048, OPTIONS, top=top) != exhaustive


def test_cutoff_is_the_top_th_group_best():
    seen = []

    def plan(group, seconds, fits=True):
        return dataclasses.make_dataclass("P", ["fits", "step_time", "group"])(fits, seconds, group)

    cutoff = prune.Cutoff(2, lambda p: p.group)
    for p in (plan("a", 3.0), plan("a", 1.0), plan("b", 5.0, fits=False)):
        cutoff.offer(p)
        seen.append(cutoff.seconds)
    cutoff.offer(plan("b", 2.0))
    seen.append(cutoff.seconds)
    cutoff.offer(plan("c", 1.5))
    seen.append(cutoff.seconds)
    assert seen == [float("inf")] * 3 + [2.0, 1.5]
    assert not cutoff.prunes(1.5) and cutoff.prunes(1.6) and cutoff.pruned == 1
