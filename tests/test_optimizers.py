"""--optimizer, --schedule, --beta1/--beta2/--eps: each optimizer trains, each schedule has its shape, bad values
are refused at parse time naming the flag, a resume with another optimizer is refused, the grad norm is logged."""

import math
import re

import pytest
from test_faults import args_for

from train import train
from train.optimizer import OptimizerConfig, learning_rate_schedule


@pytest.mark.parametrize("name", ["adamw", "lion", "sgd"])
def test_each_optimizer_trains_two_steps(tmp_path, corpus, cache, capsys, name):
    code = train.main(
        args_for(
            corpus, cache, "--steps", "2", "--ckpt-every", "0", "--optimizer", name, "--run-dir", str(tmp_path / "r")
        )
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    losses = re.findall(r"^step\s+\d+/2 \| loss (\S+) \| lr \S+ \| grad norm (\S+) \|", out.out, re.M)
    assert len(losses) == 2, out.out
    assert float(losses[1][0]) < float(losses[0][0])  # the step moved the parameters downhill


def lrs(schedule, steps=10, warmup=2):
    curve = learning_rate_schedule(OptimizerConfig(lr=1.0, warmup=warmup, decay_steps=steps, schedule=schedule))
    return [float(curve(c)) for c in range(steps)]  # update c trains step c + 1


def test_schedules_warm_up_then_decay_by_their_shape():
    cosine, linear, wsd = lrs("cosine"), lrs("linear"), lrs("wsd")
    for curve in (cosine, linear, wsd):
        assert curve[0] == pytest.approx(0.5) and curve[1] == pytest.approx(1.0) and curve[-1] == pytest.approx(0.1)
    assert linear[5] == pytest.approx(1.0 - 0.9 * 4 / 8)  # step 6: 4 of the 8 decay steps done
    assert wsd[1:8] == pytest.approx([1.0] * 7) and wsd[8] == pytest.approx(0.55)  # last 20%: 2 steps down
    assert cosine[5] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))


BAD = [
    (["--beta1", "1"], "--beta1 1.0: must be >= 0 and < 1"),
    (["--beta2", "-0.1"], "--beta2 -0.1: must be >= 0 and < 1"),
    (["--beta1", "nan"], "--beta1 nan: must be >= 0 and < 1"),
    (["--eps", "0"], "--eps 0.0: must be a finite number > 0"),
    (["--eps", "inf"], "--eps inf: must be a finite number > 0"),
    (
        ["--optimizer", "sgd", "--beta2", "0.9"],
        "--beta2 0.9: --optimizer sgd has no such parameter (it applies to adamw, lion)",
    ),
    (["--optimizer", "lion", "--eps", "1e-6"], "--eps 1e-06: --optimizer lion has no such parameter"),
    (["--optimizer", "adafactor"], "argument --optimizer: invalid choice: 'adafactor'"),
    (["--optimizer", "rmsprop"], "argument --optimizer: invalid choice: 'rmsprop'"),
    (["--schedule", "step"], "argument --schedule: invalid choice: 'step'"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_optimizer_values_are_refused_naming_the_flag(tmp_path, corpus, cache, capsys, flags, message):
    try:
        code = train.main(args_for(corpus, cache, *flags, "--run-dir", str(tmp_path / "r")))
    except SystemExit as e:  # argparse's own (choices)
        code = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not (tmp_path / "r").exists()


def test_a_resume_with_another_optimizer_is_refused(tmp_path, corpus, cache, capsys):
    run_dir = str(tmp_path / "r")
    assert train.main(args_for(corpus, cache, "--steps", "2", "--run-dir", run_dir)) == 0
    capsys.readouterr()
    code = train.main(args_for(corpus, cache, "--steps", "3", "--resume", "--optimizer", "lion", "--run-dir", run_dir))
    err = capsys.readouterr().err
    assert (
        code == 2 and "--optimizer lion: the checkpoint of step 2 in " in err and "resume with --optimizer adamw" in err
    ), err


def test_the_learning_rate_schedule_flag_leaves_the_pipeline_schedules_alone():
    from sharding.pipeline import SCHEDULES
    from train import cli

    run = cli.parse(
        [
            "--mesh",
            "stage=2,fsdp=-1",
            "--pipeline-schedule",
            "1f1b",
            "--microbatches",
            "2",
            "--schedule",
            "wsd",
            "--model",
            "test",
        ]
    )
    assert run.parallelism.pipeline.one_f_one_b and run.optimizer.schedule == "wsd"
    actions = {a.dest: a for a in cli.build_parser()._actions}
    assert tuple(actions["pipeline_schedule"].choices) == tuple(SCHEDULES)
