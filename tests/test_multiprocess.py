"""Two processes of 4 CPU devices (gloo collectives, coordinator on 127.0.0.1) against one of 8.

The one-process references run inside the test process (its 8 CPU devices, `train.train.main`): the same
program as ``python -m train.train --cpu-devices 8``, without a process start and JAX's import each.
"""

import re
from pathlib import Path

import jax
import numpy as np
import pytest
from _procs import free_port, losses, start
from test_run_folder import damage_a_data_file

from checkpoints.manager import CheckpointManager
from models.config import get_config
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Parallelism
from train import train
from train.data import load_dataset
from train.data.tokenizer import ByteTokenizer
from train.runtime.optimizer import OptimizerConfig
from train.runtime.step import Trainer

pytestmark = pytest.mark.slow  # two gloo processes: tens of seconds

COMMON = [
    "--model",
    "test",
    "--seq-len",
    "64",
    "--batch-size",
    "8",
    "--mesh",
    "data=2,fsdp=4",
    "--mesh-outer",
    "data=2",
    "--warmup",
    "2",
    "--decay-steps",
    "20",
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--ckpt-every",
    "2",
    "--no-progress",
    "--eval-batches",
    "0",
]


def two_processes(args, logs: Path, timeout=300):
    port = free_port()
    procs = [
        start(
            [
                *args,
                "--cpu-devices",
                "4",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--dist-timeout",
                "120",
            ],
            logs / f"p{i}.log",
        )
        for i in range(2)
    ]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, code in enumerate(codes):
        assert code == 0, (logs / f"p{i}.log").read_text()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, cache):
    """Two processes train to step 4 (saving 2 and 4); a data file process 1 wrote into step 4 is damaged;
    both resume, fall back to step 2 together and train to 8. One process of 8 devices trains to 8.

    Few steps: each compares losses step by step and each step's checkpoint restores the same way, so the
    behaviour checked (resume, fall back, restore) is that of longer runs; the schedule is fixed by
    --warmup and --decay-steps, not by --steps."""
    base = tmp_path_factory.mktemp("mp")
    data = ["--data", str(corpus), "--data-cache", str(cache)]
    multi, single = base / "multi", base / "single"
    two_processes([*COMMON, *data, "--steps", "4", "--run-dir", str(multi)], base)
    damaged, _ = damage_a_data_file(multi / "checkpoints" / "4" / "state", process=1)
    two_processes([*COMMON, *data, "--steps", "8", "--resume", "--run-dir", str(multi)], base)
    assert train.main([*COMMON, *data, "--steps", "8", "--cpu-devices", "8", "--run-dir", str(single)]) == 0
    return base, multi, single, damaged


def test_two_processes_train_and_resume_with_the_losses_of_one(runs):
    base, multi, single, _ = runs
    multi_losses, single_losses = losses(multi), losses(single)
    assert sorted(multi_losses) == sorted(single_losses) == list(range(1, 9))
    np.testing.assert_allclose(
        [multi_losses[s] for s in range(1, 9)], [single_losses[s] for s in range(1, 9)], rtol=1e-5
    )
    p0, p1 = (base / "p0.log").read_text(), (base / "p1.log").read_text()
    assert "process 0 of 2" in p0 and "resumed step 2 (" in p0
    assert re.search(r"^step\s+8/8 ", p0, re.M)
    assert not re.search(r"^step\s+\d+/", p1, re.M)  # only process 0 prints
    assert "axes crossing processes: data (over 2)" in p0
    assert re.search(r"^collectives: the 2 processes compiled the same \d+ collectives", p0, re.M)  # before step 1
    assert "[Gloo]" not in p0 + p1  # gloo's connection lines are filtered out (train.launcher.output.LineFilter)


def test_two_processes_fall_back_together_from_damaged_array_data(runs):
    """One process's data file of step 4 damaged: both processes set the step aside and resume step 2 (the
    losses above are one process's), process 0 naming the array and the file; nothing is deleted."""
    base, multi, _, damaged = runs
    folder = multi / "checkpoints"
    (aside,) = [p for p in folder.iterdir() if p.name.startswith("4.damaged-")]
    p0, p1 = (base / "p0.log").read_text(), (base / "p1.log").read_text()
    (line,) = [line for line in p0.splitlines() if "is damaged" in line]
    assert re.match(
        rf"step 4 in {re.escape(str(folder))} is damaged: array '[^']+' chunk \S+ in data file "
        rf"{re.escape(str(damaged))} does not decode \(",
        line,
    ), line
    assert line.endswith(f"set it aside as {aside} (not resumed from, not counted by --keep); resuming from step 2")
    assert "Traceback" not in p0 + p1 and "error" not in p1.lower()
    assert (aside / damaged.relative_to(folder / "4")).is_file()


