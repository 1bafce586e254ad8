"""The run-folder lock: one owner, stale locks reclaimed, another host's lock refused unless broken."""

import json
import os
import socket
import subprocess
import sys

import pytest
from _cli_errors import as_printed, raises_as_cli

from checkpoints.lock import LOCK_FILE, RunFolderLocked, RunLock, _start_time
from train.setup.flagnames import render

HOST = socket.gethostname()


def plant(folder, **owner):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_FILE).write_text(json.dumps({"since": "2026-01-01T00:00:00Z", **owner}))


@pytest.fixture
def live():
    """A process that runs for the test."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_the_lock_names_its_owner_and_is_released(tmp_path):
    lines = []
    with RunLock.acquire(tmp_path / "run", as_printed(lines)) as lock:
        owner = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
        assert owner["host"] == HOST and owner["pid"] == os.getpid() and owner == lock.owner
        with pytest.raises(RunFolderLocked, match=rf"is in use by another run, pid {os.getpid()} on host "):
            RunLock.acquire(tmp_path / "run", as_printed(lines))  # one owner, even within one process
    assert sorted(os.listdir(tmp_path / "run")) == [] and lines == []


def test_a_live_owner_refuses_and_an_ended_one_is_reclaimed(tmp_path, live):
    folder = tmp_path / "run"
    plant(folder, host=HOST, pid=live.pid, started=_start_time(live.pid))
    with pytest.raises(RunFolderLocked) as refused:
        RunLock.acquire(folder, print)
    assert render(refused.value) == (
        f"--run-dir {folder} is in use by another run, pid {live.pid} on host {HOST} "
        "(since 2026-01-01T00:00:00Z); wait for it to end (or stop it), or choose another "
        "--run-dir (nothing was touched)"
    )
    live.kill()
    live.wait()
    lines = []
    RunLock.acquire(folder, as_printed(lines)).release()
    assert lines == [
        f"note: --run-dir {folder}: reclaimed the stale lock of pid {live.pid} on host {HOST} "
        "(since 2026-01-01T00:00:00Z), which has ended"
    ]


def test_a_reused_pid_is_not_the_owner(tmp_path, live):
    """The pid lives, but it started at another time than the owner recorded: the owner has ended."""
    plant(tmp_path, host=HOST, pid=live.pid, started=_start_time(live.pid) - 1)
    lines = []
    RunLock.acquire(tmp_path, as_printed(lines)).release()
    assert len(lines) == 1 and "reclaimed the stale lock" in lines[0]


def test_another_hosts_lock_needs_break_lock(tmp_path):
    plant(tmp_path, host="elsewhere", pid=4242)
    with raises_as_cli(RunFolderLocked, match=r"locked by pid 4242 on host elsewhere .*pass --break-lock"):
        RunLock.acquire(tmp_path, print)
    lines = []
    lock = RunLock.acquire(tmp_path, as_printed(lines), break_lock=True)
    assert lines == [
        f"note: --run-dir {tmp_path}: --break-lock took over the lock of pid 4242 on host elsewhere "
        "(since 2026-01-01T00:00:00Z)"
    ]
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_file_that_is_not_a_lock_is_replaced_with_a_line(tmp_path):
    (tmp_path / LOCK_FILE).write_text("garbage")
    lines = []
    RunLock.acquire(tmp_path, as_printed(lines)).release()
    assert lines == [f"note: --run-dir {tmp_path}: replaced {tmp_path / LOCK_FILE}, which did not parse as a lock"]


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    lock = RunLock.acquire(tmp_path, print)
    plant(tmp_path, host="elsewhere", pid=7)  # broken and taken over by another run meanwhile
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == "elsewhere"


def test_a_lock_taken_under_the_launcher_names_it(tmp_path):
    """A run started by train.launch records the launcher's pid: the process to stop is the launcher."""
    with RunLock.acquire(tmp_path / "run", print, launcher=4242):
        assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["launcher_pid"] == 4242
        with pytest.raises(RunFolderLocked) as refused:
            RunLock.acquire(tmp_path / "run", print)
    assert f"pid {os.getpid()} on host {HOST} (since " in render(refused.value)
    assert "), started by the launcher pid 4242; wait for it to end" in render(refused.value)
