"""Uneven data parallelism: the update equals the uniform-batch one; each device runs its own count.

The optimizer uses ``eps=1e-3`` here: AdamW's first update is ``g / (|g| + eps)``, which for the
default ``eps=1e-8`` flips sign on gradient entries near zero under any change of summation order;
a larger eps keeps the update a smooth function of the gradient, so 1e-5 compares the gradients'
effect rather than float32 rounding of entries that are zero in exact arithmetic.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli_errors import raises_as_cli

from models.config import get_config
from sharding import costmodel as cm
from sharding import hlo
from sharding.balance import counts_for_speeds, default_capacity
from sharding.devices import simulate_inventory
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Accumulation, Parallelism, UnevenBatch
from sharding.rules import get_rules
from train import strategies
from train.runtime.optimizer import OptimizerConfig
from train.runtime.step import Trainer
from train.setup import checks, cli, layout_flags
from train.setup.auto_plan import apply_plan
from train.setup.config import resolve_mesh

SEQ = 32
COUNTS = (3, 3, 3, 3, 1, 1, 1, 1)


@functools.cache
def _trainer(mesh_spec, rules):
    """The uniform trainer of a layout, one per layout for the module: its jitted init and steps are shared."""
    config = get_config("test", ["num_layers=1"])
    optimizer = OptimizerConfig(warmup=0, decay_steps=10, eps=1e-3)
    return Trainer(
        config, optimizer, Parallelism.of(make_mesh(parse_mesh(mesh_spec, 8)), get_rules(rules), Accumulation(1))
    )


def _uneven(trainer, counts):
    """The trainer's model and layout with uneven microbatch counts per device."""
    return Trainer(trainer.config, trainer.optimizer, trainer.par.replace(strategy=UnevenBatch(tuple(counts))))


def _batch(trainer, rows, seed=0):
    rng = np.random.default_rng(seed)
    fields = {
        "tokens": rng.integers(0, 512, (rows, SEQ)),
        "targets": rng.integers(0, 512, (rows, SEQ)),
        "positions": np.tile(np.arange(SEQ), (rows, 1)),
        "segment_ids": np.repeat(rng.integers(1, 3, (rows, 1)), SEQ, axis=1),
    }
    mask = (rng.random((rows, SEQ)) > 0.1).astype(np.float32)
    sharding = trainer.batch_sharding(rows, SEQ)
    batch = {k: jax.device_put(v.astype(np.int32), sharding) for k, v in fields.items()}
    batch["loss_mask"] = jax.device_put(mask, sharding)
    return batch


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def _loop_bodies(text):
    """Computations reachable from the body of a while loop whose trip count is not known."""
    instructions, calls, _ = hlo._parse(text)
    roots = []
    for items in instructions.values():
        for _, _, op, rest in items:
            if op == "while" and "known_trip_count" not in rest:
                roots += re.findall(r"\bbody=%?([\w.\-]+)", rest)
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack += [callee for callee, _ in calls.get(name, ())]
    return seen, instructions


