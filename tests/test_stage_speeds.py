"""``--stage-layers auto``: layers per pipeline stage from measured stage speeds.

Timings are injected (no wall clock in any assertion); the split is checked against brute force.
"""

from __future__ import annotations

import itertools

import pytest

from models.config import get_config
from sharding.balance import layers_for_speeds
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Parallelism
from sharding.pipeline import PipelinePlan, pipeline_rules, plan_layout
from sharding.rules import get_rules
from train.runtime.optimizer import OptimizerConfig
from train.runtime.step import Trainer
from train.setup import calibrate


def _brute_force(layers, seconds, fixed):
    best = None
    for split in itertools.product(range(1, layers + 1), repeat=len(seconds)):
        if sum(split) == layers:
            worst = max(t * (n + fixed) for t, n in zip(seconds, split))
            best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize(
    "layers,seconds,fixed",
    [
        (12, [1.0, 2.0], 0.0),
        (12, [1.0, 3.0], 0.0),
        (6, [1.0, 1.5], 0.3),
        (32, [1.0, 1.0, 3.2, 3.2], 0.4),
        (10, [2.0, 1.0, 1.0], 1.0),
        (5, [1.0, 9.0], 0.0),
    ],
)
def test_layers_for_speeds_is_min_max_optimal(layers, seconds, fixed):
    split = layers_for_speeds(layers, seconds, fixed)
    assert sum(split) == layers and min(split) >= 1
    assert max(t * (n + fixed) for t, n in zip(seconds, split)) == pytest.approx(_brute_force(layers, seconds, fixed))


def test_layers_for_speeds_examples_and_refusals():
    assert layers_for_speeds(12, [1.0, 2.0]) == (8, 4)  # twice as fast: twice the layers
    assert layers_for_speeds(12, [1.0, 1.0]) == (6, 6)
    with pytest.raises(ValueError, match="at least one"):
        layers_for_speeds(1, [1.0, 1.0])
    with pytest.raises(ValueError, match="positive"):
        layers_for_speeds(4, [1.0, 0.0])


def test_head_layers_counts_the_output_projection():
    """``test``: vocabulary 512, width 128, so the output projection is 65,536 parameters per token step
    next to a layer's (64 + 32 + 32 + 64) x 128 + 3 x 128 x 384 parameters and its attention products."""
    config = get_config("test")
    layer = 6 * ((128 * 128 + 128 * 64 * 2 + 128 * 128) + 3 * 128 * 384 + 2 * 128) + 3 * 4 * 4 * 32 * 64
    head = 6 * (128 * 512 + 128)
    assert calibrate.head_layers(config, 64) == pytest.approx(head / layer)


def _pipelined(mesh_spec="stage=2,data=4", layers=4):
    config = get_config("test", [f"num_layers={layers}"])
    mesh = make_mesh(parse_mesh(mesh_spec, 8))
    layout, _ = plan_layout(layers, 2)
    plan = PipelinePlan(layout, 4, measure_stages=True)
    par = Parallelism.of(mesh, pipeline_rules(get_rules("fsdp")), pipeline=plan)
    probe = Trainer(config, OptimizerConfig(warmup=0, decay_steps=10), par.replace(pipeline=None))
    return config, par, probe


def test_calibrate_stages_follows_injected_timings():
    """Stage 1's devices take 3x as long: it gets fewer layers, the plan's split is replaced and no longer
    marked for measuring, and each stage is paced by its slowest device."""
    config, par, probe = _pipelined(layers=8)
    slow = {d.id for d in calibrate.stage_devices(par.mesh)[1]}
    one_straggler = calibrate.stage_devices(par.mesh)[0][2].id

    def timer(fn, args_on, local, together):
        assert together  # CPU devices of one process are timed together
        return [3.0 if d.id in slow else 1.5 if d.id == one_straggler else 1.0 for d in local]

    fixed = calibrate.head_layers(config, 16)
    resolved, cal = calibrate.calibrate_stages(par, probe.loss_sums, probe.abstract_params, 1, 16, fixed, timer=timer)
    assert cal.seconds == (1.5, 3.0)
    assert cal.stage_layers == layers_for_speeds(8, [1.5, 3.0], fixed) == (6, 2)
    assert resolved.pipeline.layout.stage_layers == (6, 2) and not resolved.pipeline.measure_stages
    assert "stage 1: 3000.0 ms per microbatch (0.50x stage 0), 2 layers" in "\n".join(cal.lines(1))


def test_cli_stage_layers_auto_measures_and_reports(capsys):
    from train.train import main

    code = main(
        [
            "--cpu-devices",
            "8",
            "--model",
            "test",
            "--mesh",
            "stage=2,data=4",
            "--stage-layers",
            "auto",
            "--microbatches",
            "4",
            "--batch-size",
            "16",
            "--seq-len",
            "32",
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "measured stage speeds (--stage-layers auto" in out and "pipeline: GPipe over stage=2" in out


def test_cli_stage_layers_auto_refuses_circular(capsys):
    from train.train import main

    code = main(
        [
            "--cpu-devices",
            "8",
            "--model",
            "test",
            "--mesh",
            "stage=2,data=4",
            "--stage-layers",
            "auto",
            "--pipeline-schedule",
            "circular",
            "--microbatches",
            "4",
            "--batch-size",
            "16",
            "--dry-run",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--stage-layers auto" in err and "Traceback" not in err
    assert "e.g. --stage-layers 2,2" in err  # a split of the 4-layer test model, not another model's


def test_plan_auto_on_real_devices_measures_its_shares():
    """`train.setup.auto_plan.measured`: without --simulate-cluster the planner's datasheet counts and stage split are
    re-measured at start-up; with it (CPU devices standing in for kinds) they are kept."""
    from sharding.parallel import UnevenBatch
    from train.setup import cli
    from train.setup.auto_plan import measured

    real = cli.parse(["--plan", "auto", "--cluster", "h100:4,a100:4", "--batch-size", "48", "--model", "test"])
    simulated = cli.parse(
        ["--plan", "auto", "--simulate-cluster", "h100:4,a100:4", "--batch-size", "48", "--model", "test"]
    )
    mesh = make_mesh(parse_mesh("data=8", 8))
    uneven = Parallelism.of(mesh, get_rules("dp"), UnevenBatch((5, 5, 5, 5, 1, 1, 1, 1)))
    notes = []
    out = measured(uneven, real, notes.append).strategy
    assert (out.counts, out.speeds, out.microbatches, out.rebalance_every) == (None, "measured", 3, 10)
    assert measured(uneven, simulated, notes.append) is uneven
    _, par, _ = _pipelined(layers=8)
    uneven_stages = par.replace(pipeline=PipelinePlan(plan_layout(8, 2, 1, (6, 2))[0], 4))
    assert measured(uneven_stages, real, notes.append).pipeline.measure_stages
    even = par.replace(pipeline=PipelinePlan(plan_layout(8, 2)[0], 4))
    assert not measured(even, real, notes.append).pipeline.measure_stages
    assert len(notes) == 2 and "--stage-layers auto" in notes[1]
