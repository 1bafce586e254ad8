"""The elastic launcher, one per (simulated) host: losing process 0, then another while restarting, the lost
ones rejoining; training finishes on the survivors. Then a save cut short, and the launcher's decisions on
scripted exits.

The losses after each restart are compared with an uninterrupted one-process run of the same flags at
rtol 1e-5: the restarted job resumes from a checkpoint with the same global batch and data position, but
on another mesh (data=3, then data=2, then data=1, then data=3 again), so only the order of the float32
reductions differs, as in tests/test_multiprocess.py. Each process has one CPU device and the model one
layer, to keep the compilations (one per restart and process) short; the scenarios share launcher runs
(each start of a JAX process costs seconds).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from _procs import ROOT, clean_env, losses, run

from checkpoints.verify import saved_steps
from train.launcher import supervisor as launch_module
from train.launcher.command import LaunchConfig, parse, strip_flags
from train.launcher.distributed import DistributedConfig, start_service
from train.launcher.replan import choose, outer_for
from train.launcher.supervisor import RESTARTS_EXHAUSTED, Generation, Launcher, free_port
from train.setup import cli

STEPS = 10  # the schedule's decay steps
REJOIN_STEPS = 30  # the one-process job must still be running when the checkpoint it waits for is complete
CKPT_EVERY = 2


def common(corpus, cache, steps=STEPS) -> list[str]:
    return [
        "--model",
        "test",
        "--set",
        "num_layers=1",
        "--seq-len",
        "32",
        "--batch-size",
        "6",
        "--mesh",
        "data=-1",
        "--cpu-devices",
        "1",
        "--steps",
        str(steps),
        "--warmup",
        "2",
        "--decay-steps",
        str(STEPS),
        "--eval-every",
        "0",
        "--eval-batches",
        "0",
        "--log-every",
        "1",
        "--ckpt-every",
        str(CKPT_EVERY),
        "--no-progress",
        "--dist-timeout",
        "60",
        "--data",
        str(corpus),
        "--data-cache",
        str(cache),
    ]


def start_launcher(args, log, **env):
    handle = open(log, "w")
    return subprocess.Popen(
        [sys.executable, "-m", "train.launch", *args],
        cwd=ROOT,
        env=clean_env(**env),
        stdout=handle,
        stderr=subprocess.STDOUT,
    )


def pid_of(log, process: int, count: int) -> int:
    """The pid the launcher's newest start of ``process`` of ``count`` has."""
    pids = re.findall(rf"^launch: process {process} of {count} \(slot \d+\) started, pid (\d+)$", log.read_text(), re.M)
    return int(pids[-1])