# data=8 with "dp" alone: test_counts_are_an_input_... compares its update with the uniform one (and the
# fsdp case below checks the loop's collectives without tensor); it was dropped here to keep `make test` short.
@pytest.mark.parametrize(
    "mesh_spec,rules,counts,rows",
    [
        ("data=2,fsdp=4", "fsdp", (0, 2, 1, 1, 4, 1, 0, 3), 2),
        # tensor inside each data-parallel group: one count per group, shared by its two tensor devices
        ("data=4,tensor=2", "tp", (3, 1, 2, 0), 1),
        ("data=2,fsdp=2,tensor=2", "fsdp_tp", (0, 3, 1, 2), 2),
    ],
)
def test_update_equals_uniform_batch_and_counts_match(mesh_spec, rules, counts, rows):
    trainer = _trainer(mesh_spec, rules)
    step = _uneven(trainer, counts)
    batch_rows = sum(counts) * rows
    batch = _batch(trainer, batch_rows)
    params = trainer.init_state(0)["params"]

    loss_sum, weight, grads, extra = jax.jit(step.gradients)(params, batch)
    processed = extra["processed"]
    (u_loss, u_weight), uniform = jax.jit(jax.value_and_grad(trainer.loss_sums, has_aux=True))(params, batch)
    np.testing.assert_allclose(float(loss_sum), float(u_loss), rtol=1e-5)
    assert float(weight) == float(u_weight)
    _close(jax.tree.map(lambda g: g / weight, grads), jax.tree.map(lambda g: g / u_weight, uniform))
    assert np.asarray(processed).tolist() == list(counts)

    signals = step.signals(False)
    compiled = step.train_step(batch_rows, SEQ).lower(trainer.init_state(0), batch, signals).compile()
    new, metrics = compiled(trainer.init_state(0), batch, signals)
    processed = metrics["processed"]
    ref, ref_metrics = trainer.train_step(batch_rows, SEQ)(trainer.init_state(0), batch, trainer.signals(False))
    assert np.asarray(processed).tolist() == list(counts)
    assert int(metrics["microbatches"]) == sum(counts)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    _close(new["params"], ref["params"])
    _close(new["opt_state"], ref["opt_state"])
    # the parameters moved: the comparison is not of two unchanged states
    assert (
        max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(new["params"]), jax.tree.leaves(params)))
        > 1e-4
    )
    _check_compiled_loop(compiled.as_text(), trainer, mesh_spec, rules, counts, rows)


def _data_parallel_group(mesh):
    """Each device's data-parallel group (its ``data`` x ``fsdp`` index), by position in the mesh (HLO ids)."""
    names = list(mesh.axis_names)
    index = np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)
    return [(int(index[names.index("data")][i]), int(index[names.index("fsdp")][i])) for i in range(mesh.devices.size)]


def _check_compiled_loop(text, trainer, mesh_spec, rules, counts, rows):
    """A collective inside a loop whose trip count differs per group would deadlock: the step's
    microbatch loop must exist, and every collective in it must stay inside one data-parallel group (the
    tensor collectives of a group whose devices all run one count; none without tensor); and without
    tensor the collectives must be the cost model's for the uneven step."""
    bodies, instructions = _loop_bodies(text)
    assert bodies, "the per-device microbatch loop is missing"
    inside = [
        (op, hlo.device_groups(rest))
        for c in bodies
        for _, _, op, rest in instructions.get(c, ())
        if op.replace("-start", "") in hlo.COLLECTIVE_OPS
    ]
    layout = cm.Layout(parse_mesh(mesh_spec, 8), rules, 1, uneven_batch=True)
    if trainer.par.mesh_shape["tensor"] > 1:
        group = _data_parallel_group(trainer.mesh)
        assert inside, "tensor collectives were expected inside the loop"
        for op, groups in inside:
            assert groups and all(len({group[d] for d in g}) == 1 for g in groups), (op, groups)
        # the cost model's tensor collectives of one microbatch against the loop body's (run once per microbatch)
        in_loop = [c for c in hlo.collectives(text) if c.computation in bodies]
        one = cm.device_cost(trainer.config, layout, seq_len=SEQ, rows=rows, microbatches=1, backend="cpu")
        predicted = sum(c.result_bytes * c.count for c in one.comms if c.axes == ("tensor",))
        compiled = sum(c.result_bytes * c.executions for c in in_loop)
        assert abs(predicted - compiled) <= 0.02 * compiled, (predicted, compiled)
        # Outside the loop, the partitioner lays the batch re-layout and (fsdp_tp) the parameter gathers out
        # otherwise than the model says ("involuntary full rematerialization"); not priced here.
        return
    assert inside == []
    capacity = default_capacity(sum(counts), len(counts), counts)
    cost = cm.device_cost(
        trainer.config,
        layout,
        seq_len=SEQ,
        rows=rows,
        microbatches=capacity,
        backend="cpu",
        batch_rows=sum(counts) * rows,
    )
    compiled, predicted = cm.collective_bytes(hlo.collectives(text)), cm.collective_bytes(cost.comms)
    assert set(compiled) == set(predicted)
    for kind in compiled:
        assert abs(predicted[kind] - compiled[kind]) <= 0.1 * compiled[kind], (kind, predicted, compiled)