def test_the_two_process_checkpoint_restores_in_one_process(runs, corpus, cache):
    """Step 6 restored in one 8-device process reproduces the two-process run's loss at step 7."""
    _, multi, _, _ = runs
    mesh = make_mesh(parse_mesh("fsdp=8", 8))
    trainer = Trainer(get_config("test"), OptimizerConfig(warmup=2, decay_steps=20), Parallelism.of(mesh, "fsdp_tp"))
    manager = CheckpointManager(multi / "checkpoints", async_save=False)
    try:
        assert manager.all_steps() == [4, 6, 8]
        state, meta = manager.restore(trainer.abstract_state(), step=6)
    finally:
        manager.close()
    assert meta["step"] == 6 and meta["data"]["samples"] == 48 and meta["mesh"]["data"] == 2
    assert int(state["step"]) == 6
    assert {d.id for d in state["params"]["unembed"].sharding.device_set} == {d.id for d in jax.devices()}

    dataset = load_dataset(str(corpus), ByteTokenizer(), 64, 8, seed=0, heldout=0.01, cache_dir=cache)
    batch = dataset.train_rows(meta["data"]["samples"], range(0, 8))
    loss_sum, weight = jax.jit(trainer.loss_sums)(state["params"], batch)
    np.testing.assert_allclose(float(loss_sum / weight), losses(multi)[7], rtol=1e-5)


@pytest.mark.parametrize(
    "layout",
    [
        ["--mesh", "data=8", "--rules", "dp", "--mesh-outer", "data=2", "--hetero-batch", "3,3,3,3,1,1,1,1"],
        # a tensor group inside each process, one count per data-parallel group
        ["--mesh", "data=4,tensor=2", "--rules", "fsdp_tp", "--mesh-outer", "data=2", "--hetero-batch", "6,2,5,3"],
    ],
)
def test_two_processes_with_uneven_counts_match_one_process(layout, tmp_path, corpus, cache):
    """Uneven counts across two gloo processes: the same losses, counts and final parameters as one process
    of 8 devices (float32, 1e-5)."""
    args = [
        "--model",
        "test",
        "--set",
        "num_layers=1",
        "--seq-len",
        "32",
        "--batch-size",
        "16",
        "--steps",
        "3",
        "--warmup",
        "0",
        "--decay-steps",
        "10",
        "--eval-every",
        "0",
        "--eval-batches",
        "0",
        "--log-every",
        "1",
        "--ckpt-every",
        "3",
        "--no-progress",
        "--data",
        str(corpus),
        "--data-cache",
        str(cache),
        *layout,
    ]
    multi, single = tmp_path / "multi", tmp_path / "single"
    two_processes([*args, "--run-dir", str(multi)], tmp_path, timeout=400)
    assert train.main([*args, "--cpu-devices", "8", "--run-dir", str(single)]) == 0

    multi_losses, single_losses = losses(multi), losses(single)
    assert sorted(multi_losses) == sorted(single_losses) == [1, 2, 3]
    np.testing.assert_allclose([multi_losses[s] for s in (1, 2, 3)], [single_losses[s] for s in (1, 2, 3)], rtol=1e-5)
    counts = [int(c) for c in layout[-1].split(",")]
    assert losses(multi, "train/processed") == losses(single, "train/processed") == {s: counts for s in (1, 2, 3)}

    mesh = make_mesh(parse_mesh("data=8", 8))
    trainer = Trainer(
        get_config("test", ["num_layers=1"]), OptimizerConfig(warmup=0, decay_steps=10), Parallelism.of(mesh, "dp")
    )
    params = []
    for run_dir in (multi, single):
        manager = CheckpointManager(run_dir / "checkpoints", async_save=False)
        try:
            state, _ = manager.restore(trainer.abstract_state(), step=3)
        finally:
            manager.close()
        params.append(state["params"])
    for a, b in zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
