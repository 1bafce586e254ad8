"""A lost process is reported by the survivor in one line, with the latest complete checkpoint, in time."""

import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import pytest
from _procs import ROOT, clean_env, free_port, wait_for_line

from checkpoints.manager import CheckpointManager
from train.launcher.distributed import _timeouts
from train.launcher.peers import LOST_PROCESS_EXIT, PeerWatch, checkpoint_note

DIST_TIMEOUT = 10


class FakeStore:
    """The two key-value calls `PeerWatch` makes, in memory; ``down`` makes them fail like a lost coordinator."""

    def __init__(self):
        self.values, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def test_verdicts_of_the_watch_for_a_silent_peer_a_finished_peer_and_a_lost_coordinator():
    store = FakeStore()
    watch = PeerWatch(0, 3, timeout=4, client=store)  # the coordinator's process, of 3; grace 2 s
    assert watch.grace == 2 and watch.interval == 0.4
    store.values["meshwork/beat/1"] = "5"
    _one_beat(watch)
    now = time.monotonic()
    assert watch.verdict(now + 1.9) is None
    assert watch.verdict(now + 2.4) == "processes 1, 2 of 3 stopped answering: no heartbeat for 2 s"
    store.values["meshwork/beat/1"] = "6"  # process 1 beats again; process 2 says it has finished
    store.values["meshwork/done/2"] = "1"
    _one_beat(watch)
    assert watch.verdict(time.monotonic() + 1.9) is None

    other = PeerWatch(1, 3, timeout=4, client=store)
    store.values.update({"meshwork/beat/0": "7", "meshwork/beat/2": "1"})
    _one_beat(other)
    now = time.monotonic()
    assert other.verdict(now + 1.9) is None
    store.down = True  # the coordinator stops answering: its silence keeps growing
    _one_beat(other)
    assert other.verdict(now + 2.4) == "process 0 of 3 (the coordinator) stopped answering: no reply for 2 s"
    with pytest.raises(ValueError, match=r"^--dist-timeout 0: must be a positive number of seconds, e.g. 300$"):
        PeerWatch(0, 2, timeout=0, client=store)


def _one_beat(watch):
    """Runs the beat loop for exactly one pass, without its thread."""
    original = watch._stop.wait
    watch._stop.wait = lambda seconds: watch._stop.set()
    try:
        watch._beat()
    finally:
        watch._stop.clear()
        watch._stop.wait = original


def test_the_judge_calls_lost_once_with_the_checkpoint_note():
    messages = []
    watch = PeerWatch(
        0, 2, timeout=0.4, client=FakeStore(), checkpoint_note=lambda: "NOTE", lost=messages.append
    ).start()
    time.sleep(1.0)
    watch.close()
    assert messages == [messages[0]] and messages[0].startswith("process 1 of 2 stopped answering: no heartbeat")
    assert messages[0].endswith("; NOTE")


def test_jax_timeouts_follow_dist_timeout_where_the_signature_accepts_them():
    def new_jax(coordinator_address=None, heartbeat_timeout_seconds=100, shutdown_timeout_seconds=300):
        pass

    def other_jax(coordinator_address=None, initialization_timeout=300):
        pass

    assert _timeouts(new_jax, 20) == {"heartbeat_timeout_seconds": 20, "shutdown_timeout_seconds": 20}
    assert _timeouts(other_jax, 20) == {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lost") / "checkpoints"
    manager = CheckpointManager(folder, async_save=False)
    try:
        for step in (5, 10):
            manager.save(step, {"w": jnp.ones((4,))}, {"step": step})
    finally:
        manager.close()
    return folder


def test_checkpoint_note_names_the_newest_complete_step(checkpoints, tmp_path):
    assert checkpoint_note(checkpoints) == (
        f"the latest complete checkpoint is step 10 in {checkpoints}; restart every process with --resume"
    )
    assert checkpoint_note(checkpoints, launched=True).endswith(
        "step 10 in " + f"{checkpoints}; the launcher restarts from it"
    )
    assert (
        checkpoint_note(tmp_path / "none") == f"no checkpoint in {tmp_path / 'none'} yet; restarting begins at step 0"
    )


def start_job(process_id, port, checkpoints, log: Path, steps=100000, tail=0.0):
    handle = open(log, "w")
    return subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "_peer_job.py"),
            str(process_id),
            str(port),
            str(checkpoints),
            str(DIST_TIMEOUT),
            str(steps),
            str(tail),
        ],
        cwd=ROOT,
        env=clean_env(),
        stdout=handle,
        stderr=subprocess.STDOUT,
    )