def test_counts_are_an_input_changing_them_neither_recompiles_nor_changes_the_update():
    trainer = _trainer("data=8", "dp")
    step = _uneven(trainer, COUNTS)
    assert step.strategy.capacity == 4  # twice the mean of 2, above max(COUNTS) = 3
    batch = _batch(trainer, 16)
    fn = step.train_step(16, SEQ)
    ref, _ = trainer.train_step(16, SEQ)(trainer.init_state(0), batch, trainer.signals(False))
    for counts in (COUNTS, (2,) * 8, (0, 4, 1, 3, 2, 2, 4, 0)):
        new, metrics = fn(trainer.init_state(0), batch, step.signals(False, counts))
        assert np.asarray(metrics["processed"]).tolist() == list(counts)
        _close(new["params"], ref["params"])
    assert fn._cache_size() == 1  # one compilation for every set of counts
    for bad in ((5, 3, 3, 3, 1, 1, 0, 0), (2,) * 7, (3,) * 8):  # above capacity, too few, wrong total
        with pytest.raises(ValueError, match="--hetero-max-share 4"):
            step.signals(False, bad)


def test_row_index_from_counts_on_device():
    index = np.asarray(strategies.uneven_row_index(np.array([2, 0, 1], np.int32), 2, 3))
    assert index.tolist() == [[0, 1, 2, 3, 0, 0], [0] * 6, [4, 5, 0, 0, 0, 0]]
    traced = jax.jit(lambda c: strategies.uneven_row_index(c, 2, 3))(jnp.array([2, 0, 1], jnp.int32))
    assert np.asarray(traced).tolist() == index.tolist()


def test_capacity_and_capped_counts():
    assert default_capacity(16, 8) == 4 and default_capacity(12, 8, (0, 2, 1, 1, 4, 1, 0, 3)) == 4
    assert default_capacity(3, 2) == 3  # never above the total
    assert counts_for_speeds([10.0, 1.0, 1.0, 1.0], 8, capacity=4) == [4, 2, 1, 1]
    with pytest.raises(ValueError):
        counts_for_speeds([1.0, 1.0], 5, capacity=2)


def test_speed_counts_largest_remainder():
    speed_counts = counts_for_speeds
    assert speed_counts([989.5, 989.5, 989.5, 989.5, 312, 312, 312, 312], 16) == [3, 3, 3, 3, 1, 1, 1, 1]
    assert speed_counts([1, 1, 1], 10) == [4, 3, 3]
    assert speed_counts([2, 1], 0) == [0, 0]
    counts = speed_counts([3.0, 1.5, 1.0, 1.0], 37)
    assert sum(counts) == 37 and counts[0] > counts[1] > counts[2] == counts[3]
    with pytest.raises(ValueError):
        speed_counts([1, 0], 4)


def test_auto_counts_from_simulated_kinds():
    trainer = _trainer("data=8", "dp")
    _, simulated = simulate_inventory("h100:4,a100:4", jax.devices())
    speeds = strategies.device_speeds(trainer.mesh, simulated)
    par, _ = strategies.resolve_uneven(
        trainer.par.replace(strategy=UnevenBatch(None, "kinds", 2)), trainer.mesh, simulated
    )
    assert list(par.strategy.counts) == list(COUNTS)
    assert counts_for_speeds(speeds, 16) == list(COUNTS)
    with pytest.raises(ValueError, match="--simulate-cluster"):
        strategies.device_speeds(trainer.mesh, None)  # CPU devices: peak unknown


