"""End to end through ``python -m train.train``'s main: training, resuming, resharding, refusing."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from checkpoints.inspect import describe
from checkpoints.manager import CheckpointManager
from models.config import get_config
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Parallelism
from sharding.rules import get_rules
from train import train
from train.runtime.optimizer import OptimizerConfig
from train.runtime.step import Trainer

# No held-out evaluation (its step is compiled only where a test reads held-out losses: --eval-batches 1).
SMALL = [
    "--model",
    "test",
    "--seq-len",
    "64",
    "--batch-size",
    "8",
    "--log-every",
    "1",
    "--no-progress",
    "--eval-batches",
    "0",
]


def run(args, corpus, cache, capsys=None):
    code = train.main([*SMALL, "--data", str(corpus), "--data-cache", str(cache), *args])
    return code


def metrics(run_dir, key="train/loss"):
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if key in record:
            out[record["step"]] = record[key]
    return out


def restore_params(run_dir, mesh_spec, step=None):
    trainer = Trainer(
        get_config("test"),
        OptimizerConfig(decay_steps=8, warmup=1),
        Parallelism.of(make_mesh(parse_mesh(mesh_spec, 8)), get_rules("fsdp_tp")),
    )
    manager = CheckpointManager(Path(run_dir) / "checkpoints", async_save=False)
    try:
        state, meta = manager.restore(trainer.abstract_state(), step)
    finally:
        manager.close()
    return state, meta


def test_a_short_run_lowers_the_held_out_loss(tmp_path, corpus, cache):
    run_dir = tmp_path / "run"
    args = ["--steps", "40", "--eval-every", "0", "--eval-batches", "1", "--lr", "3e-3", "--run-dir", str(run_dir)]
    assert run(args, corpus, cache) == 0
    held_out = metrics(run_dir, "eval/loss")
    assert sorted(held_out) == [0, 40]
    assert held_out[40] < 0.7 * held_out[0]
    losses = metrics(run_dir)
    assert sorted(losses) == list(range(1, 41))
    assert np.mean([losses[s] for s in range(36, 41)]) < 0.7 * losses[1]
    assert (run_dir / "tensorboard").is_dir()


@pytest.fixture(scope="module")
def straight_and_resumed(tmp_path_factory, corpus, cache):
    """Run A: 8 steps straight. Run B: 4 steps, stop, resume for 4 more (same 8-step schedule)."""
    base = tmp_path_factory.mktemp("runs")
    common = ["--warmup", "1", "--eval-every", "0", "--ckpt-every", "2"]
    a, b = base / "a", base / "b"
    assert run([*common, "--steps", "8", "--run-dir", str(a)], corpus, cache) == 0
    assert run([*common, "--steps", "4", "--decay-steps", "8", "--run-dir", str(b)], corpus, cache) == 0
    snapshot = base / "b-at-4"
    shutil.copytree(b, snapshot)
    assert run([*common, "--steps", "8", "--resume", "--run-dir", str(b)], corpus, cache) == 0
    return a, b, snapshot


def test_resume_gives_the_same_losses_and_parameters(straight_and_resumed):
    a, b, _ = straight_and_resumed
    losses_a, losses_b = metrics(a), metrics(b)
    assert sorted(losses_b) == list(range(1, 9))
    assert not metrics(a, "eval/loss") and not metrics(b, "eval/loss")  # --eval-batches 0: never evaluated
    np.testing.assert_allclose([losses_b[s] for s in range(1, 9)], [losses_a[s] for s in range(1, 9)], rtol=1e-6)
    state_a, meta_a = restore_params(a, "fsdp=8")
    state_b, meta_b = restore_params(b, "fsdp=8")
    assert meta_a["data"]["samples"] == meta_b["data"]["samples"] == 64
    assert int(state_b["step"]) == 8
    for x, y in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_resume_onto_another_mesh_keeps_values_and_next_loss(tmp_path, straight_and_resumed, corpus, cache):
    a, _, snapshot = straight_and_resumed
    saved, _ = restore_params(snapshot, "fsdp=8")
    moved, _ = restore_params(snapshot, "data=2,tensor=4")
    assert moved["params"]["layers"]["mlp"]["up"].sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(moved)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    run_dir = tmp_path / "moved"
    shutil.copytree(snapshot, run_dir)
    args = [
        "--warmup",
        "1",
        "--eval-every",
        "0",
        "--steps",
        "5",
        "--decay-steps",
        "8",
        "--resume",
        "--mesh",
        "data=2,tensor=4",
        "--run-dir",
        str(run_dir),
    ]
    assert run(args, corpus, cache) == 0
    np.testing.assert_allclose(metrics(run_dir)[5], metrics(a)[5], rtol=1e-5)


def test_a_run_folder_with_checkpoints_is_not_overwritten_without_resume(straight_and_resumed, corpus, cache, capsys):
    _, _, snapshot = straight_and_resumed
    before = {p: p.stat().st_mtime_ns for p in snapshot.rglob("*")}
    code = run(["--steps", "8", "--run-dir", str(snapshot)], corpus, cache)
    assert code == 2
    err = capsys.readouterr().err
    assert "already holds checkpoints" in err and "--resume" in err
    assert {p: p.stat().st_mtime_ns for p in snapshot.rglob("*")} == before


def test_a_different_model_is_refused_naming_the_fields(straight_and_resumed, corpus, cache, capsys):
    _, _, snapshot = straight_and_resumed
    code = run(["--steps", "8", "--resume", "--set", "num_layers=2", "--run-dir", str(snapshot)], corpus, cache)
    assert code == 2
    assert "num_layers (saved 4, now 2)" in capsys.readouterr().err


def test_inspect_lists_steps_mesh_and_arrays(straight_and_resumed):
    _, b, _ = straight_and_resumed
    text = "\n".join(describe(b))
    assert "steps 4, 6, 8" in text  # --keep 3 of the saves at 2, 4, 6, 8
    assert "saved on mesh   fsdp=8" in text
    assert "params/layers/mlp/up" in text and "(4, 128, 384)" in text and "float32" in text
    assert f"{4 * 128 * 384 * 4:,}" in text


# The flash test's reference run: the dry run compiles the same step, which that run then reads from the
# compilation cache instead of compiling it again.
FLASH_RUN = ["--steps", "10", "--warmup", "2", "--eval-every", "0", "--ckpt-every", "0", "--mesh", "fsdp=4,tensor=2"]


def test_dry_run_reports_shardings_memory_and_collectives(capsys):
    code = train.main([*SMALL, *FLASH_RUN, "--dry-run"])
    assert code == 0
    out = capsys.readouterr().out
    assert "918,656 parameters" in out
    assert "layers/mlp/up" in out and "layers,embed,mlp" in out and "(None, 'fsdp', 'tensor')" in out
    assert "temporaries" in out and "all-gather" in out and "per step" in out


def test_fsdp_state_bytes_per_device_are_an_eighth():
    trainer = Trainer(
        get_config("test"), OptimizerConfig(), Parallelism.of(make_mesh(parse_mesh("fsdp=8", 8)), get_rules("fsdp"))
    )
    compiled = trainer.compile_train_step(8, 64)
    stats = compiled.memory_analysis()
    batch_bytes = 5 * 8 * 64 * 4 // 8
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_state()))
    per_device_state = stats.argument_size_in_bytes - batch_bytes
    assert per_device_state <= 1.05 * state_bytes / 8
    assert per_device_state >= state_bytes / 8


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "fsdp=3"], "JAX sees 8 devices"),
        (["--batch-size", "12"], "not divisible by the data-parallel size"),
        (["--batch-size", "16", "--microbatches", "3"], "not divisible by --microbatches 3"),
        (["--data", "/nonexistent/corpus"], "--data /nonexistent/corpus: no such file"),
        (
            ["--rule", "mlp=fsdp"],
            "'mlp' and 'embed' of one array ('layers', 'mlp', 'embed') both map to mesh axis 'fsdp'",
        ),
        (["--warmup", "500"], "--warmup 500 must be smaller"),
        (["--set", "vocab_size=100"], "--set vocab_size=384"),
    ],
)
def test_bad_input_fails_before_training_with_the_flag_named(tmp_path, args, message, corpus, cache, capsys):
    code = run([*args, "--steps", "2", "--run-dir", str(tmp_path / "r")], corpus, cache)
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert not (tmp_path / "r" / "checkpoints").exists() or not any((tmp_path / "r" / "checkpoints").iterdir())


def test_flash_attention_trains_with_the_losses_of_reference(tmp_path, corpus, cache):
    common = FLASH_RUN
    assert run([*common, "--attention", "reference", "--run-dir", str(tmp_path / "ref")], corpus, cache) == 0
    assert run([*common, "--attention", "flash", "--run-dir", str(tmp_path / "flash")], corpus, cache) == 0
    ref, flash = metrics(tmp_path / "ref"), metrics(tmp_path / "flash")
    assert sorted(flash) == list(range(1, 11))
    np.testing.assert_allclose([flash[s] for s in range(1, 11)], [ref[s] for s in range(1, 11)], rtol=1e-4)


def test_the_closing_lines_give_one_evaluation_as_one_value():
    """A run stopped before its second evaluation says the one held-out loss it has, not "a -> a over steps
    0-0"; two or more give the first and last."""
    from train.reports.report import summary_lines

    base = {"step": 40, "start_step": 30, "stopped_by": "SIGINT"}
    once = summary_lines({**base, "eval": [(0, 6.61684)]}, Path("ckpt"), 0.5)
    assert once[-1] == "held-out loss 6.6168 at step 0 (evaluated once; --eval-every sets how often)"
    twice = summary_lines({**base, "eval": [(0, 6.61684), (20, 5.5), (40, 4.25)]}, Path("ckpt"), 0.5)
    assert twice[-1] == "held-out loss 6.6168 -> 4.2500 over steps 0-40"
    assert summary_lines({**base, "eval": []}, Path("ckpt"), 0.5)[-1].startswith("stopped by SIGINT")
