"""A run folder is owned by one run, a resume below later steps loses nothing, damaged array data falls back.

One trainer run (steps 1, 2, 3, each saved) is shared by the module; each test works on a copy of it.
"""

import io
import json
import re
import shutil
import socket
import subprocess
import sys
import time
from contextlib import redirect_stderr

import pytest
from _procs import start, wait_for_line
from test_faults import args_for, snapshot, steps_saved

from checkpoints.lock import LOCK_FILE
from checkpoints.verify import _walk_index, verify_step
from train import train


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory, corpus, cache):
    """A run folder with steps 1, 2, 3; while its trainer ran, a second run on the folder was refused.

    The trainer's saves are held open until the test lets them commit (``MESHWORK_TEST_SAVE_UNTIL``), so the
    second run starts while the first holds the folder with its save of step 1 in progress; that run's exit
    code and error are returned with the folder.
    """
    root = tmp_path_factory.mktemp("owned")
    run_dir = root / "run"
    log = root / "first.log"
    gate = root / "commit"
    first = start(
        args_for(
            corpus,
            cache,
            "--steps",
            "3",
            "--ckpt-every",
            "1",
            "--keep",
            "5",
            "--cpu-devices",
            "8",
            "--run-dir",
            str(run_dir),
        ),
        log,
        MESHWORK_TEST_SAVE_UNTIL=gate,
    )
    try:
        wait_for_line(log, r"^step\s+1/3", first)
        deadline = time.monotonic() + 120
        while not any("tmp" in p.name for p in (run_dir / "checkpoints").iterdir()):
            assert time.monotonic() < deadline and first.poll() is None, log.read_text()
            time.sleep(0.05)
        owner = json.loads((run_dir / LOCK_FILE).read_text())
        err = io.StringIO()
        with redirect_stderr(err):
            second = train.main(args_for(corpus, cache, "--steps", "5", "--resume", "--run-dir", str(run_dir)))
        assert steps_saved(run_dir) == []  # the first run's save of step 1 was still in progress
        gate.touch()
        assert first.wait(timeout=180) == 0, log.read_text()
    finally:
        if first.poll() is None:
            first.kill()
    assert steps_saved(run_dir) == [1, 2, 3] and not (run_dir / LOCK_FILE).exists()
    return run_dir, {"pid": first.pid, "owner": owner, "code": second, "err": err.getvalue()}


