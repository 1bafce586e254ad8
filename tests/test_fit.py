"""Fit checked before the first step, with injected small memory budgets."""

import time
import types

import pytest

from sharding.devices import device_memory, host_available_bytes
from train import train
from train.reports import fit
from train.setup.cli import parse

BASE = [
    "--model",
    "test",
    "--seq-len",
    "64",
    "--batch-size",
    "8",
    "--steps",
    "2",
    "--no-progress",
    "--eval-batches",
    "0",
]


def fake_compiled(arguments, outputs, aliased, temporaries):
    stats = types.SimpleNamespace(
        argument_size_in_bytes=arguments,
        output_size_in_bytes=outputs,
        alias_size_in_bytes=aliased,
        temp_size_in_bytes=temporaries,
    )
    return types.SimpleNamespace(memory_analysis=lambda: stats)


def with_budget(argv, budget):
    run = parse(argv)
    return run.replace(
        cluster=run.cluster.__class__(
            **{**vars(run.cluster), "device_memory": budget, "device_memory_source": "a test budget"}
        )
    )


def test_the_compiled_peak_is_arguments_plus_outputs_minus_aliased_plus_temporaries():
    compiled = fake_compiled(1000, 600, 500, 400)
    assert fit.step_peak(compiled) == 1500
    run = with_budget([*BASE, "--mesh", "data=8", "--rules", "dp"], 1500)
    assert fit.check_compiled(run, compiled).startswith("fit: the step's peak")
    with pytest.raises(ValueError) as e:
        fit.check_compiled(with_budget([*BASE, "--mesh", "data=8", "--rules", "dp"], 1499), compiled)
    message = str(e.value)
    assert (
        "its peak is 1.46 KiB per device" in message
        and "1.46 KiB of a test budget" in message
        and "a test budget" in message
    )
    assert "--remat full" in message and "more fsdp (e.g. --mesh fsdp=8)" in message
    assert "--microbatches 2" not in message  # 8 rows over data=8: one row per device cannot halve


def test_remedies_never_repeat_the_values_in_use():
    run = parse([*BASE, "--remat", "full", "--mesh", "fsdp=8", "--batch-size", "32"])
    text = fit.remedies(run)
    assert "--remat" not in text and "--mesh" not in text
    assert "--microbatches 2" in text and "e.g. 16" in text


def test_a_huge_vocabulary_is_refused_before_anything_is_built(tmp_path, corpus, cache, capsys):
    t0 = time.monotonic()
    code = train.main(
        [
            *BASE,
            "--data",
            str(corpus),
            "--data-cache",
            str(cache),
            "--run-dir",
            str(tmp_path / "r"),
            "--set",
            "vocab_size=1000000000",
        ]
    )
    seconds = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 2 and "the model cannot fit: 256,000," in err and "--set vocab_size" in err
    assert seconds < 20, seconds
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_step_that_cannot_fit_is_refused_before_the_first_step(tmp_path, corpus, cache, capsys):
    run_dir = tmp_path / "r"
    code = train.main(
        [
            *BASE,
            "--data",
            str(corpus),
            "--data-cache",
            str(cache),
            "--run-dir",
            str(run_dir),
            "--batch-size",
            "64",
            "--device-memory",
            "2MiB",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error: the train step cannot fit: its peak is" in err and "more than the 2.00 MiB of --device-memory" in err
    assert "--remat full" in err and "--microbatches 2" in err and "a smaller --batch-size (e.g. 32)" in err
    assert "train/loss" not in (run_dir / "metrics.jsonl").read_text()  # no step ran
    assert not any((run_dir / "checkpoints").glob("[0-9]*"))


@pytest.mark.parametrize("budget, verdict, code", [(None, "fit: the step's peak", 0), ("3MiB", "fit: DOES NOT FIT", 2)])
def test_dry_run_prints_the_verdict(capsys, budget, verdict, code):
    extra = [] if budget is None else ["--device-memory", budget]
    assert train.main([*BASE, "--dry-run", *extra]) == code
    out = capsys.readouterr().out
    assert verdict in out
    assert "per device as sharded" in out


def test_device_memory_prefers_the_allocator_then_the_datasheet_then_the_host(tmp_path, monkeypatch):
    class Device:
        def __init__(self, kind, platform, limit=None):
            self.device_kind, self.platform, self._limit = kind, platform, limit

        def memory_stats(self):
            return {"bytes_limit": self._limit} if self._limit else None

    assert device_memory([Device("NVIDIA H200", "gpu", 100), Device("NVIDIA H200", "gpu", 90)])[0] == 90
    size, source = device_memory([Device("NVIDIA H100 80GB HBM3", "gpu")])
    assert size == 80 * 2**30 and "datasheet" in source  # HBM sizes are binary: '80GB' of HBM is 80 GiB
    # The host's available memory, fixed: read live twice it moves between the reads (other processes
    # allocate), and the split is what is checked here; the reader itself is checked on a file below.
    monkeypatch.setattr("sharding.devices.detect.host_available_bytes", lambda: 15 * 2**30)
    size, source = device_memory([Device("cpu", "cpu")] * 4)
    assert size == 15 * 2**30 // 4 and "shared by 4 CPU devices" in source
    monkeypatch.undo()
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemAvailable:     512 kB\n")
    assert host_available_bytes(str(meminfo)) == 512 * 1024
