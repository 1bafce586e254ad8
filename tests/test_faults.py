"""Faults end with a clear message and no lost work: signals, kills mid-save, failed saves, NaN, bad input."""

import os
import re
import signal
import time

import pytest
from _procs import losses, start, wait_for_line

from train import train

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
    "0",
    "--warmup",
    "1",
]


def args_for(corpus, cache, *extra):
    return [*BASE, "--data", str(corpus), "--data-cache", str(cache), *extra]


def steps_saved(run_dir):
    folder = run_dir / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def snapshot(folder):
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_finishes_the_step_saves_and_exits_zero(tmp_path, corpus, cache, signum, capsys):
    run_dir = tmp_path / "run"
    log = tmp_path / "first.log"
    process = start(
        args_for(
            corpus, cache, "--steps", "1000", "--ckpt-every", "0", "--cpu-devices", "8", "--run-dir", str(run_dir)
        ),
        log,
    )
    wait_for_line(log, r"^step\s+3/1000", process)
    sent = time.monotonic()
    process.send_signal(signum)
    assert process.wait(timeout=120) == 0, log.read_text()
    seconds = time.monotonic() - sent
    text = log.read_text()
    match = re.search(rf"stopped by {signum.name}: the checkpoint of step (\d+) is complete in (\S+)", text)
    assert match, text
    stopped_at = int(match.group(1))
    assert stopped_at >= 3 and steps_saved(run_dir) == [stopped_at]
    assert seconds < 60

    capsys.readouterr()
    # The resume runs in this process (its 8 devices): what matters is the stopped run's folder, not a fresh process.
    code = train.main(args_for(corpus, cache, "--steps", str(stopped_at + 2), "--resume", "--run-dir", str(run_dir)))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert f"resumed step {stopped_at}" in captured.out
    assert set(losses(run_dir)) == set(range(1, stopped_at + 3))


@pytest.mark.slow
def test_kill_during_an_asynchronous_save_resumes_from_the_previous_step(tmp_path, corpus, cache, capsys):
    """Only the run that is killed runs in a process of its own; the runs before and after it run in this one."""
    run_dir = tmp_path / "run"
    common = ["--cpu-devices", "8", "--run-dir", str(run_dir)]
    assert train.main(args_for(corpus, cache, "--steps", "2", *common)) == 0
    assert steps_saved(run_dir) == [2]

    log = tmp_path / "b.log"
    process = start(args_for(corpus, cache, "--steps", "4", "--resume", *common), log, MESHWORK_TEST_SAVE_PAUSE=120)
    wait_for_line(log, r"^step\s+4/4", process)
    deadline = time.monotonic() + 60
    while not any("tmp" in p.name for p in (run_dir / "checkpoints").iterdir()):
        assert time.monotonic() < deadline, "the save of step 4 never started"
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert steps_saved(run_dir) == [2]  # step 4 was never committed

    capsys.readouterr()
    assert train.main(args_for(corpus, cache, "--steps", "4", "--resume", *common)) == 0
    assert "resumed step 2" in capsys.readouterr().out
    assert steps_saved(run_dir) == [2, 4]
    assert not any("tmp" in p.name for p in (run_dir / "checkpoints").iterdir())


def test_a_failed_asynchronous_save_stops_training_at_once(tmp_path, corpus, cache):
    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    process = start(
        args_for(
            corpus, cache, "--steps", "1000", "--ckpt-every", "2", "--cpu-devices", "8", "--run-dir", str(run_dir)
        ),
        log,
    )
    wait_for_line(log, r"^step\s+3/1000", process)
    # The checkpoint folder becomes unusable (as a full or read-only disk would make it).
    (run_dir / "checkpoints").rename(run_dir / "moved-away")
    (run_dir / "checkpoints").write_text("not a folder")
    assert process.wait(timeout=120) == 2, log.read_text()
    text = log.read_text()
    assert "error:" in text and "checkpoint" in text
    last = max(int(m) for m in re.findall(r"^step\s+(\d+)/1000", text, re.M))
    assert last <= 5, "training went on after the failed save"
    # A handled failure prints its own lines only: Orbax's threads' tracebacks go to the run folder's log.
    after = text.split(re.findall(r"^step\s+\d+/1000.*$", text, re.M)[-1])[1].strip().splitlines()
    assert 1 <= len(after) <= 5 and "Traceback" not in text, text
    # Whether Orbax's threads report the failure depends on where the save was when the folder went away: when
    # they do, their text is in the log and the error points to it; when not, it points to no file.
    library = run_dir / "library.log"
    if library.exists() and library.stat().st_size:
        assert f"Orbax's own messages are in {library}" in text
        assert "Traceback" in library.read_text()
    else:
        assert "library.log" not in text, text


def test_nonfinite_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path, corpus, cache, capsys):
    run_dir = tmp_path / "run"
    code = train.main(
        args_for(corpus, cache, "--steps", "6", "--ckpt-every", "1", "--lr", "1e30", "--run-dir", str(run_dir))
    )
    err = capsys.readouterr().err
    assert code == 1
    match = re.search(r"the loss or its gradient became non-finite at step (\d+)", err)
    assert match, err
    bad_step = int(match.group(1))
    assert steps_saved(run_dir) and max(steps_saved(run_dir)) < bad_step