@pytest.fixture
def copy(three_steps, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(three_steps[0], target)
    return target


def test_a_second_run_on_a_folder_in_use_is_refused_before_anything_is_touched(three_steps):
    run_dir, second = three_steps
    assert second["owner"]["pid"] == second["pid"] and second["owner"]["host"] == socket.gethostname()
    assert second["code"] == 2
    (line,) = second["err"].strip().splitlines()
    assert line == (
        f"error: --run-dir {run_dir} is in use by another run, pid {second['pid']} on host "
        f"{socket.gethostname()} (since {second['owner']['since']}); wait for it to end (or stop it), "
        "or choose another --run-dir (nothing was touched)"
    )
    # Nothing was touched: opening the checkpoints would have cleaned up the first run's save in progress
    # (it then fails) and a resume would have cut its records back; it ended well, with every step and record.
    assert steps_saved(run_dir) == [1, 2, 3] and all(
        verify_step(run_dir / "checkpoints", s, deep=True).ok for s in (1, 2, 3)
    )
    assert records(run_dir)[-1] == 3 and {1, 2, 3} <= set(records(run_dir))


def test_a_stale_lock_is_reclaimed_with_a_line(copy, corpus, cache, capsys):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    (copy / LOCK_FILE).write_text(
        json.dumps({"host": socket.gethostname(), "pid": ended.pid, "started": 1, "since": "2026-01-01T00:00:00Z"})
    )
    assert train.main(args_for(corpus, cache, "--steps", "3", "--resume", "--run-dir", str(copy))) == 0
    out = capsys.readouterr().out
    assert (
        f"note: --run-dir {copy}: reclaimed the stale lock of pid {ended.pid} on host {socket.gethostname()} "
        "(since 2026-01-01T00:00:00Z), which has ended"
    ) in out
    assert "resumed step 3" in out and not (copy / LOCK_FILE).exists()  # released at the end


def test_a_lock_held_on_another_host_is_refused_unless_broken(copy, corpus, cache, capsys):
    (copy / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": "2026-01-01T00:00:00Z"}))
    before = snapshot(copy)
    assert train.main(args_for(corpus, cache, "--steps", "3", "--resume", "--run-dir", str(copy))) == 2
    err = capsys.readouterr().err
    assert "is locked by pid 1 on host elsewhere" in err and "pass --break-lock" in err and err.count("\n") == 1
    assert snapshot(copy) == before
    assert train.main(args_for(corpus, cache, "--steps", "3", "--resume", "--break-lock", "--run-dir", str(copy))) == 0
    assert "--break-lock took over the lock of pid 1 on host elsewhere" in capsys.readouterr().out


def records(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_step_below_later_steps_is_refused_without_discard_later(copy, corpus, cache, capsys):
    before = snapshot(copy)
    code = train.main(args_for(corpus, cache, "--steps", "3", "--resume", "--resume-step", "1", "--run-dir", str(copy)))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: --resume-step 1: {copy / 'checkpoints'} holds later steps (2, 3)")
    assert err.rstrip().endswith(
        "pass --discard-later to set them aside (renamed, nothing deleted), or "
        "--resume-step 3 to continue from the newest"
    )
    assert snapshot(copy) == before  # records not truncated, nothing renamed
    assert train.main(args_for(corpus, cache, "--steps", "3", "--discard-later", "--run-dir", str(copy))) == 2
    assert "--discard-later: applies with --resume --resume-step N" in capsys.readouterr().err


def test_discard_later_sets_the_later_steps_aside_then_truncates_the_records(copy, corpus, cache, capsys):
    kept = (copy / "metrics.jsonl").read_bytes()
    assert max(records(copy)) == 3
    code = train.main(
        args_for(
            corpus,
            cache,
            "--steps",
            "2",
            "--ckpt-every",
            "1",
            "--resume",
            "--resume-step",
            "1",
            "--discard-later",
            "--run-dir",
            str(copy),
        )
    )
    out = capsys.readouterr().out
    assert code == 0, out
    folder = copy / "checkpoints"
    aside = sorted(p.name.split("-")[0] for p in folder.iterdir() if ".discarded-" in p.name)
    assert aside == ["2.discarded", "3.discarded"] and steps_saved(copy) == [1, 2]  # step 2 saved anew, no collision
    for step in (3, 2):
        (path,) = [p for p in folder.iterdir() if p.name.startswith(f"{step}.discarded-")]
        assert f"--discard-later: set step {step} aside as {path} (not resumed from" in out
        assert (path / "state" / "manifest.ocdbt").is_file()  # renamed, nothing deleted
    (copied,) = [p for p in copy.iterdir() if p.name.startswith("metrics.jsonl.discarded-")]
    assert copied.read_bytes() == kept and f"copied {copy / 'metrics.jsonl'} to {copied}" in out
    assert "resumed step 1" in out and max(records(copy)) == 2 and 3 not in records(copy)


def damage_a_data_file(state, process: int = 0):
    """Inverts the first 32 bytes (the zstd frame header of the chunk stored first) of the data file of
    ``process`` holding most chunks; returns the file and its new bytes."""
    _, references = _walk_index(state)
    mine = f"ocdbt.process_{process}/d/"
    damaged = state / max(references, key=lambda f: (f.startswith(mine), len(references[f])))
    assert damaged.relative_to(state).as_posix().startswith(mine), references
    data = bytearray(damaged.read_bytes())
    data[:32] = bytes(b ^ 0xFF for b in data[:32])
    damaged.write_bytes(bytes(data))
    return damaged, bytes(data)


def test_flipped_bytes_in_an_array_data_file_fall_back_to_the_older_step(copy, corpus, cache, capsys):
    """The user's report: flipped bytes in state/ocdbt.process_0/d/ ended a resume in hundreds of lines of
    Orbax tracebacks; now the step is set aside with one line naming the file, and step 2 resumes."""
    state = copy / "checkpoints" / "3" / "state"
    damaged, data = damage_a_data_file(state)
    code = train.main(args_for(corpus, cache, "--steps", "4", "--resume", "--run-dir", str(copy)))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "Traceback" not in captured.err
    (line,) = [line for line in captured.out.splitlines() if "is damaged" in line]
    (aside,) = [p for p in (copy / "checkpoints").iterdir() if p.name.startswith("3.damaged-")]
    assert re.match(
        rf"step 3 in {re.escape(str(copy / 'checkpoints'))} is damaged: array '[^']+' chunk \S+ in data "
        rf"file {re.escape(str(damaged))} does not decode \(",
        line,
    ), line
    assert line.endswith(f"set it aside as {aside} (not resumed from, not counted by --keep); resuming from step 2")
    # the resume keeps the run's --ckpt-every 1 (from its record): step 3 is trained and saved again
    assert "resumed step 2" in captured.out and steps_saved(copy) == [1, 2, 3, 4]
    assert (aside / damaged.relative_to(state.parent)).read_bytes() == data  # kept as it was


def test_export_of_a_step_with_damaged_data_is_one_line_naming_the_file_and_renames_nothing(copy, capsys, tmp_path):
    from train import hf as hf_cli

    damaged, _ = damage_a_data_file(copy / "checkpoints" / "3" / "state")
    before = snapshot(copy)
    assert hf_cli.main(["export", str(copy), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: --step 3: step 3 in {copy / 'checkpoints'} is damaged: array '"), line
    assert f"in data file {damaged} does not decode" in line and line.endswith("; pass --step 2")
    assert snapshot(copy) == before


def test_a_reader_leaves_a_live_runs_save_in_progress(copy):
    """generate, evaluate and export open the checkpoints read-only: Orbax's clean-up of unfinished saves
    (right for the run that owns the folder) would delete the save a live run is writing."""
    from train.runtime.inference import read_run

    in_progress = copy / "checkpoints" / "4.orbax-checkpoint-tmp-1700000000"
    in_progress.mkdir()
    manager, step, _ = read_run(copy)
    manager.close()
    assert step == 3 and in_progress.is_dir()


def test_import_into_a_folder_another_run_holds_is_refused_unless_broken(tmp_path, capsys):
    from test_hf import FIXTURES

    from train import hf as hf_cli

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": "2026-01-01T00:00:00Z"}))
    command = ["import", str(FIXTURES / "llama_gqa"), "--run-dir", str(run_dir), "--mesh", "fsdp=8"]
    assert hf_cli.main(command) == 2
    err = capsys.readouterr().err
    assert "is locked by pid 1 on host elsewhere" in err and "pass --break-lock" in err and err.count("\n") == 1
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]
    assert hf_cli.main([*command, "--break-lock"]) == 0  # the suggestion, taken
    captured = capsys.readouterr()
    assert "--break-lock took over the lock of pid 1 on host elsewhere" in captured.err
    assert (run_dir / "checkpoints" / "0").is_dir() and not (run_dir / LOCK_FILE).exists()  # released at the end
