"""Records stay true: metrics after a resume, TensorBoard purge, the schedule, state bytes; the optional
experiment trackers (--wandb, --mlflow) get TensorBoard's scalars, and a missing one is named at parse time."""

import itertools
import json
import math
import shutil
import struct
import sys
import types

import jax
import pytest

from checkpoints.meta import RunMeta
from models.config import get_config
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Parallelism
from sharding.rules import get_rules
from train import train
from train.reports import report
from train.runtime import loop
from train.runtime.loop import MetricsWriter, truncate_metrics
from train.runtime.optimizer import OptimizerConfig, learning_rate_schedule
from train.runtime.step import Trainer
from train.setup.flagnames import render

BASE = [
    "--model",
    "test",
    "--seq-len",
    "64",
    "--batch-size",
    "8",
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--no-progress",
    "--eval-batches",
    "1",
    "--warmup",
    "1",
]


def reference_rate(step, lr, warmup, decay_steps, ratio=0.1):
    """The rate of (1-based) ``step``: linear warm-up to ``lr`` at ``warmup``, cosine to ``lr * ratio``."""
    if step <= warmup:
        return lr * step / warmup
    progress = min((step - warmup) / (decay_steps - warmup), 1.0)
    end = lr * ratio
    return end + (lr - end) * 0.5 * (1 + math.cos(math.pi * progress))


