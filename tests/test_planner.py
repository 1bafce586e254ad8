"""The layout planner: optimality against brute force, gains on mixed clusters, memory, the CLI.

No devices are needed: the planner prices layouts with the cost model.
"""

import dataclasses

import pytest
from _cli_errors import raises_as_cli

from models.config import ModelConfig, get_config
from models.spec import describe
from sharding import axes as ax
from sharding import costmodel as cm
from sharding import devices, planner
from sharding import pipeline as pl
from sharding.splits import largest_remainder
from train.plan import main as plan_main
from train.plan import plan_flags
from train.setup import checks, cli
from train.setup.flagnames import render


def _described(*fields):
    """The description of a `ModelConfig` with these positional fields (vocab, layers, embed, mlp,
    heads, kv heads, head_dim)."""
    return describe(ModelConfig(*fields))


def _kind(name, tflops, memory_gb, intra_gb_s):
    return devices.DeviceKind(name, name, tflops * 1e12, memory_gb * 1e9, 2e12, intra_gb_s * 1e9, "test figures")


def _inventory(n_fast, n_slow, per_host, ratio, fast_gb=80, slow_gb=48, network=25e9):
    # the fast kind is `ratio` times faster in every figure the clock reads (its memory bandwidth too: elementwise
    # work is priced there), so that its devices are `ratio` times as fast
    fast = dataclasses.replace(_kind("fast", 100 * ratio, fast_gb, 300), memory_bandwidth=2e12 * ratio)
    slow = _kind("slow", 100, slow_gb, 32)
    hosts = [devices.Host(fast, per_host, f"f{i}") for i in range(n_fast // per_host)]
    hosts += [devices.Host(slow, per_host, f"s{i}") for i in range(n_slow // per_host)]
    return devices.Inventory(tuple(hosts), network)


# Brute force enumerates every mesh, rules preset, microbatch count, remat policy, per-kind count
# vector and stage split; these options keep it within seconds on 2 cores.
# 1F1B (priced where GPipe does not fit) is checked by its own test, not by brute force here.
# The rules without their sequence-parallel variants: those price the same layouts with other collectives
# (tests/test_sequence_parallel.py checks the planner tries them), and each preset doubles the brute force.
SMALL_OPTIONS = planner.PlanOptions(
    attentions=("flash",),
    remats=("none", "full"),
    max_microbatches=8,
    max_stages=4,
    schedules=("gpipe",),
    rules=("dp", "fsdp", "tp", "fsdp_tp"),
)

CASES = {
    "2 devices, 2 kinds, 32 layers": (
        _inventory(1, 1, 1, 2.0),
        _described(32000, 32, 2048, 5632, 16, 16, 128),
        64,
        2048,
    ),
    "4 devices, 2 kinds, 4 layers": (_inventory(2, 2, 2, 3.0), _described(32000, 4, 1024, 4096, 16, 8, 64), 64, 1024),
    "8 devices, 2 kinds, 12 layers": (
        _inventory(4, 4, 4, 1.5),
        _described(32000, 12, 2048, 8192, 16, 8, 128),
        128,
        2048,
    ),
    "8 devices, 2 kinds, 32 layers": (
        _inventory(4, 4, 4, 2.0),
        _described(32000, 32, 4096, 11008, 32, 32, 128),
        256,
        4096,
    ),
    "8 devices, 1 kind, 8 layers": (_inventory(8, 0, 4, 1.0), _described(32000, 8, 1024, 4096, 16, 16, 64), 64, 1024),
    # A slow network between hosts: pipelines with uneven stages win (checks the split search).
    "2 devices, 2 kinds, 32 layers, slow network": (
        _inventory(1, 1, 1, 2.0, network=1e9),
        _described(32000, 32, 2048, 5632, 16, 16, 128),
        16,
        2048,
    ),
    "4 devices, 2 kinds, 24 layers, slow network": (
        _inventory(2, 2, 2, 3.0, network=2e9),
        _described(32000, 24, 2048, 5632, 16, 16, 128),
        16,
        2048,
    ),
    "8 devices, 2 kinds, 32 layers, slow network": (
        _inventory(4, 4, 4, 2.0, network=2e9),
        _described(32000, 32, 2048, 5632, 16, 16, 128),
        32,
        2048,
    ),
    "8 devices, 2 kinds, 8 layers, 8 stages": (
        _inventory(4, 4, 2, 2.5, slow_gb=16),
        _described(32000, 8, 2048, 8192, 16, 16, 128),
        64,
        2048,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_planner_matches_brute_force_within_5_percent(case):
    """The planner's speed (under a second per case) is a benchmark figure (bench/RESULTS.md), not
    asserted here: a wall-clock bound failed CI on a loaded 2-core machine (1.24 s)."""
    inventory, model, batch, seq = CASES[case]
    options = (
        SMALL_OPTIONS
        if "8 stages" not in case
        else planner.PlanOptions(attentions=("flash",), remats=("none", "full"), max_microbatches=8)
    )
    if "8 devices, 2 kinds, 32 layers" in case:  # the brute force tries every split of M over the kinds
        options = dataclasses.replace(options, max_microbatches=4)
    plans = planner.plan(model, inventory, batch, seq, options)
    best = planner.brute_force(model, inventory, batch, seq, options)
    assert best is not None and plans and plans[0].fits
    assert plans[0].step_time <= 1.05 * best.step_time, (plans[0].key(), best.key())
    if "slow network" in case:  # a pipeline; its split even (16, 16) since under --remat none the stages keep their
        # layers' residuals and only the even split fits with the weights gathered once (the brute force agrees)
        assert plans[0].layout.mesh["stage"] > 1


@pytest.mark.parametrize("ratio", [1.5, 2.0, 3.0])
def test_uneven_plan_beats_uniform_split_by_90_percent_of_ideal(ratio):
    """4 fast + 4 slow devices: the ideal gain of uneven work over the uniform split is (r+1)/2, both with the
    optimizer state laid out alike. The uneven step keeps its state replicated (it lays its parameters out
    itself), so the uniform split here is the best equal-work plan at the chosen plan's state layout; the
    baseline the planner reports may split its state over ``data`` as well, which gains by gathering the
    parameters in bfloat16, not by evening out the work, so (r+1)/2 is not the ideal against it (at r = 2
    the uneven plan is 1.33x faster than that baseline:
    `test_the_baseline_is_the_best_equal_work_plan_under_either_optimizer_state`, ``bench/RESULTS.md``)."""
    inventory = _inventory(4, 4, 4, ratio)
    model = _described(32000, 12, 768, 2048, 12, 12, 64)  # the 125m preset's shape
    plans = planner.plan(model, inventory, 256, 1024)
    state = plans[0].layout.optimizer_sharding
    uniform = planner.uniform_baseline(model, inventory, 256, 1024, optimizer_sharding=state)
    gain = uniform.step_time / plans[0].step_time
    assert gain >= 0.9 * (ratio + 1) / 2, (gain, plans[0].key(), uniform.key())


def test_the_baseline_is_the_best_equal_work_plan_under_either_optimizer_state():
    """The "same work on every device" baseline is the fastest such plan with the optimizer state replicated or
    split over ``data`` (`sharding.zero`), as a user without uneven work would run it: on 4 fast + 4 slow devices
    (3x) the split state is the faster (its parameters gathered in bfloat16), so the baseline takes it;
    ``optimizer_sharding`` pins either layout's own best."""
    inventory = _inventory(4, 4, 4, 3.0)
    model = _described(32000, 12, 768, 2048, 12, 12, 64)
    options = planner.PlanOptions(pipeline=False, attentions=("flash",))
    base = planner.uniform_baseline(model, inventory, 256, 1024, options)
    pinned = {
        z: planner.uniform_baseline(model, inventory, 256, 1024, options, optimizer_sharding=z)
        for z in ("replicated", "data")
    }
    assert all(p.counts is None and p.layout.optimizer_sharding == z for z, p in pinned.items())
    assert pinned["data"].step_time < pinned["replicated"].step_time
    assert base.layout.optimizer_sharding == "data" and base.step_time == pinned["data"].step_time
    with pytest.raises(ValueError, match="optimizer_sharding must be"):
        planner.uniform_baseline(model, inventory, 256, 1024, options, optimizer_sharding="fsdp")


def test_uneven_shares_follow_speed():
    inventory = _inventory(4, 4, 4, 3.0)
    model = _described(32000, 12, 768, 2048, 12, 12, 64)
    options = planner.PlanOptions(pipeline=False, attentions=("flash",))
    best = planner.plan(model, inventory, 256, 1024, options)[0]
    assert best.counts is not None
    fast, slow = best.counts[:4], best.counts[4:]
    assert 2.5 <= sum(fast) / sum(slow) <= 3.5


def test_uneven_shares_only_on_meshes_the_uneven_step_runs():
    inventory = _inventory(4, 4, 4, 3.0)
    model = _described(32000, 12, 2048, 8192, 16, 16, 128)
    options = planner.PlanOptions(attentions=("flash",), sequence=True)
    for p in planner.plan(model, inventory, 64, 8192, options, top=30):
        if p.counts is not None:
            mesh = p.layout.mesh
            assert mesh["stage"] == 1 and mesh["sequence"] == 1
            assert len(p.counts) == mesh["data"] * mesh["fsdp"]  # one count per data-parallel group
            # parameters split over fsdp and tensor at once: exact, but priced wrong (planner._uneven_fits)
            assert not (mesh["tensor"] > 1 and mesh["fsdp"] > 1 and p.layout.rules_name in ("fsdp", "fsdp_tp"))
            assert mesh["tensor"] == 1 or p.layout.attention != "flash"  # train.setup.checks refuses a kernel there


def test_uneven_shares_with_tensor_inside_each_group_for_a_7b_model():
    """4 fast + 4 slow devices in hosts of 4, a 7B model: tensor parallelism inside each host and uneven
    counts per data-parallel group beat every layout without uneven shares, and the flags train accepts."""
    inventory = _inventory(4, 4, 4, 2.0)
    model = _described(32000, 32, 4096, 11008, 32, 32, 128)
    # no kernel inside the uneven step; one efficiency for all the work, so that the kinds differ by their peaks
    # (the clock from the shapes prices this step's compute near the matmul ceiling, where the slow host's PCIe
    # tensor traffic weighs more: the search, not the clock, is under test here)
    options = planner.PlanOptions(attentions=("reference",), pipeline=False, efficiency=0.5)
    best = planner.plan(model, inventory, 64, 2048, options)[0]
    mesh = best.layout.mesh
    assert best.counts is not None and mesh["tensor"] > 1 and best.fits
    assert len(best.counts) == mesh["data"] * mesh["fsdp"]
    assert sum(best.counts) == mesh["data"] * mesh["fsdp"] * best.layout.microbatches
    fast, slow = best.counts[: len(best.counts) // 2], best.counts[len(best.counts) // 2 :]
    assert min(fast) > max(slow)  # the fast host's groups run more microbatches
    uniform = planner.uniform_baseline(model, inventory, 64, 2048, options)
    assert best.step_time < 0.8 * uniform.step_time, (best.key(), uniform.key())
    run = cli.parse(
        [*plan_flags(best).split(), "--batch-size", "64", "--seq-len", "2048", "--model", "7b", "--dry-run"]
    )
    checks.check_batch(run)
    checks.check_strategy(run)
    flash = cli.parse(
        [*plan_flags(best).split(), "--batch-size", "64", "--seq-len", "2048", "--model", "7b", "--attention", "flash"]
    )
    with pytest.raises(ValueError, match="--attention flash runs its kernel under its own shard_map"):
        checks.check_strategy(flash)


def test_plans_that_exceed_memory_are_rejected():
    """A 7B model on 24 GB devices: nothing without sharding fits; the chosen plan fits its limit."""
    small = _kind("small", 100, 24, 300)
    inventory = devices.Inventory((devices.Host(small, 8, "h0"),), 25e9)
    model = _described(32000, 32, 4096, 11008, 32, 32, 128)
    plans = planner.plan(model, inventory, 64, 2048, planner.PlanOptions(attentions=("flash",)))
    assert plans[0].fits
    assert plans[0].memory["small"] <= planner.MEMORY_FRACTION * 24e9
    dp = planner.evaluate(model, inventory, 64, 2048, cm.Layout({"data": 8}, "dp", 8, "full", attention="flash"))
    assert not dp.fits  # 7B replicated with AdamW: 108 GB per device


def test_tensor_groups_stay_inside_a_host():
    inventory = _inventory(2, 2, 2, 2.0)  # hosts of 2 devices
    model = _described(32000, 8, 1024, 4096, 16, 16, 64)
    options = planner.PlanOptions(attentions=("flash",))
    ev = planner._Evaluator(model, inventory, 64, 1024, options)
    meshes = list(planner._meshes(model, ev.cluster, options))
    assert meshes and all(m[ax.TENSOR] <= 2 for m in meshes)
    assert any(m[ax.TENSOR] == 2 for m in meshes)


def test_a_mixture_of_experts_gets_expert_layouts_and_no_pipeline():
    """For a MoE the search adds ``expert`` = e taken from ``fsdp`` (e dividing the experts) and leaves out
    pipeline stages where a run refuses them (moe-test's first layer is dense); an expert layout is priced with its batch over
    data x fsdp x expert."""
    from sharding.planner import search

    inventory = _inventory(8, 0, 8, 1.0)
    model = describe(get_config("moe-test"))
    options = planner.PlanOptions(attentions=("flash",))
    ev = planner._Evaluator(model, inventory, 64, 256, options)
    meshes = list(planner._meshes(model, ev.cluster, options))
    assert all(m[ax.STAGE] == 1 for m in meshes)
    assert {"data": 1, "stage": 1, "fsdp": 2, "context": 1, "sequence": 1, "tensor": 1, "expert": 4} in meshes
    assert not any(m.get(ax.EXPERT, 1) in (3, 5, 6, 7) for m in meshes)  # 8 experts
    experts_only = {"data": 1, "stage": 1, "fsdp": 1, "context": 1, "sequence": 1, "tensor": 1, "expert": 8}
    assert "fsdp" in search._rules_for(model, experts_only, options)  # the weights' embed over expert
    plans = planner.plan(model, inventory, 64, 256, options)
    assert plans and any(p.layout.mesh[ax.EXPERT] > 1 for p in plans)


def test_a_mixture_of_experts_in_every_layer_gets_pipeline_layouts():
    """A dropless MoE whose every layer is one may run in pipeline stages (`train.setup.checks.check_experts`): the
    search tries stages (without ``expert``, which inside a stage splits storage only and prices alike: the
    cost model's figures of a stage mesh with and without it are equal); with a capacity it tries none."""
    inventory = _inventory(8, 0, 8, 1.0)
    options = planner.PlanOptions(attentions=("flash",))
    for capacity, staged in ((0.0, True), (1.25, False)):
        config = get_config("moe-test", ["first_dense_layers=0", f"capacity_factor={capacity}"])
        model = describe(config)
        meshes = list(planner._meshes(model, planner._Evaluator(model, inventory, 64, 256, options).cluster, options))
        stage = {"data": 1, "stage": 2, "fsdp": 4, "context": 1, "sequence": 1, "tensor": 1}
        assert (stage in meshes) == staged
        assert any(m[ax.STAGE] > 1 for m in meshes) == staged
        assert not any(m[ax.STAGE] > 1 and m.get(ax.EXPERT, 1) > 1 for m in meshes)
        assert {**stage, "stage": 1, "fsdp": 4, "expert": 2} in meshes
    layouts = [
        cm.Layout(m, "fsdp", 8, pipeline_schedule="1f1b")
        for m in ({"stage": 2, "fsdp": 4}, {"stage": 2, "fsdp": 2, "expert": 2})
    ]
    dropless = describe(get_config("moe-test", ["first_dense_layers=0"]))
    plain, expert = (cm.estimate(dropless, 64, 256, lay) for lay in layouts)
    assert plain.flops == expert.flops and plain.memory == expert.memory
    assert cm.collective_bytes(plain.comms) == cm.collective_bytes(expert.comms)


@pytest.mark.parametrize("mesh", [{"stage": 4}, {"stage": 2, "fsdp": 2}])
def test_stage_split_matches_the_best_of_all_splits(mesh):
    inventory = _inventory(2, 2, 1, 2.5, network=2e9)
    model = _described(32000, 16, 2048, 5632, 16, 16, 128)
    ev = planner._Evaluator(model, inventory, 16, 2048, planner.PlanOptions())
    layout = cm.Layout(
        mesh, "fsdp" if mesh.get("fsdp", 1) > 1 else "dp", 8, "none", attention="flash", dtype="bfloat16"
    )
    chosen = planner.stage_split(ev, layout)
    every = [
        ev.uniform(dataclasses.replace(layout, stage_layers=split))
        for split in planner._compositions(16, mesh["stage"], 10**6)
    ]
    best = min((p for p in every if p.fits), key=lambda p: p.step_time)
    assert chosen.fits and chosen.step_time <= 1.05 * best.step_time


def test_stage_split_is_proportional_to_speed():
    inventory = _inventory(1, 1, 1, 3.0)
    layout = cm.Layout({"stage": 2}, "dp", 8, "full", attention="flash", dtype="bfloat16")
    model = _described(32000, 32, 2048, 5632, 16, 16, 128)
    ev = planner._Evaluator(model, inventory, 64, 2048, planner.PlanOptions())
    plan_ = planner.stage_split(ev, layout)
    fast, slow = plan_.stage_layers
    assert fast + slow == 32 and 2.3 <= fast / slow <= 3.7


def test_flags_reproduce_the_plan_and_train_accepts_them():
    inventory = _inventory(4, 4, 4, 2.0)
    model = _described(32000, 12, 768, 2048, 12, 12, 64)
    best = planner.plan(model, inventory, 256, 1024, planner.PlanOptions(pipeline=False))[0]
    flags = plan_flags(best)
    assert f"--microbatches {best.layout.microbatches}" in flags and f"--remat {best.layout.remat}" in flags
    if best.counts is not None:  # printed per kind: every data-parallel group of a kind has one count
        given = dict(item.split("=") for item in flags.split("--hetero-batch ")[1].split()[0].split(","))
        ev = planner._Evaluator(model, inventory, 256, 1024, planner.PlanOptions(pipeline=False))
        counts = [int(given[k.name]) for k in ev.batch_kinds(best.layout.mesh)]
        assert tuple(counts) == best.counts
        assert sum(counts) == best.layout.batch_split * best.layout.microbatches
        run = cli.parse([*flags.split(), "--batch-size", "256", "--seq-len", "1024", "--model", "125m", "--dry-run"])
        checks.check_batch(run)
        checks.check_strategy(run)


def test_pipeline_plans_with_flash_attention_are_accepted_by_train():
    """The planner prices flash attention inside pipeline stages; train runs it there (no refusal)."""
    inventory = _inventory(1, 1, 1, 2.0, network=1e9)
    model = _described(32000, 12, 768, 2048, 12, 12, 64)
    plans = planner.plan(model, inventory, 16, 1024, planner.PlanOptions(attentions=("flash",)))
    staged = [p for p in plans if p.layout.mesh["stage"] > 1]
    assert staged, [p.key() for p in plans]
    flags = plan_flags(staged[0])
    assert "--attention flash" in flags and "--stage-layers" in flags
    run = cli.parse([*flags.split(), "--batch-size", "16", "--seq-len", "1024", "--model", "125m", "--dry-run"])
    checks.check_batch(run)
    checks.check_strategy(run)


def _clock(ops, shares, chunk):
    """``sum_t max_s`` of what stage ``s`` runs at tick ``t``: ``ops`` (forward, backward, weight) bool
    ``[ticks, S]``, each op priced at its share of the stage's ``chunk`` time (the tick-synchronous program)."""
    return sum(
        max(sum(share * c * bool(op[t, s]) for op, share in zip(ops, shares)) for s, c in enumerate(chunk))
        for t in range(ops[0].shape[0])
    )


def test_one_f_one_b_is_priced_for_its_memory_and_its_lockstep_ticks():
    """The planner's 1F1B (`PlanOptions.schedules`): at the same layout it keeps fewer stage inputs than GPipe
    (less memory) and takes the ``2 (M + S - 1)`` ticks of its table, each as long as the busiest stage's op
    in it (a backward: 3/4 of the stage's chunk forward and backward; a forward: 1/4), against GPipe's ``M + S
    - 1`` steps; its flags name the schedule and train accepts them."""
    model = _described(32000, 12, 768, 2048, 12, 12, 64)  # the 125m preset's shape
    ev = planner._Evaluator(model, _inventory(2, 2, 2, 2.0), 64, 1024, planner.PlanOptions())
    base = cm.Layout(
        {"stage": 2, "fsdp": 2}, "fsdp", 16, "none", stage_layers=(7, 5), attention="flash", dtype="bfloat16"
    )
    layout = dataclasses.replace(base, pipeline_schedule="1f1b")
    gpipe, one = ev.uniform(base), ev.uniform(layout)
    assert max(one.memory.values()) < max(gpipe.memory.values())
    times = [ev.stage_cost(layout, kind, 64 / 2 / 16, n, 7)[1] for kind, n in zip(ev.stage_kinds(layout.mesh), (7, 5))]
    chunk = [(st.total - st.optimizer) / 16 for st in times]  # each stage's chunk, forward and backward
    optimizer = max(st.optimizer for st in times)
    table = pl.one_f_one_b_ticks(2, 16)
    ops = (table.op == 1, table.op == 2)
    assert table.ticks == 2 * (16 + 2 - 1)
    assert one.step_time == pytest.approx(_clock(ops, (0.25, 0.75), chunk) + optimizer, rel=1e-9)
    assert one.step_time < table.ticks * 0.75 * max(chunk) + optimizer  # not every tick runs a backward
    assert one.step_time > gpipe.step_time
    assert planner.why_lost(one, gpipe).endswith(
        "1f1b ticks and bubble " + f"{one.parts['bubble'] / one.step_time:.0%}"
    )
    assert "pipeline bubble" in planner.why_lost(
        dataclasses.replace(gpipe, step_time=2 * gpipe.step_time, parts={**gpipe.parts, "bubble": 9e9}), gpipe
    )
    exposed = dataclasses.replace(gpipe, step_time=2 * gpipe.step_time, parts={**gpipe.parts, "exposed_comm": 9e9})
    assert planner.why_lost(exposed, gpipe).endswith(": pipeline traffic on the critical path")
    from sharding.planner.report import exposed_traffic

    assert exposed_traffic({"data": 2, "context": 2, "sequence": 1, "tensor": 2}) == "tensor/context"
    assert exposed_traffic({"sequence": 4, "stage": 2}) == "context/pipeline"
    flags = plan_flags(one)
    assert "--pipeline-schedule 1f1b" in flags
    run = cli.parse([*flags.split(), "--batch-size", "64", "--seq-len", "1024", "--model", "125m", "--dry-run"])
    checks.check_strategy(run)


def test_proportional_split_largest_remainder():
    assert largest_remainder(16, [3, 3, 3, 3, 1, 1, 1, 1]) == [3, 3, 3, 3, 1, 1, 1, 1]
    assert largest_remainder(10, [1, 1, 1]) == [4, 3, 3]
    assert largest_remainder(32, [3.17, 1], minimum=1) == [24, 8]
    with pytest.raises(ValueError):
        largest_remainder(2, [1, 1, 1], minimum=1)


def test_unequal_hosts_are_refused_with_the_flag():
    inventory = devices.parse_cluster("h100:8,a100:4")
    with raises_as_cli(ValueError, match="--cluster"):
        planner.plan(_described(32000, 8, 1024, 4096, 16, 16, 64), inventory, 64, 1024)


def test_cli_prints_table_and_flags(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    code = plan_main(
        [
            "--model",
            "1b",
            "--cluster",
            "h100:4,a100:4",
            "--batch",
            "64",
            "--seq-len",
            "2048",
            "--top",
            "4",
            "--plot",
            str(png),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "why it lost" in out and "chosen plan:" in out and "python -m train.train --model 1b" in out
    assert png.stat().st_size > 10_000


def test_cli_errors_name_the_flag(capsys):
    assert plan_main(["--model", "7b", "--cluster", "h999:8", "--batch", "8", "--seq-len", "64"]) == 2
    assert "h999" in capsys.readouterr().err
    assert plan_main(["--model", "7b", "--cluster", "h100:8", "--batch", "0", "--seq-len", "64"]) == 2
    assert "--batch" in capsys.readouterr().err


def test_every_kind_in_a_pipeline_stage_is_priced_whatever_the_host_order():
    """A stage spans ``data``; across hosts of two kinds (equal peak FLOP/s, different memory and memory
    bandwidth) each kind's memory is checked against its own limit and the stage runs at its slowest kind's
    pace, so the plan does not depend on which host is listed first."""
    small = devices.DeviceKind("small", "small", 100e12, 2e9, 4e12, 300e9, "test figures")
    large = devices.DeviceKind("large", "large", 100e12, 160e9, 0.5e12, 300e9, "test figures")
    model = _described(32000, 8, 1024, 4096, 16, 16, 64)
    layout = cm.Layout(
        {"data": 2, "stage": 2}, "dp", 2, "none", stage_layers=(4, 4), attention="flash", dtype="bfloat16"
    )

    def inventory(*kinds):
        return devices.Inventory(tuple(devices.Host(k, 2, f"h{i}") for i, k in enumerate(kinds)), 25e9)

    mixed = [
        planner._Evaluator(model, inventory(*kinds), 16, 512, planner.PlanOptions()).uniform(layout)
        for kinds in ((small, large), (large, small))
    ]
    alone = {
        k.name: planner._Evaluator(model, inventory(k, k), 16, 512, planner.PlanOptions()).uniform(layout)
        for k in (small, large)
    }
    assert alone["large"].fits and not alone["small"].fits
    assert alone["large"].step_time > alone["small"].step_time * 1.01  # the large kind's memory is slower
    for p in mixed:
        assert set(p.memory) == {"small", "large"}
        assert p.memory["small"] == pytest.approx(alone["small"].memory["small"], rel=1e-12)
        assert not p.fits  # the small kind's 2 GB holds no stage
        assert p.step_time == pytest.approx(alone["large"].step_time, rel=1e-12)
    found = [
        [
            (p.key(), p.step_time, p.fits, p.memory)
            for p in planner.plan(model, inventory(*kinds), 16, 512, top=8)
            if p.layout.mesh[ax.STAGE] > 1
        ]
        for kinds in ((small, large), (large, small))
    ]
    # the best pipeline of each order (top 8: with the choice of --remat searched inside stages, the pipelines rank
    # below 4 here); lower-ranked splits within 0.01% of each other may come in either order
    assert found[0] and found[0][0] == found[1][0]


def test_no_plan_names_a_batch_that_divides_and_exits_2(capsys):
    """Batch 3 divides over no mesh's data-parallel devices: the CLI says so, names --batch 4, exits 2."""
    model, inventory = _described(256, 4, 64, 128, 4, 4, 16), devices.parse_cluster("h100:4,a100:4")
    # Without pipelines: a stage=2,tensor=4 pipeline runs batch 3 as 3 microbatches (any divisor is searched).
    options = planner.PlanOptions(pipeline=False)
    assert planner.plan(model, inventory, 3, 64, options) == []
    assert render(planner.no_plan_reason(model, inventory, 3, 64, options)).endswith("try --batch 4")
    assert planner.plan(model, inventory, 4, 64, options)
    assert (
        plan_main(["--model", "test", "--cluster", "h100:4,a100:4", "--batch", "3", "--seq-len", "64", "--no-pipeline"])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "does not divide over the data-parallel devices" in err and err.endswith("try --batch 4")
    assert "\n" not in err
    assert (
        plan_main(["--model", "test", "--cluster", "h100:4,a100:4", "--batch", "8", "--seq-len", "64", "--top", "0"])
        == 2
    )
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: --top must be at least 1")


def test_the_search_reaches_microbatch_counts_that_are_not_powers_of_two():
    """Any divisor of a data-parallel device's rows is a microbatch count (Megatron's 144, 280 and 512 pipeline
    microbatches are not powers of two): batch 24 on 8 devices gives 3 rows per device on data=8 and 12 on
    data=2,stage=4."""
    model = _described(512, 4, 128, 384, 4, 2, 32)
    assert planner._microbatch_options(12, None) == [1, 2, 3, 4, 6, 12]
    assert planner._microbatch_options(12, None, at_least=4) == [4, 6, 12]
    assert planner._microbatch_options(12, 5) == [1, 2, 3, 4]
    plans = planner.plan(model, devices.parse_cluster("a100:4x2"), 24, 128, top=500)
    counts = {p.layout.microbatches for p in plans}
    assert {3, 6, 12} <= counts, sorted(counts)
    assert any(p.layout.mesh["stage"] > 1 and p.layout.microbatches in (6, 12) for p in plans)


def test_no_plan_fits_lists_the_closest_least_over_memory_first():
    """7B on 8 devices of 12 GB: nothing fits, the plans come least over memory first, each over."""
    tiny = _kind("tiny", 100, 12, 300)
    inventory = devices.Inventory(tuple(devices.Host(tiny, 4, f"h{i}") for i in range(2)), 25e9)
    model = _described(32000, 32, 4096, 11008, 32, 32, 128)
    plans = planner.plan(model, inventory, 64, 2048, SMALL_OPTIONS, top=6)
    assert plans and not any(p.fits for p in plans)
    over = [planner.over_memory(p) for p in plans]
    assert over == sorted(over) and over[0] > 1
    fitting = planner.plan(model, devices.parse_cluster("a100:4x2"), 64, 2048, SMALL_OPTIONS, top=6)
    assert fitting[0].fits and [p.step_time for p in fitting if p.fits] == sorted(
        p.step_time for p in fitting if p.fits
    )


def test_evaluate_splits_the_layers_evenly_when_no_split_is_given():
    model = _described(32000, 10, 1024, 4096, 16, 16, 64)
    inventory = devices.parse_cluster("a100:4x2")
    layout = cm.Layout({"data": 2, "stage": 4}, "dp", 8, "none", attention="flash", dtype="bfloat16")
    even = planner.evaluate(model, inventory, 64, 1024, layout)
    assert even.stage_layers == (3, 3, 2, 2)
    given = planner.evaluate(model, inventory, 64, 1024, dataclasses.replace(layout, stage_layers=(3, 3, 2, 2)))
    assert even.step_time == given.step_time and even.memory == given.memory


def test_one_f_one_b_priced_lockstep_or_as_megatron_runs_it():
    """meshwork's 1f1b runs in lockstep (its table's ``2 (M + S - 1)`` ticks, each as long as the busiest
    stage's op: a forward 1/4, a backward 3/4 of a chunk's time); the fused clock is Megatron-LM's ``1 + (S -
    1) / (R M)`` of the slowest stage's busy time."""
    model = _described(32000, 8, 1024, 4096, 16, 16, 64)
    inventory = devices.parse_cluster("a100:4x2")
    layout = cm.Layout(
        {"data": 2, "stage": 4},
        "dp",
        8,
        "none",
        stage_layers=(2, 2, 2, 2),
        attention="flash",
        dtype="bfloat16",
        pipeline_schedule="1f1b",
    )
    lockstep = planner.evaluate(model, inventory, 64, 1024, layout)
    fused = planner.evaluate(model, inventory, 64, 1024, layout, options=planner.PlanOptions(one_f_one_b_clock="fused"))
    parts = fused.parts
    busy = parts["compute"] + parts["overlap_exposed"] + parts["contention"] + parts["exposed_comm"]
    assert parts["compute"] >= parts["overlapped_comm"]  # the overlapped traffic hides under compute here
    assert fused.step_time == pytest.approx(busy * (1 + 3 / 8) + fused.parts["optimizer"], rel=1e-9)
    table = pl.one_f_one_b_ticks(4, 8)
    assert lockstep.step_time == pytest.approx(
        _clock((table.op == 1, table.op == 2), (0.25, 0.75), [busy / 8] * 4) + lockstep.parts["optimizer"], rel=1e-9
    )
    with pytest.raises(ValueError, match="one_f_one_b_clock"):
        planner.PlanOptions(one_f_one_b_clock="async")


def test_each_1f1b_schedule_is_priced_from_its_tick_table_and_the_fastest_fitting_wins():
    """At one 4-stage layout the three 1F1B-family schedules are priced from their tables (`_clock`): fused
    1F1B (``M + 2 (S - 1)`` ticks of a forward and a backward) beats lockstep; zero bubble's stage cost is fused
    1F1B's (its weight gradient reuses what the input gradient kept), its ticks price its forward, input
    gradient and weight gradient at 1/4, 1/2 and 1/4 of that chunk time, and the deferred weight gradients
    make it the fastest. The search prices every one beside each GPipe plan (`pipeline_plans`)."""

    model = _described(32000, 8, 1024, 4096, 16, 16, 64)
    inventory = devices.parse_cluster("a100:4x2")
    ev = planner._Evaluator(model, inventory, 64, 1024, planner.PlanOptions())
    base = cm.Layout(
        {"data": 2, "stage": 4}, "dp", 8, "none", stage_layers=(2, 2, 2, 2), attention="flash", dtype="bfloat16"
    )
    priced = {}
    for name, shares in (
        ("1f1b", (0.25, 0.75, 0.0)),
        ("1f1b-fused", (0.25, 0.75, 0.0)),
        ("zb", (0.25, 0.5, 0.25)),
    ):
        layout = dataclasses.replace(base, pipeline_schedule=name)
        plan = ev.uniform(layout)
        assert plan.layout.pipeline_schedule == name and f"--pipeline-schedule {name}" in plan_flags(plan)
        times = [ev.stage_cost(layout, kind, 64 / 2 / 8, 2, 2)[1] for kind in ev.stage_kinds(layout.mesh)]
        chunk = [(st.total - st.optimizer) / 8 for st in times]
        table = pl.PipelinePlan(pl.plan_layout(8, 4)[0], 8, schedule=name).tick_table()
        ops = pl.ticks.tick_ops(table)
        expected = _clock(ops, shares, chunk) + max(st.optimizer for st in times)
        assert plan.step_time == pytest.approx(expected, rel=1e-9), name
        priced[name] = plan
    assert priced["1f1b-fused"].step_time < priced["1f1b"].step_time
    # zero bubble's weight gradient reuses what its input gradient kept: fused 1F1B's compute, its W passes
    # deferred out of the ticks where the first stages' B passes form the critical path
    assert priced["zb"].parts["compute"] == pytest.approx(priced["1f1b-fused"].parts["compute"], rel=1e-9)
    assert priced["zb"].step_time < priced["1f1b-fused"].step_time
    family = planner.shares.pipeline_plans(ev, base)  # what the search prices: each schedule with its split
    by = {p.layout.pipeline_schedule: p for p in family if p.layout.pipeline_gather == "once"}
    assert [by[n].step_time for n in ("1f1b", "1f1b-fused", "zb")] == [
        priced[n].step_time for n in ("1f1b", "1f1b-fused", "zb")
    ]


def test_the_per_microbatch_gather_is_priced_under_gpipe_and_each_1f1b_schedule_where_gpipe_does_not_fit():
    """16 layers on ``stage=4,fsdp=2`` (4 per stage, blocks of G = 2): where GPipe does not fit, the search
    prices ``pipeline_gather`` ``microbatch`` under GPipe, 1F1B, fused 1F1B and zero bubble (`pipeline_plans`).
    Each holds less than its gather-once twin (one block, not the 4-slot working copy and its sums) and
    all-gathers more; zero bubble's weight-gradient pass reads no weight, so it all-gathers what fused 1F1B
    does, in both modes. A plan that fits adds none."""

    model = _described(32000, 16, 1024, 4096, 16, 16, 64)
    ev = planner._Evaluator(model, devices.parse_cluster("a100:4x2"), 64, 1024, planner.PlanOptions())
    base = cm.Layout(
        {"fsdp": 2, "stage": 4}, "fsdp", 8, "none", stage_layers=(4, 4, 4, 4), attention="flash", dtype="bfloat16"
    )
    names = ("gpipe", "1f1b", "1f1b-fused", "zb")
    searched = planner.shares.pipeline_plans(ev, base)
    once = {p.layout.pipeline_schedule: p for p in searched if p.layout.pipeline_gather == "once"}
    # the per-microbatch gather is searched exactly where gathering once does not fit
    assert {p.layout.pipeline_schedule for p in searched if p.layout.pipeline_gather == "microbatch"} == {
        n for n in names if not once[n].fits
    }
    streamed = [ev.uniform(dataclasses.replace(base, pipeline_schedule=n, pipeline_gather="microbatch")) for n in names]
    for p in streamed:
        twin = once[p.layout.pipeline_schedule]
        assert p.memory["a100_80gb"] < twin.memory["a100_80gb"], p.layout.pipeline_schedule
        assert p.comm["all-gather"] > twin.comm["all-gather"], p.layout.pipeline_schedule
    by = {p.layout.pipeline_schedule: p for p in streamed}
    assert once["zb"].comm["all-gather"] == once["1f1b-fused"].comm["all-gather"]
    assert by["zb"].comm["all-gather"] == by["1f1b-fused"].comm["all-gather"]


def test_a_kind_given_no_work_is_said_so_with_the_memory_it_holds(capsys):
    """32 H100 + 32 A10G (70 of the H100's 989 TFLOP/s), batch 128 x 2048, no pipeline, at one efficiency for
    both kinds (the clock before the fit): the best plan gives every A10G 0 microbatches; the report says so,
    with what they still hold. (With A100s beside the H100s the clock gives them a quarter of the work since
    traffic inside and across hosts hides behind the compute at once: not a kind left idle.)"""
    argv = [
        "--model",
        "7b",
        "--cluster",
        "h100:8x4,a10g:8x4",
        "--batch",
        "128",
        "--seq-len",
        "2048",
        "--no-pipeline",
        "--efficiency",
        "0.5",
        "--top",
        "4",
    ]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "warning: the a10g devices get no microbatches" in out and "21.6 GB each" in out
    assert "the best listed plan that gives every kind work is #" in out
    best = planner.plan(
        describe(get_config("7b")),
        devices.parse_cluster("h100:8x4,a10g:8x4"),
        128,
        2048,
        planner.PlanOptions(pipeline=False, efficiency=0.5),
        top=1,
    )[0]
    assert best.idle_kinds == ("a10g",) and set(best.counts[len(best.counts) // 2 :]) == {0}


def test_plans_round_trip_through_layout_of():
    """A plan's `Parallelism` (what --plan auto runs) gives back, through `cm.layout_of`, the layout it was priced as."""
    model = _described(32000, 12, 768, 2048, 12, 12, 64)
    plans = planner.plan(model, _inventory(4, 4, 4, 2.0), 256, 1024, planner.PlanOptions(), top=20)
    assert {p.counts is not None for p in plans} == {True, False} and any(p.layout.mesh[ax.STAGE] > 1 for p in plans)
    for p in plans:
        lay = p.layout
        back = cm.layout_of(p.parallelism(), remat=lay.remat, attention=lay.attention, dtype=lay.dtype)
        assert dataclasses.replace(back, rules=lay.rules) == lay
        assert dict(back.rules_table().table, layers=()) == dict(lay.rules_table().table, layers=())


def test_plan_auto_with_ring_attention_prices_it_as_flash():
    model = _described(32000, 12, 768, 2048, 12, 12, 64)
    inventory = _inventory(4, 4, 4, 2.0)
    ring = planner.plan(model, inventory, 256, 1024, planner.PlanOptions(attentions=("ring",), sequence=True))
    flash = planner.plan(model, inventory, 256, 1024, planner.PlanOptions(attentions=("flash",)))
    assert ring and all(p.layout.attention == "ring" and p.layout.mesh[ax.SEQUENCE] == 1 for p in ring)
    assert [p.step_time for p in ring] == [p.step_time for p in flash]


def test_a_long_sequence_takes_usp_across_hosts_and_a_ring_beats_an_all_to_all_across_them():
    """Llama-3-8B's heads (32 query, 8 KV) at 131,072 tokens on two hosts of eight H100s: the fastest plan
    splits the length with USP, its all-to-all (``sequence``, with ``tensor``) inside a host and its ring
    (``context``) across; on every split where all-to-all attention crosses the hosts, ring attention over the
    same number of devices is faster at its best (its hops overlap the blocks' compute; with too short
    blocks they outlast it)."""
    model = describe(get_config("7b", ["num_kv_heads=8"]))
    cluster = devices.parse_cluster("h100:8,h100:8")
    options = planner.PlanOptions(pipeline=False, sequence=True)
    plans = planner.plan(model, cluster, 1, 131072, options, top=40)
    best = plans[0].layout
    assert best.attention == "usp" and best.mesh[ax.CONTEXT] > 1
    assert best.mesh[ax.SEQUENCE] * best.mesh[ax.TENSOR] <= 8
    time = {(p.layout.attention, tuple(sorted(p.layout.mesh.items()))): p.step_time for p in plans}
    across = {
        kind: min(t for (attention, mesh), t in time.items() if attention == kind and dict(mesh)[ax.CONTEXT] > 1)
        for kind in ("ring", "ulysses")
    }
    assert across["ring"] < across["ulysses"] and plans[0].step_time < across["ring"]


def test_a_ring_over_mixed_kinds_takes_uneven_sequence_shares():
    """Ring attention over two hosts of one device each, one 3x faster, at 16,384 tokens on the test model
    (attention most of the step): the best plan gives the fast ring position more real tokens, at most in
    proportion to its speed (every device runs padded blocks of the largest share), and is faster than the
    same layout on even shards, which the slow device paces. Its command line carries ``--context-shares``,
    which train.train reads back to the same tokens and accepts."""
    from models.attention import check_context_parallel

    model = describe(get_config("test"))
    inventory = _inventory(1, 1, 1, 3.0)
    options = planner.PlanOptions(
        attentions=("ring",), sequence=True, pipeline=False, remats=("none",), max_microbatches=1
    )
    plans = planner.plan(model, inventory, 2, 16384, options, top=5)
    best = plans[0]
    tokens = best.layout.context_shares
    assert best.layout.mesh[ax.CONTEXT] == 2 and tokens is not None and sum(tokens) == 16384
    assert 1 < tokens[0] / tokens[1] <= 3, tokens  # position 0: the fast host
    even = planner.evaluate(model, inventory, 2, 16384, dataclasses.replace(best.layout, context_shares=None))
    assert best.step_time < even.step_time and even.paced_by == "slow"
    flags = plan_flags(best)
    assert f"--context-shares {tokens[0]},{tokens[1]}" in flags
    run = cli.parse([*flags.split(), "--batch-size", "2", "--seq-len", "16384", "--model", "test", "--dry-run"])
    assert run.parallelism.context_shares == tokens
    check_context_parallel(run.model, run.parallelism, run.data.seq_len)