def test_skip_nonfinite_skips_and_logs_up_to_n_steps(tmp_path, corpus, cache, capsys):
    run_dir = tmp_path / "run"
    code = train.main(
        args_for(corpus, cache, "--steps", "5", "--lr", "1e30", "--skip-nonfinite", "10", "--run-dir", str(run_dir))
    )
    out = capsys.readouterr().out
    assert code == 0
    skipped = re.findall(r"step (\d+): loss \S+ / grad norm \S+ is not finite; the update was skipped", out)
    assert skipped and int(skipped[0]) >= 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--mesh", "fsdp=3"], "--mesh 'fsdp=3': the sizes multiply to 3 but JAX sees 8 devices"),
        (
            ["--batch-size", "12"],
            "--batch-size 12 / --microbatches 1 = 12 sequences per microbatch, not divisible "
            "by the data-parallel size data x fsdp x expert = 8",
        ),
        (
            ["--batch-size", "16", "--microbatches", "3"],
            "--batch-size 16 is not divisible by --microbatches 3; e.g. --batch-size 24",
        ),  # 24 = 3 x 8 fits both
        (["--mesh", "data=8", "--logits", "vocab_parallel"], "--logits vocab_parallel does not apply here"),
        (["--rules", "dp", "--logits", "vocab_parallel"], "--logits vocab_parallel does not apply here"),
        (
            ["--mesh", "fsdp=4,sequence=2", "--seq-len", "63"],
            "--seq-len 63 is not divisible by the context x sequence axes (2)",
        ),
        (
            ["--mesh", "fsdp=2,tensor=4", "--set", "num_heads=6", "--set", "num_kv_heads=2"],
            "num_heads=6 cannot be split over tensor=4",
        ),
        (["--mesh", "fsdp=8", "--set", "embed_dim=100"], "embed_dim=100 cannot be split over fsdp=8"),
        (["--data", "/nonexistent/corpus"], "--data /nonexistent/corpus: no such file or folder"),
        (["--mesh-outer", "dta=2"], "unknown mesh axis 'dta'"),
        (["--coordinator", "127.0.0.1:1234"], "--num-processes, --process-id missing"),
        (
            ["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
            "--process-id 2: must be in 0..1",
        ),
        (["--skip-nonfinite", "-1"], "--skip-nonfinite -1"),
    ],
)
def test_bad_input_names_the_flag_before_any_device_work(tmp_path, corpus, cache, capsys, extra, message):
    code = train.main(args_for(corpus, cache, "--steps", "2", "--run-dir", str(tmp_path / "r"), *extra))
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # refused before the loop was set up
    assert steps_saved(tmp_path / "r") == []


def test_empty_data_folder_is_refused(tmp_path, cache, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "empty.txt").write_text("")
    code = train.main([*BASE, "--data", str(tmp_path / "data"), "--steps", "2", "--run-dir", str(tmp_path / "r")])
    assert code == 2 and "no non-empty files" in capsys.readouterr().err


def test_unwritable_run_folder_is_refused(tmp_path, corpus, cache, capsys):
    (tmp_path / "file").write_text("a file, not a folder")
    code = train.main(args_for(corpus, cache, "--steps", "2", "--run-dir", str(tmp_path / "file" / "run")))
    assert code == 2 and "--run-dir" in capsys.readouterr().err


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, corpus, cache):
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    assert train.main(args_for(corpus, cache, "--steps", "2", "--run-dir", str(run_dir))) == 0
    return run_dir


def test_another_runs_folder_is_never_overwritten(saved_run, corpus, cache, capsys):
    before = snapshot(saved_run)
    assert train.main(args_for(corpus, cache, "--steps", "4", "--run-dir", str(saved_run))) == 2
    assert "already holds checkpoints (latest step 2); pass --resume" in capsys.readouterr().err
    assert snapshot(saved_run) == before


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--set", "mlp_dim=256"], "mlp_dim (saved 384, now 256)"),
        (["--model", "small"], "num_layers (saved 4, now 6)"),
    ],
)
def test_resuming_with_another_model_is_refused(saved_run, corpus, cache, capsys, extra, message):
    before = snapshot(saved_run)
    code = train.main(args_for(corpus, cache, "--steps", "4", "--resume", "--run-dir", str(saved_run), *extra))
    assert code == 2 and message in capsys.readouterr().err
    assert snapshot(saved_run) == before


def test_resuming_with_another_tokenizer_is_refused(saved_run, corpus, cache, capsys, tmp_path):
    from test_data import make_hf_tokenizer

    tokenizer = make_hf_tokenizer(tmp_path / "tokenizer.json")
    before = snapshot(saved_run)
    code = train.main(
        args_for(corpus, cache, "--steps", "4", "--resume", "--run-dir", str(saved_run), "--tokenizer", str(tokenizer))
    )
    err = capsys.readouterr().err
    assert code == 2 and "vocabulary of 257 tokens" in err and "--tokenizer bytes" in err
    assert snapshot(saved_run) == before