def test_bad_layouts_and_counts_are_refused_naming_the_flag():
    with pytest.raises(
        ValueError, match="--hetero-batch supports meshes over data, fsdp and tensor only; --mesh splits sequence=2"
    ):
        _uneven(_trainer("data=4,sequence=2", "dp"), (1, 1, 1, 1))
    with pytest.raises(
        ValueError,
        match=r"--hetero-batch 3,1,1,1,2,2,1,1: counts 3,1 split a tensor group of 2 "
        r"devices.*one count per data-parallel group.*--hetero-batch 2,1,2,1",
    ):
        _uneven(_trainer("data=4,tensor=2", "tp"), (3, 1, 1, 1, 2, 2, 1, 1))
    with pytest.raises(
        ValueError,
        match=r"8 counts are one per device; give one count per data-parallel group "
        r"\(the 4 along data x fsdp.*--hetero-batch 3,1,2,1",
    ):
        _uneven(_trainer("data=4,tensor=2", "tp"), (3, 3, 1, 1, 2, 2, 1, 1))
    with pytest.raises(ValueError, match="8 devices"):
        _uneven(_trainer("data=8", "dp"), (1, 1))
    with pytest.raises(ValueError, match="--batch-size 20"):
        _uneven(_trainer("data=8", "dp"), COUNTS).train_step(20, SEQ)
    with pytest.raises(ValueError, match="--batch-size 16 is not divisible by the 17 microbatches"):
        run = cli.parse(
            [
                "--model",
                "test",
                "--mesh",
                "data=8",
                "--rules",
                "dp",
                "--hetero-batch",
                "3,3,3,3,1,1,1,2",
                "--batch-size",
                "16",
                "--dry-run",
            ]
        )
        checks.validate(resolve_mesh(run, 8), 8)
    with pytest.raises(ValueError, match="--hetero-batch"):
        layout_flags.parse_hetero_batch("3,x")
    with pytest.raises(ValueError, match="--hetero-max-share 0 needs"):
        cli.parse(["--mesh", "data=8", "--hetero-batch", "auto", "--hetero-max-share", "0"])
    with pytest.raises(ValueError, match="--hetero-max-share 2 is below"):
        run = cli.parse(
            [
                "--model",
                "test",
                "--mesh",
                "data=8",
                "--rules",
                "dp",
                "--hetero-batch",
                "3,3,3,3,1,1,1,1",
                "--hetero-max-share",
                "2",
                "--batch-size",
                "16",
            ]
        )
        checks.validate(resolve_mesh(run, 8), 8)
    run = cli.parse(
        [
            "--model",
            "test",
            "--mesh",
            "data=8",
            "--rules",
            "dp",
            "--hetero-batch",
            "3,3,3,3,1,1,1,1",
            "--batch-size",
            "20",
            "--dry-run",
        ]
    )
    with pytest.raises(ValueError, match="--batch-size 20"):
        checks.check_strategy(resolve_mesh(run, 8))


@pytest.mark.parametrize(
    "flags",
    [
        ["--mesh", "data=8"],
        ["--microbatches", "4"],
        ["--remat", "full"],
        ["--pipeline-schedule", "zb"],
        ["--stage-layers", "3,1"],
        ["--pipeline-gather", "microbatch"],
    ],
)
def test_plan_auto_refuses_a_flag_it_would_choose_itself(flags):
    """--plan auto replaced a given --mesh or --microbatches without a word, and refused --pipeline-schedule zb
    as 'needs a pipeline: add a stage axis to --mesh' though the plan may have one."""
    argv = ["--plan", "auto", "--simulate-cluster", "h100:4,a100:4", "--model", "test", *flags]
    with pytest.raises(ValueError, match=f"^--plan auto chooses {flags[0]} itself; drop {flags[0]} {flags[1]},"):
        cli.parse(argv)
    cli.parse(argv[:-2])  # the same without it is accepted


def test_plan_auto_sets_the_flags(monkeypatch):
    run = cli.parse(
        [
            "--plan",
            "auto",
            "--simulate-cluster",
            "h100:4,a100:4",
            "--batch-size",
            "64",
            "--seq-len",
            "256",
            "--model",
            "125m",
            "--attention",
            "flash",
            "--dtype",
            "bfloat16",
            "--dry-run",
        ]
    )
    lines = []
    run = apply_plan(run, jax.devices(), lines.append)
    assert lines and lines[0].startswith("--plan auto")
    par = run.parallelism
    shape = par.mesh_shape
    assert par.rules.name.split("+")[0] in ("dp", "fsdp", "tp", "fsdp_tp") and par.strategy.microbatches >= 1
    assert run.model.remat in ("none", "dots", "full")
    checks.check_batch(run)
    checks.check_strategy(run)  # a pipeline with --attention flash included
    if shape["stage"] > 1:
        assert sum(par.pipeline.layout.stage_layers) == 12