def test_warmup_starts_above_zero_and_follows_the_reference():
    config = OptimizerConfig(lr=2e-3, warmup=4, decay_steps=20)
    schedule = learning_rate_schedule(config)
    rates = [float(schedule(count)) for count in range(22)]  # update `count` trains step count + 1
    assert rates[0] == pytest.approx(2e-3 / 4, rel=1e-6)
    for count, rate in enumerate(rates):
        assert rate == pytest.approx(reference_rate(count + 1, 2e-3, 4, 20), rel=1e-5, abs=1e-12), count


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_after_the_restored_step_are_dropped_atomically(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "eval/loss": 5.0}] + [{"step": s, "train/loss": 6.0 - s} for s in range(1, 7)]
    lines += [{"step": 4, "eval/loss": 3.0}, {"step": 6, "eval/loss": 2.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 7, "train/lo')  # a torn last line
    dropped, present = truncate_metrics(path, 4)
    assert dropped == 4  # steps 5, 6, eval 6 and the torn line
    assert [r["step"] for r in records(path)] == [0, 1, 2, 3, 4, 4]
    assert present == {"train", "eval"}
    assert not list(tmp_path.glob(".metrics.jsonl.tmp*"))


def tensorboard_events(folder):
    """Every event of the event files under ``folder`` (TFRecord framing: length, CRC, data, CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for file in sorted(folder.rglob("events.out.tfevents.*")):
        data, offset = file.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = Event()
            event.ParseFromString(data[offset + 12 : offset + 12 + length])
            events.append(event)
            offset += 12 + length + 4
    return events


@pytest.mark.parametrize("serial", [0, 9])  # 9: the two writers' serials cross a digit (9, 10)
def test_a_resumed_writer_purges_later_tensorboard_events_and_writes_no_duplicates(tmp_path, monkeypatch, serial):
    monkeypatch.setattr(loop, "_WRITER_SERIAL", itertools.count(serial))
    first = MetricsWriter(tmp_path, enabled=True)
    for step in range(0, 7):
        first.write(step, {"loss": 1.0}, prefix="eval" if step in (0, 4) else "train")
    first.close()
    resumed = MetricsWriter(tmp_path, enabled=True, restored_step=4)
    resumed.write(4, {"loss": 9.0}, prefix="eval")  # the resumed run evaluates step 4 again: kept once
    resumed.write(5, {"loss": 0.5})
    resumed.close()
    steps = [(r["step"], next(k for k in r if "/" in k)) for r in records(tmp_path / "metrics.jsonl")]
    assert steps == [
        (0, "eval/loss"),
        (1, "train/loss"),
        (2, "train/loss"),
        (3, "train/loss"),
        (4, "eval/loss"),
        (5, "train/loss"),
    ]
    events = tensorboard_events(tmp_path / "tensorboard")
    # Each session opens with a purge mark (TensorBoard drops earlier sessions' events from that step on):
    # step 0 for the fresh start, step 5 for the resume. Both files survive, even when the two writers
    # open in the same second (tensorboardX names files by the second).
    assert [e.step for e in events if e.HasField("session_log")] == [0, 5]
    scalars = [(e.step, e.summary.value[0].simple_value) for e in events if e.HasField("summary")]
    assert scalars == [(s, 1.0) for s in range(7)] + [(5, 0.5)]


def test_the_per_expert_share_is_a_tensorboard_histogram(tmp_path):
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write(3, {"loss": 1.0, "moe_expert_share": [1.5, 0.5, 1.0, 1.0]})
    writer.close()
    (record,) = records(tmp_path / "metrics.jsonl")
    assert record["train/moe_expert_share"] == [1.5, 0.5, 1.0, 1.0]
    values = [v for e in tensorboard_events(tmp_path / "tensorboard") if e.HasField("summary") for v in e.summary.value]
    assert [v.tag for v in values if v.HasField("simple_value")] == ["train/loss"]  # no scalar per expert
    (histogram,) = [v for v in values if v.HasField("histo")]
    assert histogram.tag == "train/moe_expert_share"
    assert (histogram.histo.num, histogram.histo.min, histogram.histo.max, histogram.histo.sum) == (4, 0.5, 1.5, 4.0)


class _Recorder:
    """Stands in for the wandb and mlflow modules: records the calls `MetricsWriter`'s trackers make."""

    def __init__(self):
        self.calls = []

    def module(self, name, functions):
        module = types.ModuleType(name)
        for function in functions:
            setattr(module, function, lambda *a, _f=f"{name}.{function}", **k: self.calls.append((_f, a, k)) or self)
        return module

    def log(self, *a, **k):  # a wandb run's
        self.calls.append(("run.log", a, k))

    def finish(self):
        self.calls.append(("run.finish", (), {}))


def test_trackers_get_tensorboards_scalars_at_its_steps(tmp_path, monkeypatch):
    recorder = _Recorder()
    monkeypatch.setitem(sys.modules, "wandb", recorder.module("wandb", ["init"]))
    mlflow_functions = ["set_tracking_uri", "start_run", "log_params", "log_metrics", "end_run"]
    monkeypatch.setitem(sys.modules, "mlflow", recorder.module("mlflow", mlflow_functions))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    writer = MetricsWriter(run_dir, enabled=True, trackers=("wandb", "mlflow"), config={"lr": 0.003, "mesh": "fsdp=8"})
    writer.write(1, {"loss": 2.5, "processed": [3, 1]})
    writer.write(1, {"loss": 2.25}, prefix="eval")
    writer.close()
    scalars = [{"train/loss": 2.5, "train/processed/0": 3, "train/processed/1": 1}, {"eval/loss": 2.25}]
    assert recorder.calls == [
        (
            "wandb.init",
            (),
            {"name": "my-run", "group": "my-run", "dir": str(run_dir), "config": {"lr": 0.003, "mesh": "fsdp=8"}},
        ),
        ("mlflow.set_tracking_uri", (f"sqlite:///{(run_dir / 'mlflow.db').resolve()}",), {}),
        ("mlflow.start_run", (), {"run_name": "my-run", "tags": {"meshwork.run_dir": str(run_dir.resolve())}}),
        ("mlflow.log_params", ({"lr": "0.003", "mesh": "fsdp=8"},), {}),
        ("run.log", (scalars[0],), {"step": 1}),
        ("mlflow.log_metrics", (scalars[0],), {"step": 1}),
        ("run.log", (scalars[1],), {"step": 1}),
        ("mlflow.log_metrics", (scalars[1],), {"step": 1}),
        ("run.finish", (), {}),
        ("mlflow.end_run", (), {}),
    ]
    assert [
        json.loads(line)["train/processed"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()[:1]
    ] == [[3, 1]]


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_is_named_with_its_extra_before_anything_runs(
    tmp_path, monkeypatch, capsys, name
):
    monkeypatch.setitem(sys.modules, name, None)  # importlib finds no such package
    run_dir = tmp_path / "r"
    code = train.main([*BASE, "--data", "stdlib", f"--{name}", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and err == (
        f"error: --{name}: the {name} package is not installed; pip install 'meshwork[{name}]' (or leave out --{name})\n"
    )
    assert not run_dir.exists()


def test_schedule_is_recorded_and_a_change_is_one_line():
    config = get_config("test")
    meta = RunMeta(
        model=config.to_dict(),
        preset="test",
        mesh={},
        rules={},
        data={},
        tokenizer={},
        schedule={"steps": 10, "decay_steps": 10, "warmup": 1, "lr": 3e-3},
        step=6,
    )
    back = RunMeta.from_json(json.loads(json.dumps(meta.to_json())))
    assert back.schedule == meta.schedule
    assert back.schedule_change({"steps": 10, "decay_steps": 10, "warmup": 1, "lr": 3e-3}, 6) is None
    line = render(back.schedule_change({"steps": 20, "decay_steps": 20, "warmup": 1, "lr": 3e-3}, 6))
    assert line == (
        "note: the learning-rate schedule changes at step 6: --steps 10 -> 20, --decay-steps 10 -> 20 "
        "(the rate of every later step follows the new schedule)"
    )
    old = {k: v for k, v in meta.to_json().items() if k != "schedule"}  # a checkpoint from before the record
    assert RunMeta.from_json(old).schedule_change({"steps": 20}, 6) is None


def test_a_changed_batch_shape_is_said_on_resume():
    from checkpoints.meta import RunMeta
    from models.config import get_config

    data = {"seq_len": 64, "global_batch": 8, "samples": 48}
    meta = RunMeta(
        model=get_config("test").to_dict(), preset="test", mesh={}, rules={}, data=data, tokenizer={}, step=6
    )
    assert meta.batch_change(64, 8, 6) is None
    assert render(meta.batch_change(128, 4, 6)) == (
        "note: the batch changes at step 6: --seq-len 64 -> 128, --batch-size 8 -> 4 (the data read on from "
        "the 48 sequences consumed; tokens per step change)"
    )
    assert RunMeta.from_json({"model": meta.model, "step": 6}).batch_change(128, 4, 6) is None  # nothing recorded


def test_resume_after_a_lost_checkpoint_keeps_each_step_once_and_says_the_schedule_and_batch_changed(
    tmp_path, corpus, cache, capsys
):
    run_dir = tmp_path / "run"
    common = [*BASE, "--data", str(corpus), "--data-cache", str(cache), "--run-dir", str(run_dir)]
    assert train.main([*common, "--steps", "4", "--ckpt-every", "2"]) == 0
    shutil.rmtree(run_dir / "checkpoints" / "4")  # as if the run had died before saving step 4
    capsys.readouterr()
    assert train.main([*common, "--steps", "6", "--ckpt-every", "2", "--resume", "--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "resumed step 2" in out
    assert "note: the learning-rate schedule changes at step 2: --steps 4 -> 6, --decay-steps 4 -> 6" in out
    assert "note: the batch changes at step 2: --batch-size 8 -> 16 (the data read on from the 16 sequences" in out
    train_steps = [r["step"] for r in records(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert train_steps == [1, 2, 3, 4, 5, 6]
    eval_steps = [r["step"] for r in records(run_dir / "metrics.jsonl") if "eval/loss" in r]
    assert eval_steps == [0, 2, 6]  # step 4's evaluation belonged to the lost steps


@pytest.mark.parametrize("rules, share", [("fsdp", 1 / 8), ("dp", 1.0)])
def test_per_device_state_bytes_come_from_the_shardings(rules, share):
    trainer = Trainer(
        get_config("test"),
        OptimizerConfig(),
        Parallelism.of(make_mesh(parse_mesh("fsdp=8" if rules == "fsdp" else "data=8", 8)), get_rules(rules)),
    )
    abstract = trainer.abstract_state()
    total, held = report.state_bytes(abstract), report.device_state_bytes(abstract)
    reference = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.init_state(0)))
    assert total == reference
    local = sum(
        s.data.size * s.data.dtype.itemsize
        for x in jax.tree.leaves(trainer.init_state(0))
        for s in x.addressable_shards
        if s.device == jax.devices()[0]
    )
    assert held == local
    assert held == pytest.approx(total * share, rel=0.02)
