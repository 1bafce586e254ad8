"""--optimizer, --schedule, --beta1/--beta2/--eps: each optimizer trains, each schedule has its shape, bad values
are refused at parse time naming the flag, a resume with another optimizer is refused, the grad norm is logged;
Adafactor's factored state is sharded as its parameters and resumes onto another mesh."""

import math
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_faults import args_for

from checkpoints.manager import CheckpointManager
from checkpoints.meta import RunMeta
from models.config import get_config
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Parallelism
from sharding.rules import get_rules
from train import train
from train.runtime.optimizer import OptimizerConfig, learning_rate_schedule
from train.runtime.step import Trainer


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
    (
        ["--optimizer", "adafactor", "--beta1", "0.9"],
        "--beta1 0.9: --optimizer adafactor has no such parameter (it applies to adamw, lion, sgd)",
    ),
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
    from train.setup import cli
    from train.setup.parser import build_parser

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
    actions = {a.dest: a for a in build_parser()._actions}
    assert tuple(actions["pipeline_schedule"].choices) == tuple(SCHEDULES)


# Adafactor's factored second moment on a mesh --------------------------------------------------------


def _adafactor(mesh_spec: str, devices: int = 8) -> Trainer:
    return Trainer(
        get_config("test", ["num_layers=2"]),
        OptimizerConfig(name="adafactor", eps=1e-30, warmup=1, decay_steps=8),
        Parallelism.of(make_mesh(parse_mesh(mesh_spec, devices), jax.devices()[:devices]), get_rules("fsdp_tp")),
    )


def _host_tree(trainer, seed: int, scale: float) -> dict:
    """Random float32 NumPy arrays shaped as the trainer's parameters."""
    leaves, tree = jax.tree.flatten(trainer.abstract_params)
    rng = np.random.default_rng(seed)
    return tree.unflatten([(scale * rng.standard_normal(x.shape)).astype(np.float32) for x in leaves])


def _fresh(trainer, params) -> dict:
    """Step 0 of host ``params`` on the trainer's mesh: Adafactor's initial state from optax's init."""
    params = jax.device_put(params, trainer.param_shardings)
    return {
        "step": jax.device_put(np.int32(0), trainer.replicated),
        "params": params,
        "opt_state": jax.jit(trainer.tx.init, out_shardings=trainer.state_shardings["opt_state"])(params),
        "rng": jax.device_put(np.zeros(2, np.uint32), trainer.replicated),
    }


def _updates(trainer, state, seeds) -> dict:
    """``state`` after one optimizer update per seed, each of random gradients summed over 4 tokens."""
    update = jax.jit(trainer.apply_gradients, out_shardings=(trainer.state_shardings, None))
    stop = jax.device_put(np.zeros(trainer.mesh.devices.size, np.int32), trainer.signal_sharding()["stop"])
    for seed in seeds:
        grads = jax.device_put(_host_tree(trainer, 100 + seed, 1.0), trainer.param_shardings)
        state, metrics = update(state, np.float32(1.0), np.float32(4.0), grads, stop)
        assert bool(metrics["finite"])
    return state


def _close(got, want):
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_adafactor_on_eight_devices_equals_one_device_and_resumes_onto_other_meshes(tmp_path):
    """Two updates on ``fsdp=4,tensor=2`` equal one device's (parameters and the factored moments), the row
    and column means keeping their parameter's sharding of the dimension they keep; the checkpoint of step 2
    restores value for value onto ``data=2,tensor=4`` and onto one device, whose third update is the
    reference's."""
    one, eight = _adafactor("fsdp=1", 1), _adafactor("fsdp=4,tensor=2")
    params = _host_tree(one, 0, 0.02)
    reference = _updates(one, _fresh(one, params), [0, 1])
    at_two = jax.tree.map(np.asarray, reference)
    reference = _updates(one, reference, [2])
    state = _updates(eight, _fresh(eight, params), [0, 1])
    _close(state, at_two)
    assert int(state["step"]) == 2 and not np.allclose(at_two["params"]["unembed"], params["unembed"])
    opt = state["opt_state"][1][0]  # clip_by_global_norm, then Adafactor's chain: its factored state first
    up = state["params"]["layers"]["mlp"]["up"]  # [layers, embed, mlp]
    assert opt.v_row["layers"]["mlp"]["up"].shape == (2, 128) and opt.v_col["layers"]["mlp"]["up"].shape == (2, 384)
    assert up.sharding.spec == P(None, "fsdp", "tensor")
    assert opt.v_row["layers"]["mlp"]["up"].sharding.spec == P(None, "fsdp")
    assert opt.v_col["layers"]["mlp"]["up"].sharding.spec == P(None, "tensor")
    q = state["params"]["layers"]["attention"]["q"]  # [layers, embed, heads, head_dim]: too small to factor
    assert opt.v["layers"]["attention"]["q"].sharding == q.sharding
    assert (
        opt.v_row["layers"]["attention"]["q"].shape == (1,)
        and opt.v_row["layers"]["attention"]["q"].sharding.spec == P()
    )
    meta = RunMeta(
        model=eight.config.to_dict(), preset="test", mesh={"fsdp": 4, "tensor": 2}, rules={}, data={}, tokenizer={}
    )
    manager = CheckpointManager(tmp_path / "ckpt", async_save=False)
    try:
        manager.save(2, state, meta.to_json())
        moved = _adafactor("data=2,tensor=4")
        restored = [manager.restore(target.abstract_state(), 2)[0] for target in (moved, one)]
    finally:
        manager.close()
    assert restored[0]["opt_state"][1][0].v_col["layers"]["mlp"]["up"].sharding.spec == P(None, "tensor")
    for target, values in zip((moved, one), restored):
        assert [x.sharding for x in jax.tree.leaves(values)] == jax.tree.leaves(target.state_shardings)
        for x, y in zip(jax.tree.leaves(values), jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    _close(_updates(one, restored[1], [2]), reference)