def test_cli_dry_run_with_simulated_cluster_and_auto_counts(capsys):
    from train.train import main

    code = main(
        [
            "--cpu-devices",
            "8",
            "--model",
            "test",
            "--set",
            "num_layers=1",
            "--mesh",
            "data=8",
            "--rules",
            "dp",
            "--simulate-cluster",
            "h100:4,a100:4",
            "--hetero-batch",
            "kinds",
            "--microbatches",
            "2",
            "--batch-size",
            "16",
            "--seq-len",
            "32",
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "per device 3 (990 TFLOP/s), 3 (990 TFLOP/s), 3 (990 TFLOP/s), 3 (990 TFLOP/s), 1 (312 TFLOP/s)" in out
    assert "collectives in the compiled step" in out


def test_cli_refuses_counts_that_split_a_tensor_group(capsys):
    from train.train import main

    code = main(
        [
            "--cpu-devices",
            "8",
            "--model",
            "test",
            "--mesh",
            "data=4,tensor=2",
            "--rules",
            "fsdp_tp",
            "--hetero-batch",
            "2,1,1,1,1,1,1,1",
            "--batch-size",
            "9",
            "--seq-len",
            "32",
            "--dry-run",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "--hetero-batch 2,1,1,1,1,1,1,1: counts 2,1 split a tensor group" in err and "Traceback" not in err


def test_calibration_counts_follow_injected_timings_per_process():
    """Timings map to the batch grid by process and local rank; counts follow the measured speeds."""
    from types import SimpleNamespace

    from train.setup import calibrate

    devices = [SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
    table = np.array([[0.1] * 4, [0.3] * 4])
    seconds = calibrate.grid_seconds(devices[::-1], table, devices)
    assert seconds == [0.3] * 4 + [0.1] * 4

    trainer = _trainer("data=8", "dp")
    par = trainer.par.replace(strategy=UnevenBatch(None, "measured", 2))
    calls = []

    def timer(fn, args_on, local, together):  # one process on CPU: the devices run together
        calls.append((len(local), together))
        return [0.2] * len(local)

    resolved, cal = calibrate.calibrate(par, trainer.loss_sums, trainer.abstract_params, 16, SEQ, timer=timer)
    assert calls == [(8, True)] and resolved.strategy.counts == (2,) * 8 and resolved.strategy.capacity == 4
    assert cal.seconds == (0.2,) * 8 and "5.00 microbatches/s" in "".join(cal.lines(1))

    fn, args_on = calibrate.local_work(par, trainer.loss_sums, trainer.abstract_params, 2, SEQ)
    ticks = iter([0.0, 0.6, 1.0, 1.3])
    out = calibrate.time_local_devices(
        fn, args_on, jax.devices()[:2], together=False, repeats=3, clock=lambda: next(ticks)
    )
    np.testing.assert_allclose(out, [0.2, 0.1])


def test_devices_timed_together_run_one_program_compiled_once():
    """CPU devices are timed together: one program over all 8 (each device the whole local work on its own
    arguments, so each returns a whole gradient), compiled once, where calling the jitted work on each
    device's arguments compiled it once per device."""
    from train.setup import calibrate

    trainer = _trainer("data=8", "dp")
    par = trainer.par.replace(strategy=UnevenBatch(None, "measured", 2))
    fn, args_on = calibrate.local_work(par, trainer.loss_sums, trainer.abstract_params, 2, SEQ)
    params, _ = args_on(jax.devices()[0])  # the arguments' own small programs compiled before counting
    compiles = []

    def listener(event, _seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":  # every compilation, cached on disk or not
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        seconds = calibrate.time_local_devices(fn, args_on, jax.devices(), together=True, repeats=1)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compiles) == 1 and len(seconds) == 8 and len(set(seconds)) == 1
    program, stacked = calibrate.run_together(fn, args_on, jax.devices())
    grads = jax.eval_shape(program, *stacked)
    assert jax.tree.map(lambda g, p: g.shape == (8, *p.shape), grads, params) == jax.tree.map(lambda _: True, params)


def test_cli_auto_measures_and_reports(capsys):
    from train.train import main

    code = main(
        [
            "--cpu-devices",
            "8",
            "--model",
            "test",
            "--set",
            "num_layers=1",
            "--mesh",
            "data=8",
            "--rules",
            "dp",
            "--hetero-batch",
            "auto",
            "--microbatches",
            "2",
            "--batch-size",
            "16",
            "--seq-len",
            "32",
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "measured speeds (--hetero-batch auto" in out and "datasheet n/a, 2 microbatches" in out
    assert "per device 2, 2, 2, 2, 2, 2, 2, 2; padded buffer 4" in out


def test_rebalancer_smooths_with_hysteresis_and_follows_a_straggler():
    from sharding.balance import Rebalancer

    reb = Rebalancer((2,) * 8, capacity=4, every=3)
    fast, slow = [0.1] * 4, [0.3] * 4
    for _ in range(2):
        reb.observe((2,) * 8, [2 * t for t in fast + slow])
        assert reb.propose() is None  # not due yet
    reb.observe((2,) * 8, [2 * t for t in fast + slow])
    assert reb.propose() == COUNTS and reb.counts == COUNTS
    for _ in range(3):  # 3% noise: the predicted gain is below the 5% margin, counts stay
        reb.observe(COUNTS, [c * t for c, t in zip(COUNTS, [0.1] * 4 + [0.29] * 4)])
    assert reb.propose() is None
    for _ in range(6):  # device 0 becomes 4x slower: its share falls
        reb.observe(COUNTS, [c * t for c, t in zip(COUNTS, [0.4] + [0.1] * 3 + [0.3] * 4)])
        reb.propose()
    assert reb.counts[0] < 3 and sum(reb.counts) == 16 and max(reb.counts) <= 4
    reb.observe((0,) + reb.counts[1:], [0.0] + [0.1] * 7)  # a device that ran nothing keeps its estimate
    assert reb.seconds[0] is not None
    with raises_as_cli(ValueError, match="--rebalance-every 0"):
        Rebalancer((1, 1), 2, 0)


def test_updates_equal_uniform_before_and_after_a_rebalance():
    from sharding.balance import Rebalancer

    trainer = _trainer("data=2,fsdp=4", "fsdp")
    step = Trainer(
        trainer.config, trainer.optimizer, trainer.par.replace(strategy=UnevenBatch((2,) * 8, rebalance_every=1))
    )
    batches = [_batch(trainer, 16, seed) for seed in (0, 1)]
    uniform, hetero = trainer.init_state(0), step.init_state(0)
    reb = Rebalancer((2,) * 8, step.strategy.capacity, every=1)
    fn = step.train_step(16, SEQ)
    counts = None
    for batch in batches:
        uniform, _ = trainer.train_step(16, SEQ)(uniform, batch, trainer.signals(False))
        hetero, metrics = fn(hetero, batch, step.signals(False, counts))
        seconds = np.asarray(metrics["local_seconds"])
        assert seconds.shape == (8,) and (seconds >= 0).all()
        reb.observe(
            np.asarray(metrics["processed"]).tolist(), [c * t for c, t in zip(reb.counts, [0.1] * 4 + [0.3] * 4)]
        )
        counts = reb.propose() or counts
        assert counts == COUNTS  # rebalanced after the first step; the second runs 3,3,3,3,1,1,1,1
    assert np.asarray(metrics["processed"]).tolist() == list(COUNTS)
    assert fn._cache_size() == 1
    _close(hetero["params"], uniform["params"])
    _close(hetero["opt_state"], uniform["opt_state"])


def test_rebalance_flag_values_are_checked():
    assert cli.parse(["--mesh", "data=8", "--hetero-batch", "auto"]).parallelism.strategy.rebalance_every == 10
    assert cli.parse(["--mesh", "data=8", "--hetero-batch", "kinds"]).parallelism.strategy.rebalance_every == 0
    for bad in (
        ["--hetero-batch", "auto", "--rebalance-every", "0"],
        ["--hetero-batch", "auto", "--rebalance-every", "-2"],
        ["--rebalance-every", "5"],
    ):
        with pytest.raises(ValueError, match=f"--rebalance-every {bad[-1]}: needs --hetero-batch"):
            cli.parse(["--mesh", "data=8", *bad])


def test_training_with_auto_rebalancing_writes_counts_and_speeds(tmp_path, capsys):
    import json

    from train.train import main

    code = main(
        [
            "--cpu-devices",
            "8",
            "--model",
            "test",
            "--set",
            "num_layers=1",
            "--mesh",
            "data=8",
            "--rules",
            "dp",
            "--hetero-batch",
            "auto",
            "--rebalance-every",
            "1",
            "--microbatches",
            "2",
            "--batch-size",
            "16",
            "--seq-len",
            "32",
            "--steps",
            "3",
            "--eval-every",
            "0",
            "--eval-batches",
            "0",
            "--log-every",
            "1",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/processed" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert sum(r["train/processed"]) == 16 and max(r["train/processed"]) <= 4
        assert len(r["train/local_seconds"]) == 8 and len(r["train/speeds"]) == 8


def test_speeds_on_a_tensor_mesh_are_one_per_group_paced_by_its_slowest_device(monkeypatch):
    """Calibration (injected timings) and datasheets give one count per data-parallel group; a group runs as
    fast as its slowest tensor device."""
    from train.setup import calibrate

    # devices timed one by one, each its own compute pool (accelerators; CPU devices of one process would
    # share one pool and get even counts, test_pools.py)
    monkeypatch.setattr(calibrate, "compute_pools", lambda grid: None)

    trainer = _trainer("data=4,tensor=2", "fsdp_tp")
    flat = list(trainer.mesh.devices.flat)
    assert strategies.batch_groups(trainer.mesh) == [flat[0:2], flat[2:4], flat[4:6], flat[6:8]]

    slow = flat[3].id  # the second device of group 1 takes twice as long
    par = trainer.par.replace(strategy=UnevenBatch(None, "measured", 2))
    timer = lambda fn, args_on, local, together: [0.2 if d.id == slow else 0.1 for d in local]  # noqa: E731
    resolved, cal = calibrate.calibrate(par, trainer.loss_sums, trainer.abstract_params, 16, SEQ, timer=timer)
    assert cal.seconds == (0.1, 0.2, 0.1, 0.1)
    assert resolved.strategy.counts == tuple(counts_for_speeds([10.0, 5.0, 10.0, 10.0], 8, 4)) == cal.counts
    assert resolved.strategy.counts[1] == 1 and sum(resolved.strategy.counts) == 8

    _, simulated = simulate_inventory("h100:3,a100:5", jax.devices())  # group 1 mixes an H100 and an A100
    speeds = strategies.device_speeds(trainer.mesh, simulated)
    assert [round(s / 1e12) for s in speeds] == [990, 312, 312, 312]
    kinds, _ = strategies.resolve_uneven(
        trainer.par.replace(strategy=UnevenBatch(None, "kinds", 2)), trainer.mesh, simulated
    )
    assert len(kinds.strategy.counts) == 4 and kinds.strategy.counts[0] > kinds.strategy.counts[1]


def test_updates_equal_uniform_before_and_after_a_rebalance_with_tensor_groups():
    from sharding.balance import Rebalancer

    trainer = _trainer("data=2,fsdp=2,tensor=2", "fsdp_tp")
    strategy = UnevenBatch((2,) * 4, rebalance_every=1)
    step = Trainer(trainer.config, trainer.optimizer, trainer.par.replace(strategy=strategy))
    batches = [_batch(trainer, 8, seed) for seed in (0, 1)]
    uniform, hetero = trainer.init_state(0), step.init_state(0)
    reb = Rebalancer((2,) * 4, step.strategy.capacity, every=1)
    fn = step.train_step(8, SEQ)
    counts = None
    for batch in batches:
        uniform, _ = trainer.train_step(8, SEQ)(uniform, batch, trainer.signals(False))
        hetero, metrics = fn(hetero, batch, step.signals(False, counts))
        seconds = np.asarray(metrics["local_seconds"])
        assert seconds.shape == (4,) and (seconds >= 0).all()  # one loop time per group
        seconds_per_microbatch = [0.1, 0.1, 0.3, 0.3]
        reb.observe(
            np.asarray(metrics["processed"]).tolist(), [c * t for c, t in zip(reb.counts, seconds_per_microbatch)]
        )
        counts = reb.propose() or counts
        assert counts == (3, 3, 1, 1)  # rebalanced after the first step; the second runs it
    assert np.asarray(metrics["processed"]).tolist() == [3, 3, 1, 1]
    assert fn._cache_size() == 1
    _close(hetero["params"], uniform["params"])
    _close(hetero["opt_state"], uniform["opt_state"])