def step_after(log, marker: str, step: int, launcher, run_dir, checkpoint: int, timeout=400):
    """Waits for the line of ``step`` printed after the line containing ``marker`` and for the checkpoint of
    step ``checkpoint`` to be complete (a kill before it would recompute more than ``--ckpt-every`` steps)."""
    deadline = time.monotonic() + timeout
    folder = run_dir / "checkpoints"
    while time.monotonic() < deadline:
        text = log.read_text()
        if (
            marker in text
            and re.search(rf"^step\s+{step}/", text.split(marker, 1)[1], re.M)
            and checkpoint in saved_steps(folder)
        ):
            return
        if launcher.poll() is not None:
            raise AssertionError(f"launcher ended ({launcher.returncode}) before step {step}:\n{text}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for step {step} after {marker!r}:\n{log.read_text()}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus, cache):
    """The run folder of the same flags in one uninterrupted process (--steps does not change the schedule:
    --decay-steps and --warmup are given)."""
    folder = tmp_path_factory.mktemp("reference")
    args = [*common(corpus, cache, REJOIN_STEPS), "--run-dir", str(folder / "run")]
    assert run(args, folder / "run.log", timeout=400) == 0, (folder / "run.log").read_text()
    return folder / "run"


def wait_for_start(log, process: int, count: int, launcher, timeout=400) -> int:
    """The pid of ``process`` of ``count`` once the launcher has started it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return pid_of(log, process, count)
        except IndexError:
            if launcher.poll() is not None:
                raise AssertionError(f"launcher ended ({launcher.returncode}):\n{log.read_text()}") from None
            time.sleep(0.05)
    raise AssertionError(f"timed out waiting for process {process} of {count}:\n{log.read_text()}")


def stopped(launcher, timeout=600) -> int:
    try:
        return launcher.wait(timeout=timeout)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=30)


@pytest.mark.slow
def test_three_hosts_lose_process_0_then_a_host_while_restarting_then_grow_back(tmp_path, corpus, cache, reference):
    """One run of three launchers given a three-node SLURM environment (every node 127.0.0.1, one process
    each): node 0's launcher hosts the service and decides, the others connect and start what it asks.
    Process 0 (on node 0: the process that would host JAX's service without the launcher) is killed at
    step 3, so the job restarts on nodes 1 and 2 (data=3 -> 2); node 2's launcher is killed as soon as it
    starts process 1 of those 2 (a second failure during the restart, a whole host lost), so the job
    restarts on node 1 alone (data=2 -> 1). A launcher started again on node 2 connects to the running job
    and, with --rejoin, node 0's lost process and node 2 come back at the next checkpoint: the job finishes
    on 3. --mesh-outer data=3 follows (data=2, then one process, where it has no effect). Every launcher
    that was not killed ends with 0; one metrics record per step, and the losses of an
    uninterrupted one-process run."""
    run_dir, port = tmp_path / "elastic", free_port()
    args = [*common(corpus, cache, REJOIN_STEPS), "--run-dir", str(run_dir), "--local-processes", "1"]
    args += ["--max-restarts", "2", "--rejoin", "--launch-port", str(port), "--mesh-outer", "data=3"]
    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.1,127.0.0.1", "SLURM_NNODES": "3"}
    logs = [tmp_path / f"node{i}.log" for i in range(3)] + [tmp_path / "node2-again.log"]
    launchers = [start_launcher(args, logs[i], SLURM_NODEID=str(i), **slurm) for i in range(3)]
    try:
        step_after(logs[0], "launch: process 0 of 3", 3, launchers[0], run_dir, checkpoint=2)
        os.kill(pid_of(logs[0], 0, 3), signal.SIGKILL)
        wait_for_start(logs[2], 1, 2, launchers[0])
        launchers[2].kill()  # the host's process goes with its launcher (PR_SET_PDEATHSIG)
        launchers[2].wait(timeout=60)
        launchers.append(start_launcher(args, logs[3], SLURM_NODEID="2", **slurm))
    finally:
        codes = [stopped(launcher) for launcher in launchers]
    text, texts = logs[0].read_text(), [log.read_text() for log in logs]
    assert codes == [0, 0, -signal.SIGKILL, 0], texts
    assert "launch: process 1 of 3 (slot 1) started on host 1" in text, text
    assert all(f"launch: host {i} of 3 connected to 127.0.0.1:{port}" in texts[n] for i, n in ((1, 1), (2, 2), (2, 3)))
    assert "launch: host 2 of 3 connected again; its processes rejoin at the next checkpoint" in text, text
    # --mesh-outer data=3 on 3 processes before and after, no effect on one (data=2 on 2: the unit test below)
    assert text.count("axes crossing processes: data (over 3)") == 2, text
    assert "note: one process, so --mesh-outer has no effect" in texts[1], texts[1]
    restarts = [line for line in text.splitlines() if line.startswith("launch: restart")]
    assert len(restarts) == 2, text
    assert "lost process 0 (slot 0, killed by SIGKILL)" in restarts[0], restarts
    assert "on 2 process(es); mesh data=3 -> data=2;" in restarts[0], restarts
    assert "lost process 1 (slot 2, killed by SIGKILL)" in restarts[1], restarts
    assert "on 1 process(es); mesh data=2 -> data=1;" in restarts[1], restarts
    # Each restart resumes from a checkpoint at least as new as the one complete at the kill and recomputes the
    # steps recorded after it. How many that is depends on how far the asynchronous save of the next checkpoint
    # got before the kill (a tiny model's steps can outrun it), so it is checked against the recorded steps, not
    # bounded by --ckpt-every.
    pattern = r"resuming from step (\d+) .*; (\d+) step\(s\) recomputed \(last recorded step (\d+)\)"
    awaited = 2
    for line in restarts:
        resumed, recomputed, recorded = map(int, re.search(pattern, line).groups())
        assert resumed >= awaited and resumed % CKPT_EVERY == 0 and recomputed == recorded - resumed >= 0, line
        awaited = resumed
    grow = re.findall(r"^launch: growing back to 3 processes at step (\d+)$", text, re.M)
    assert len(grow) == 1 and awaited < int(grow[0]) < REJOIN_STEPS, text
    after = text.split("growing back to 3", 1)[1]
    assert re.search(r"^launch: process 0 of 3 \(slot 0\) started", after, re.M), text
    assert "launch: process 2 of 3 (slot 2) started on host 2" in after, text
    assert re.search(r"^launch: process 2 of 3 \(slot 2\) started, pid", texts[3], re.M), texts[3]
    assert all("Traceback" not in t.split(restarts[-1], 1)[-1] for t in texts), texts

    assert_one_record_per_step_with_the_reference_losses(run_dir, reference, REJOIN_STEPS)


def assert_one_record_per_step_with_the_reference_losses(run_dir, reference, last=STEPS):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "train/loss" in r]
    assert steps == list(range(1, last + 1)), steps  # one record per step: recomputed steps replaced the lost
    got, want = losses(run_dir), losses(reference)
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-5)
    assert str(last) in os.listdir(run_dir / "checkpoints")


def test_the_layout_is_chosen_for_the_processes_left(corpus):
    """Batch 8 over data=-1,fsdp=2 on 2-device processes: 3 processes (data=3) cannot split it, 2 can."""
    flags = ["--model", "test", "--cpu-devices", "2", "--mesh", "data=-1,fsdp=2", "--batch-size", "8"]
    config = cli.parse([*flags, "--data", str(corpus), "--dry-run"])
    count, mesh, refusals = choose(config, 3, 1)
    assert (count, mesh) == (2, "data=2,fsdp=2")
    assert len(refusals) == 1 and refusals[0].startswith("3 processes: --batch-size 8"), refusals
    fixed = cli.parse([*flags[:-4], "--mesh", "data=2,fsdp=2", "--data", str(corpus), "--dry-run"])
    count, mesh, refusals = choose(fixed, 1, 1)
    assert (count, mesh) == (0, "") and len(refusals) == 1, refusals
    assert refusals[0].startswith("1 process: --mesh 'data=2,fsdp=2': the sizes multiply to 4 but JAX sees 2"), refusals


def test_a_mesh_refusal_names_a_mesh_the_same_checks_accept(corpus):
    """3 processes of 4 devices, --mesh fsdp=8, batch 16: the example was fsdp=6,tensor=2, which batch 16 (and
    the test model's widths) then refused; the example is now found by trying shapes through the same checks."""
    flags = ["--model", "test", "--cpu-devices", "4", "--mesh", "fsdp=8", "--batch-size", "16"]
    config = cli.parse([*flags, "--data", str(corpus), "--dry-run"])
    count, _, refusals = choose(config, 3, 3)
    assert count == 0 and "(example: --mesh " in refusals[0], refusals
    mesh, _, batch = refusals[0].split("(example: --mesh ")[1].rstrip(")").partition(" with --batch-size ")
    fixed = [*flags[:-4], "--mesh", mesh, "--batch-size", batch or "16"]
    count, chosen, refusals = choose(cli.parse([*fixed, "--data", str(corpus), "--dry-run"]), 3, 3)
    assert (count, chosen, refusals) == (3, mesh, [])


def test_mesh_outer_is_re_derived_for_the_processes_left(corpus):
    """--mesh data=-1,fsdp=2 --mesh-outer data=2,fsdp=2 on 4 processes of 2 devices: fsdp keeps spanning 2
    processes and data spans what is left (1 of 2 processes); 3 processes are refused (fsdp's 2 do not divide
    them), checked once, when the launcher starts."""
    flags = ["--model", "test", "--cpu-devices", "2", "--mesh", "data=-1,fsdp=2", "--batch-size", "24"]
    flags += ["--mesh-outer", "data=2,fsdp=2"]
    config = cli.parse([*flags, "--data", str(corpus)])
    launcher = Launcher(LaunchConfig(4, min_processes=2), flags, config)
    assert launcher.choose(3) == (
        2,
        "data=2,fsdp=2",
        ["3 processes: --mesh-outer data=2,fsdp=2: the axes other than data span 2 processes, which does not "
         "divide 3 processes"],
    )  # fmt: skip
    assert set(launcher.layouts) == {3, 2}
    assert launcher.process_argv(4, False) == flags
    assert launcher.process_argv(2, True) == [*flags[:-2], "--resume", "--mesh-outer", "fsdp=2"]
    assert outer_for(config, 1, 4) == config.parallelism.outer  # one process: the flag has no effect


def test_launcher_flags_are_checked_and_kept_from_the_processes(corpus):
    base = ["--model", "test", "--data", str(corpus)]
    launch, train_argv, _ = parse(["--local-processes", "2", "--rejoin", *base, "--max-restarts=5"])
    assert (launch.local_processes, launch.max_restarts, launch.rejoin, train_argv) == (2, 5, True, base)
    assert strip_flags(["--a", "--min-processes", "2", "--b"], {"--min-processes": True}) == ["--a", "--b"]
    for argv, message in (
        (base, r"^--local-processes: required"),
        (["--local-processes", "0", *base], r"^--local-processes 0: must be at least 1"),
        (["--local-processes", "2", "--min-processes", "3", *base], r"^--min-processes 3: must be in 1..2"),
        (["--local-processes", "2", "--process-id", "0", *base], r"^--process-id: the launcher gives it"),
    ):
        with pytest.raises(ValueError, match=message):
            parse(argv)
    assert RESTARTS_EXHAUSTED not in (0, 1, 2, 3)


class FakeChild:
    """A training process that ends with ``code`` (None: runs until stopped) at its first look."""

    def __init__(self, code):
        self.returncode, self.pid, self.looks = code, 0, 0

    def poll(self):
        self.looks += 1  # bounds a scripted test: a launcher that would wait forever fails instead
        assert self.looks < 1000, "the launcher kept waiting for a process that will not end"
        return self.returncode

    def send_signal(self, signum):
        self.returncode = 0


class ScriptedLauncher(Launcher):
    """The launcher's decisions on scripted exits: each start takes the next list of exit codes."""

    def __init__(self, script, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.script, self.starts = list(script), []

    def start(self, slots, mesh, resumed, restart):
        self.starts.append((list(slots), mesh, resumed))
        children = [FakeChild(code) for code in self.script.pop(0)]
        self.current = Generation(list(slots), mesh, None, children, resumed)
        return self.current

    def stop(self, gen, lost=False):
        self.current = None

    def newest(self):
        return 4


def scripted(script, corpus, tmp_path, *flags, **launch):
    config = cli.parse(
        ["--model", "test", "--cpu-devices", "1", "--mesh", "data=-1", "--batch-size", "6", "--data", str(corpus)]
        + ["--run-dir", str(tmp_path / "run"), *flags]
    )
    lines = []
    launcher = ScriptedLauncher(script, LaunchConfig(**launch), [], config, log=lines.append)
    return launcher, launcher.run(), lines


def test_restarts_until_max_restarts_are_used_up_naming_each_failure(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(launch_module, "POLL", 0.0)
    launcher, code, lines = scripted(
        [[-9, None, None], [None, 134]], corpus, tmp_path, local_processes=3, max_restarts=1
    )
    assert code == RESTARTS_EXHAUSTED
    assert [(s, m) for s, m, _ in launcher.starts] == [([0, 1, 2], "data=3"), ([1, 2], "data=2")]
    assert lines[0].startswith("launch: restart 1/1: lost process 0 (slot 0, killed by SIGKILL); resuming from step 4")
    assert lines[-1] == (
        "error: --max-restarts 1 used up after 2 failures: lost process 0 (slot 0, killed by SIGKILL); "
        "lost process 1 (slot 2, exit 134); the newest verified checkpoint is step 4"
    )


def test_a_failed_process_is_not_restarted_and_a_layout_that_no_longer_fits_says_so(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(launch_module, "POLL", 0.0)
    launcher, code, lines = scripted([[None, 1]], corpus, tmp_path, local_processes=2)
    assert code == 1 and len(launcher.starts) == 1
    assert lines == ["error: process 1 ended with exit 1; not a lost process, not restarted"]

    # batch 4 over data=-1: 4 processes fit; of 3 left only 2 (data=3 cannot split it), the third waits idle and
    # replaces the next lost one; then 1 is left, below --min-processes
    launcher, code, lines = scripted(
        [[None, None, None, -9], [-9, None], [None, -9]],
        corpus,
        tmp_path,
        "--batch-size",
        "4",
        local_processes=4,
        min_processes=2,
        max_restarts=5,
    )
    assert code == RESTARTS_EXHAUSTED
    assert [s for s, _, _ in launcher.starts] == [[0, 1, 2, 3], [0, 1], [1, 2]]
    assert "mesh data=4 -> data=2;" in lines[0], lines
    assert lines[-1].startswith("error: nothing fits the 1 process(es) left (fewer than --min-processes 2)"), lines


class VerifyingLauncher(ScriptedLauncher):
    """A scripted launcher that reads the checkpoint folder as the real one does (`Launcher.newest`)."""

    newest = Launcher.newest


@pytest.mark.slow
def test_a_process_lost_during_a_save_restarts_from_the_newest_verified_step(reference, corpus, tmp_path, monkeypatch):
    """The reference run's checkpoints 26, 28, 30 as a process killed while saving leaves them: 30 still in
    Orbax's temporary folder (killed before the rename), 28 cut short (no OCDBT manifest, as on a file system
    without an atomic rename). The restart resumes from 26, the newest step that verifies."""
    monkeypatch.setattr(launch_module, "POLL", 0.0)
    folder = tmp_path / "run" / "checkpoints"
    shutil.copytree(reference / "checkpoints", folder)
    assert saved_steps(folder) == [26, 28, 30]
    (folder / "30").rename(folder / "30.orbax-checkpoint-tmp-1764662400000000")
    (folder / "28" / "state" / "manifest.ocdbt").unlink()
    config = cli.parse(
        ["--model", "test", "--set", "num_layers=1", "--seq-len", "32", "--cpu-devices", "1", "--mesh", "data=-1"]
        + ["--batch-size", "6", "--data", str(corpus), "--run-dir", str(tmp_path / "run"), "--resume"]
    )
    lines = []
    launcher = VerifyingLauncher([[None, -9], [0]], LaunchConfig(2), [], config, log=lines.append)
    assert launcher.run() == 0
    assert [(s, r) for s, _, r in launcher.starts] == [([0, 1], 26), ([0], 26)]
    assert lines[0].startswith(
        "launch: restart 1/3: lost process 1 (slot 1, killed by SIGKILL); resuming from step 26"
    ), lines


def test_joining_a_service_hosted_elsewhere_needs_the_flags_and_the_binding(monkeypatch):
    with pytest.raises(ValueError, match=r"^--external-coordinator: needs --coordinator HOST:PORT"):
        DistributedConfig(external=True).validate()
    from jax._src import distributed as jax_distributed

    monkeypatch.setattr(jax_distributed, "_jax", object())  # a JAX without the private binding
    with pytest.raises(RuntimeError, match=r"^train.launch: this JAX \(.*\) has no jax._src.distributed._jax"):
        start_service(free_port(), 2, 10)


def test_a_signal_to_the_launcher_is_passed_on_and_is_not_a_lost_process(corpus, tmp_path, monkeypatch):
    """SIGTERM to the launcher: the processes are told (they save and end with 0), nothing is restarted."""
    monkeypatch.setattr(launch_module, "POLL", 0.0)
    config = cli.parse(["--model", "test", "--cpu-devices", "1", "--mesh", "data=-1", "--data", str(corpus)])
    launcher = ScriptedLauncher([[None, None]], LaunchConfig(2), [], config, log=print)
    original = FakeChild.poll

    def poll_once_then_signal(child):
        if not launcher.stopping:
            launcher.terminate(signal.SIGTERM, None)  # arrives while the processes run
        return original(child)

    monkeypatch.setattr(FakeChild, "poll", poll_once_then_signal)
    assert launcher.run() == 0 and len(launcher.starts) == 1 and launcher.failures == []


@pytest.mark.slow
def test_sigterm_before_the_training_loop_ends_a_process_at_once():
    """JAX's preemption notifier takes SIGTERM over in jax.distributed.initialize and only records it; after
    `train.launcher.distributed.initialize` a process that has not reached the loop ends at SIGTERM (nothing to save),
    so a launcher stopping it does not wait for SIGKILL."""
    script = (
        "import os, signal, time\n"
        "from train.launcher.distributed import DistributedConfig, initialize\n"
        "from train.launcher.supervisor import free_port\n"
        "initialize(DistributedConfig(f'127.0.0.1:{free_port()}', 1, 0, timeout=30))\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(5)\n"
        "print('SIGTERM was swallowed')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=clean_env(), capture_output=True, text=True)
    assert done.returncode == -signal.SIGTERM, done.stdout + done.stderr


def test_a_process_whose_launcher_is_gone_says_so_in_one_line(monkeypatch):
    """Under train.launch the kernel signals a training process when its launcher dies (PR_SET_PDEATHSIG);
    the process answers with one line naming the launcher and how to go on (before: killed without a word)."""
    from train.launcher import orphan

    said = []
    monkeypatch.setenv(orphan.LAUNCHER_ENV, str(os.getppid()))  # our parent plays the launcher: alive
    previous = signal.getsignal(orphan.PARENT_GONE_SIGNAL)
    try:
        assert orphan.watch_launcher(lambda: "the newest checkpoint is step 5 in R", said.append) == os.getppid()
        time.sleep(2 * orphan.POLL_SECONDS)
        assert said == []  # the launcher lives: nothing said
        os.kill(os.getpid(), orphan.PARENT_GONE_SIGNAL)  # what the kernel sends when it dies
        time.sleep(0.1)
        assert said == [
            f"the launcher (pid {os.getppid()}) that started this process is gone (killed?), so this process stops; "
            "the newest checkpoint is step 5 in R; start python -m train.launch again with the same flags and --resume"
        ]
        # The parent changes (the launcher died while the main thread was blocked): the watch thread says it.
        said.clear()
        monkeypatch.setenv(orphan.LAUNCHER_ENV, str(os.getppid() + 1))
        orphan.watch_launcher(lambda: "no checkpoint in R yet", said.append)
        time.sleep(0.1)
        assert len(said) == 1 and said[0].startswith(f"the launcher (pid {os.getppid() + 1}) that started")
    finally:
        signal.signal(orphan.PARENT_GONE_SIGNAL, previous)
    monkeypatch.delenv(orphan.LAUNCHER_ENV)
    assert orphan.watch_launcher(lambda: "", said.append) is None  # not started by a launcher


@pytest.mark.slow
def test_killing_the_launcher_leaves_processes_that_say_why_they_stop(corpus, cache, tmp_path):
    """kill -9 of the launcher: each training process prints one line naming the launcher and the newest
    checkpoint, and ends; the run lock it left names the launcher, and the next start reclaims it."""
    import subprocess

    from _procs import clean_env

    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    argv = ["--local-processes", "2", *common(corpus, cache, steps=400), "--run-dir", str(run_dir)]
    with open(log, "w") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "train.launch", *argv], cwd=ROOT, env=clean_env(), stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 240
        while not re.search(r"^step\s+3/400", log.read_text(), re.M):
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        assert json.loads((run_dir / "run.lock").read_text())["launcher_pid"] == launcher.pid
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 60
        while log.read_text().count("that started this process is gone") < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        # Usually both say it; JAX's runtime may abort one first (it sees the service's socket close within
        # milliseconds, and prints its own lines), so at least one line, and both processes gone.
        gone = [line for line in log.read_text().splitlines() if "that started this process is gone" in line]
        assert 1 <= len(gone) <= 2, log.read_text()
        assert gone[0].startswith(f"error: the launcher (pid {launcher.pid})") and "--resume" in gone[0]
        assert "the newest checkpoint is step " in gone[0] or "no checkpoint in " in gone[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