@pytest.mark.slow
def test_kill_9_of_one_process_ends_the_other_with_a_message_within_dist_timeout(checkpoints, tmp_path):
    """Process 1 is killed; process 0 (which hosts JAX's coordinator) reports it and exits 3.

    Killing process 0 instead still aborts the survivors at once: JAX's client polls the coordinator for
    errors and LOG(FATAL)s when that connection closes, before any Python code can run (see train/launcher/distributed.py).
    """
    victim = 1
    port = free_port()
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = [start_job(i, port, checkpoints, logs[i]) for i in range(2)]
    survivor = 1 - victim
    try:
        for i in range(2):
            wait_for_line(logs[i], r"^step 3$", procs[i], timeout=60)
        procs[victim].kill()  # SIGKILL
        killed_at = time.monotonic()
        code = procs[survivor].wait(timeout=DIST_TIMEOUT + 20)
        elapsed = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = logs[survivor].read_text()
    assert code == LOST_PROCESS_EXIT, text
    assert elapsed < DIST_TIMEOUT, (elapsed, text)
    who = "process 1 of 2 stopped answering: no heartbeat for"
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and who in errors[0], text
    assert errors[0].endswith(
        f"the latest complete checkpoint is step 10 in {checkpoints}; restart every process with --resume"
    )
    assert "Traceback" not in text and "Check failure" not in text and "stack trace" not in text


@pytest.mark.slow
def test_a_process_that_finished_is_not_reported_lost(checkpoints, tmp_path):
    """Process 0 ends first; process 1 stays on for longer than the grace; both exit 0 without an error."""
    port = free_port()
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = [
        start_job(0, port, checkpoints, logs[0], steps=5),
        start_job(1, port, checkpoints, logs[1], steps=5, tail=DIST_TIMEOUT / 2 + 2),
    ]
    try:
        codes = [p.wait(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i in range(2):
        text = logs[i].read_text()
        assert codes[i] == 0 and "done" in text and "error:" not in text, text


_WRITES = r"""
import os, sys
from train.launcher.output import GLOO_CONNECTED, close_output_filters, drop_output_lines
print("before", flush=True)
drop_output_lines(*GLOO_CONNECTED)
# as gloo's C++ writes them: straight to descriptor 1, below Python's sys.stdout
os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n")
print("a line of ours", flush=True)
os.write(1, b"[Gloo] Rank 1 is conn")  # one line in two writes
os.write(1, b"ected to 3 peer ranks. Expected number of connected peer ranks is : 3\nafter\n[Gloo] other news\n")
os.write(1, b"[Gloo] Rank ")  # gloo's threads write in pieces: one line inside another
os.write(1, b"[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n")
os.write(1, b"2 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n")
for piece in (b"[Gloo] Rank ", b"[Gloo] Rank ", b"0", b"0", b" is connected to ", b" is connected to ", b"1", b"1",
              b" peer ranks. ", b" peer ranks. ", b"Expected number of connected peer ranks is : ",
              b"Expected number of connected peer ranks is : ", b"1", b"1", b"\n", b"\n"):
    os.write(1, piece)  # two threads' lines interleaved piece by piece, as seen in a two-process run
os.write(1, b"progress 50%\r")
print("error line", file=sys.stderr, flush=True)
sys.stdout.write("no newline at the end")
"""


@pytest.mark.parametrize(
    "ending", ["", "sys.stdout.flush(); close_output_filters(); os._exit(3)"], ids=["exit", "_exit"]
)
def test_gloo_connection_lines_are_dropped_and_every_other_byte_passes_in_order(ending):
    """jaxlib's gloo prints a connection line per device group to descriptor 1 with no switch to silence it;
    the filter drops exactly those lines, passes everything else in order (a piece of a line, a carriage
    return, other gloo lines), leaves stderr alone and loses nothing at exit or before `os._exit`."""
    done = subprocess.run(
        [sys.executable, "-c", _WRITES + ending], cwd=ROOT, env=clean_env(), capture_output=True, timeout=60
    )
    assert done.returncode == (3 if ending else 0), done.stderr
    assert done.stdout == b"before\na line of ours\nafter\n[Gloo] other news\nprogress 50%\rno newline at the end"
    assert done.stderr == b"error line\n"
