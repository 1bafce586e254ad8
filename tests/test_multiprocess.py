"""Two processes of 4 CPU devices (gloo collectives, coordinator on 127.0.0.1) against one of 8."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest

from _procs import free_port, losses, run, start
from checkpoints.manager import CheckpointManager
from models.config import get_config
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Parallelism
from sharding.rules import get_rules
from train.data import load_dataset
from train.optimizer import OptimizerConfig
from train.step import Trainer
from train.tokenizer import ByteTokenizer

pytestmark = pytest.mark.slow  # two gloo processes: tens of seconds

COMMON = ["--model", "test", "--seq-len", "64", "--batch-size", "8", "--mesh", "data=2,fsdp=4",
          "--mesh-outer", "data=2", "--warmup", "2", "--decay-steps", "20", "--eval-every", "0",
          "--log-every", "1", "--ckpt-every", "5", "--no-progress", "--eval-batches", "1"]


def two_processes(args, logs: Path, timeout=300):
    port = free_port()
    procs = [
        start([*args, "--cpu-devices", "4", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
               "--process-id", str(i), "--dist-timeout", "120"], logs / f"p{i}.log")
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
    base = tmp_path_factory.mktemp("mp")
    data = ["--data", str(corpus), "--data-cache", str(cache)]
    multi, single = base / "multi", base / "single"
    two_processes([*COMMON, *data, "--steps", "10", "--run-dir", str(multi)], base)
    two_processes([*COMMON, *data, "--steps", "20", "--resume", "--run-dir", str(multi)], base)
    code = run([*COMMON, *data, "--steps", "20", "--cpu-devices", "8", "--run-dir", str(single)], base / "single.log")
    assert code == 0, (base / "single.log").read_text()
    return base, multi, single


def test_two_processes_train_and_resume_with_the_losses_of_one(runs):
    base, multi, single = runs
    multi_losses, single_losses = losses(multi), losses(single)
    assert sorted(multi_losses) == sorted(single_losses) == list(range(1, 21))
    np.testing.assert_allclose([multi_losses[s] for s in range(1, 21)], [single_losses[s] for s in range(1, 21)],
                               rtol=1e-5)
    p0, p1 = (base / "p0.log").read_text(), (base / "p1.log").read_text()
    assert "process 0 of 2" in p0 and "resumed step 10" in p0
    assert "step     20/20" in p0
    assert not re.search(r"^step\s+\d+/", p1, re.M)  # only process 0 prints
    assert "axes crossing processes: data (over 2)" in p0


def test_the_two_process_checkpoint_restores_in_one_process(runs, corpus, cache):
    """Step 15 restored in one 8-device process reproduces the two-process run's loss at step 16."""
    _, multi, _ = runs
    mesh = make_mesh(parse_mesh("fsdp=8", 8))
    trainer = Trainer(get_config("test"), OptimizerConfig(warmup=2, decay_steps=20), Parallelism.of(mesh, "fsdp_tp"))
    manager = CheckpointManager(multi / "checkpoints", async_save=False)
    try:
        assert manager.all_steps() == [10, 15, 20]
        state, meta = manager.restore(trainer.abstract_state(), step=15)
    finally:
        manager.close()
    assert meta["step"] == 15 and meta["data"]["samples"] == 120 and meta["mesh"]["data"] == 2
    assert int(state["step"]) == 15
    assert {d.id for d in state["params"]["unembed"].sharding.device_set} == {d.id for d in jax.devices()}

    dataset = load_dataset(str(corpus), ByteTokenizer(), 64, 8, seed=0, heldout=0.01, cache_dir=cache)
    batch = dataset.train_rows(meta["data"]["samples"], range(0, 8))
    loss_sum, weight = jax.jit(trainer.loss_sums)(state["params"], batch)
    np.testing.assert_allclose(float(loss_sum / weight), losses(multi)[16], rtol=1e-5)
