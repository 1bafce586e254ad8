"""Processes agree on their compiled step's collectives before the first step (`train.runtime.agreement`)."""

import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from _procs import ROOT, clean_env, free_port

from models.config import get_config
from sharding import hlo
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Parallelism
from train.runtime import agreement
from train.runtime.optimizer import OptimizerConfig
from train.runtime.step import Trainer


class FakeClient:
    """The key-value store and barrier of JAX's distributed client, in one process."""

    def __init__(self):
        self.store: dict[str, str] = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.store
        self.store[key] = value

    def blocking_key_value_get(self, key, timeout_in_ms):
        return self.store[key]

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]

    def wait_at_barrier(self, barrier_id, timeout_in_ms):
        pass


@pytest.fixture(scope="module")
def step_text():
    trainer = Trainer(
        get_config("test", ["num_layers=1"]),
        OptimizerConfig(),
        Parallelism.of(make_mesh(parse_mesh("data=2,fsdp=4", 8)), "fsdp"),
    )
    return trainer.compile_train_step(8, 32).as_text()


def _publish(client, process, text, kinds):
    return agreement.check_same_collectives(
        text, client=client, process_index=process, process_count=len(kinds), kinds=kinds, timeout_s=1
    )


def test_the_schedule_lists_every_collective_in_order_with_its_groups(step_text):
    schedule = hlo.collective_schedule(step_text)
    assert len(schedule) == len(hlo.collectives(step_text))
    assert [line.split()[0] for line in schedule] == [c.op for c in hlo.collectives(step_text)]
    assert all(" groups=" in line and not line.endswith("groups=") for line in schedule)


def _store(client, process, text):
    """What process ``process`` publishes before the barrier (the other process of a two-process check)."""
    schedule = hlo.collective_schedule(text)
    client.key_value_set(f"meshwork/collectives/train/lines/{process}", "\n".join(schedule))
    client.key_value_set(f"meshwork/collectives/train/print/{process}", json.dumps(agreement.fingerprint(schedule)))


def test_matching_processes_agree_and_a_different_schedule_stops_every_one_naming_the_first_difference(step_text):
    kinds = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]
    client = FakeClient()
    _store(client, 1, step_text)
    assert "the 2 processes compiled the same" in _publish(client, 0, step_text, kinds)

    lines = step_text.splitlines()
    at = next(i for i, line in enumerate(lines) if " all-reduce(" in line)
    swapped = "\n".join(lines[:at] + [lines[at].replace(" all-reduce(", " all-gather(")] + lines[at + 1 :])
    index = [line.split()[0] for line in hlo.collective_schedule(step_text)].index("all-reduce")
    for process, text, other, other_text in ((0, step_text, 1, swapped), (1, swapped, 0, step_text)):
        client = FakeClient()
        _store(client, other, other_text)
        with pytest.raises(agreement.CollectiveMismatchError) as caught:  # each process stops with the same line
            _publish(client, process, text, kinds)
        message = str(caught.value)
        assert (
            f"process 0 ({kinds[0]}) and process 1 ({kinds[1]}) differ first at collective #{index}: 'all-reduce "
            in message
        )
        assert "against 'all-gather " in message and "docs/heterogeneous.md" in message


def test_mixed_kinds_compile_with_options_this_jaxlib_accepts():
    assert agreement.mixed_kind_options(["a", "a"]) == {}
    options = agreement.mixed_kind_options(["NVIDIA H100", "NVIDIA A100"])
    assert options == agreement.MIXED_KIND_OPTIONS
    compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile(options)  # an unknown option is refused
    assert compiled(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]


@pytest.mark.slow
def test_a_process_compiling_other_collectives_stops_both_before_step_one(tmp_path, corpus, cache):
    """Two gloo processes, one of them with an extra collective in its step (`_perturbed_train.py`): both
    exit 2 with the mismatch line before any step."""
    port = free_port()
    common = ["--model", "test", "--set", "num_layers=1", "--seq-len", "32", "--batch-size", "8", "--steps", "2"]
    common += ["--mesh", "data=2,fsdp=4", "--mesh-outer", "data=2", "--no-progress", "--eval-every", "0"]
    common += ["--data", str(corpus), "--data-cache", str(cache), "--run-dir", str(tmp_path / "run")]
    procs = []
    for i, entry in enumerate((["-m", "train.train"], [str(ROOT / "tests" / "_perturbed_train.py")])):
        flags = ["--cpu-devices", "4", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
        flags += ["--process-id", str(i), "--dist-timeout", "60"]
        log = open(tmp_path / f"p{i}.log", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, *entry, *common, *flags],
                cwd=ROOT,
                env=clean_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, code in enumerate(codes):
        text = (tmp_path / f"p{i}.log").read_text()
        assert code == 2, text
        (line,) = [line for line in text.splitlines() if line.startswith("error:")]
        assert "compiled different collective schedules" in line and "(cpu) and process 1 (cpu) differ first" in line, (
            text
        )
        assert "Traceback" not in text and not re.search(r"^step\s+\d+/", text, re.M)  # no step ran
    assert not list((tmp_path / "run").glob("checkpoints/[0-9]*"))  # nothing saved
