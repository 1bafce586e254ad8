"""The launcher on host 0: starts the training processes (one per slot), watches them, and restarts on the
survivors from the newest verified checkpoint when one is lost (the module docstring of `train.launch` tells
the whole story).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from checkpoints.verify import latest_verified_step, saved_steps
from sharding.mesh import format_mesh
from train.launcher.command import LaunchConfig, strip_flags
from train.launcher.distributed import start_service
from train.launcher.hosts import POLL, child_env, die_with_parent
from train.launcher.orphan import LAUNCHER_ENV
from train.launcher.remote import RemoteHost
from train.launcher.replan import choose, layout_for, outer_for
from train.setup.flagnames import render

STOP_GRACE = 5.0
"""Seconds a survivor gets to end after SIGTERM before SIGKILL (it is usually blocked in a collective)."""


RESTARTS_EXHAUSTED = 4
"""Exit status when ``--max-restarts`` is used up or fewer than ``--min-processes`` are left."""


COMPILATION_CACHE = "compile-cache"
"""The folder in ``--run-dir`` where the training processes keep JAX's persistent compilation cache, unless
``JAX_COMPILATION_CACHE_DIR`` names another: a restart on a process count the job has run on before loads its
compiled programs instead of compiling them again (the run folder is shared by the hosts, as the checkpoints
need, so every process finds what process 0 wrote)."""


def free_port() -> int:
    """A TCP port free on this machine now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    """``exit 2`` or ``killed by SIGKILL`` for a child's return code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


@dataclasses.dataclass
class Generation:
    """One start of the training processes: their slots, the service and the children."""

    slots: list[int]
    mesh: str
    service: object
    children: list[subprocess.Popen]
    resumed: int | None


class Launcher:
    """Runs the generations of training processes until training ends; see the module docstring.

    Args:
      launch: the launcher's flags.
      train_argv: the flags every training process gets (before the launcher's own).
      config: their `train.setup.config.RunConfig`.
      log: prints one line (the launcher's lines start with ``launch:``).
    """

    def __init__(
        self,
        launch: LaunchConfig,
        train_argv: list[str],
        config,
        log: Callable[[str], None] = print,
        remotes: dict[int, RemoteHost] | None = None,
    ):
        self.launch, self.argv, self.config, self.log = launch, list(train_argv), config, log
        self.remotes = remotes or {}
        self.address = launch.placement.coordinator if launch.placement is not None else "127.0.0.1"
        self.folder = Path(config.checkpoint.run_dir) / "checkpoints"
        self.failures: list[str] = []
        self.stopping = False
        self.current: Generation | None = None
        self.layouts: dict[int, str] = {}
        """Process count -> its mesh, or the reason it does not fit (``error: ...``): `layout`'s checks, made once
        (a restart changes only the checkpoint flags, which no check reads)."""

    def layout(self, processes: int) -> str:
        """`layout_for` on ``processes`` processes, checked once per count (`layouts`).

        Raises:
          ValueError: That count does not fit (the check's one line).
        """
        if processes not in self.layouts:
            try:
                self.layouts[processes] = layout_for(self.config, processes, self.launch.total_processes)
            except ValueError as e:
                self.layouts[processes] = f"error: {render(e)}"
        found = self.layouts[processes]
        if found.startswith("error: "):
            raise ValueError(found.removeprefix("error: "))
        return found

    def choose(self, available: int) -> tuple[int, str, list[str]]:
        """`choose` over the cached checks, from ``available`` processes down to ``--min-processes``."""
        return choose(self.config, available, self.launch.min_processes, self.layout)

    def run(self) -> int:
        """Trains to the end through lost processes; returns the exit status."""
        slots, lost_slots, resume = list(range(self.launch.total_processes)), [], self.config.checkpoint.resume
        mesh = self.layout(len(slots))  # the first layout is the user's: refused as train.train would refuse it
        count = len(slots)
        for fewer in range(count - 1, self.launch.min_processes - 1, -1):  # checked now, not while restarting
            try:
                self.layout(fewer)
            except ValueError:
                pass
        previous, restart = None, False
        while not self.stopping:
            resumed = self.newest() if resume else None
            if previous is not None:
                self.log(self.restart_line(previous, count, mesh, resumed or 0))
            gen = self.start(slots[:count], mesh, resumed, restart=restart)
            outcome, detail = self.watch(gen)
            self.stop(gen, lost=outcome == "lost")
            if outcome == "done":
                return 0
            if outcome == "failed":
                return detail
            if outcome == "grow":
                self.log(f"launch: growing back to {len(detail)} processes at step {self.newest()}")
                slots, lost_slots, resume, restart, previous = detail, [], True, True, None
                self.config = resumed_config(self.config)
                count, mesh, refusals = self.choose(len(slots))
                if count == 0:
                    return self.no_fit(len(slots), refusals)
                continue
            lost, words = detail
            self.failures.append(words)
            lost_slots += [s for s in lost if s in gen.slots]
            slots = [s for s in gen.slots if s not in lost] + [s for s in slots if s not in gen.slots]
            if len(self.failures) > self.launch.max_restarts:
                self.log(
                    f"error: --max-restarts {self.launch.max_restarts} used up after {len(self.failures)} "
                    f"failures: {'; '.join(self.failures)}; the newest verified checkpoint is step {self.newest()}"
                )
                return RESTARTS_EXHAUSTED
            self.config = resumed_config(self.config)
            count, mesh, refusals = self.choose(len(slots))
            if count == 0 and self.launch.rejoin and lost_slots:
                self.log(
                    f"launch: nothing fits {len(slots)} process(es) ({'; '.join(refusals) or 'below --min-processes'}); "
                    f"waiting for process(es) {', '.join(map(str, lost_slots))} to rejoin"
                )
                slots, lost_slots = sorted(slots + [s for s in lost_slots if self.reachable(s)]), []
                count, mesh, refusals = self.choose(len(slots))
            if count == 0:
                return self.no_fit(len(slots), refusals)
            resume, restart, previous = True, True, (gen, words)
        self.log("launch: stopped by a signal before the restart")
        return 0

    def no_fit(self, processes: int, refusals: list[str]) -> int:
        reasons = "; ".join(refusals) or f"fewer than --min-processes {self.launch.min_processes}"
        self.log(
            f"error: nothing fits the {processes} process(es) left ({reasons}); the newest verified checkpoint "
            f"is step {self.newest()}; pass --rejoin to wait for lost processes, or restart with more"
        )
        return RESTARTS_EXHAUSTED

    def restart_line(self, previous: tuple[Generation, str], processes: int, mesh: str, resumed: int) -> str:
        """The one line of a restart: what was lost, the step resumed, the old and new mesh, the steps recomputed."""
        old, words = previous
        reached = last_recorded_step(Path(self.config.checkpoint.run_dir))
        recomputed = max(reached - resumed, 0) if reached is not None else 0
        return (
            f"launch: restart {len(self.failures)}/{self.launch.max_restarts}: {words}; resuming from step "
            f"{resumed} on {processes} process(es); mesh {old.mesh} -> {mesh}; "
            f"{recomputed} step(s) recomputed (last recorded step {reached if reached is not None else 0})"
        )

    def cache_env(self) -> dict[str, str]:
        """The training processes' persistent compilation cache (`COMPILATION_CACHE`), unless this launcher's
        environment names one."""
        if "JAX_COMPILATION_CACHE_DIR" in os.environ:
            return {}
        return {
            "JAX_COMPILATION_CACHE_DIR": str(Path(self.config.checkpoint.run_dir) / COMPILATION_CACHE),
            # every program, not only those compiling for over a second (JAX's default): a restart also runs the
            # evaluation step and the small programs of start-up and restore
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }

    def newest(self) -> int:
        """The newest verified checkpoint step (0 when there is none or the folder does not read)."""
        try:
            return latest_verified_step(self.folder).step or 0
        except Exception:  # a damaged folder: the training processes will say which step and why
            return 0

    def process_argv(self, processes: int, restart: bool) -> list[str]:
        """The flags of each of ``processes`` training processes (before the launcher's own): the user's, with
        ``--resume`` from the newest verified step on a ``restart`` and ``--mesh-outer`` re-derived for
        ``processes`` (`outer_for`)."""
        argv = self.argv
        if restart:
            argv = strip_flags(argv, {"--resume-step": True, "--discard-later": False})
            argv += [] if "--resume" in argv else ["--resume"]
        outer = outer_for(self.config, processes, self.launch.total_processes)
        if outer is not None and outer != dict(self.config.parallelism.outer):
            argv = strip_flags(argv, {"--mesh-outer": True}) + ["--mesh-outer", format_mesh(outer)]
        return argv

    def start(self, slots: list[int], mesh: str, resumed: int | None, restart: bool) -> Generation:
        """Starts the service and one training process per slot (process ids 0..len(slots)-1): the first time
        with the user's flags, on a ``restart`` with ``--resume`` from the newest verified step (resumed)."""
        port = free_port()
        service = start_service(port, len(slots), self.config.cluster.dist_timeout)
        env = self.cache_env() | child_env(os.environ)  # a variable this environment sets stays
        env[LAUNCHER_ENV] = str(os.getpid())  # the children say so if this launcher dies
        argv = self.process_argv(len(slots), restart)
        children = []
        for index, slot in enumerate(slots):
            command = [
                sys.executable,
                "-m",
                "train.train",
                *argv,
                "--coordinator",
                f"{self.address}:{port}",
                "--num-processes",
                str(len(slots)),
                "--process-id",
                str(index),
                "--external-coordinator",
            ]
            host = slot // self.launch.local_processes
            if host in self.remotes:
                children.append(self.remotes[host].start(slot, command, self.cache_env()))
                self.log(f"launch: process {index} of {len(slots)} (slot {slot}) started on host {host}")
                continue
            children.append(subprocess.Popen(command, env=env, preexec_fn=die_with_parent))
            self.log(f"launch: process {index} of {len(slots)} (slot {slot}) started, pid {children[-1].pid}")
        self.current = Generation(slots, mesh, service, children, resumed)
        if self.stopping:  # SIGTERM came while they were being started (`terminate` saw no generation yet)
            self.terminate(signal.SIGTERM, None)
        return self.current

    def watch(self, gen: Generation):
        """Waits for the generation to end or lose a process.

        Returns:
          ``("done", None)``, ``("failed", status)``, ``("lost", (slots, words))`` or ``("grow", slots)``.
        """
        ended: dict[int, int] = {}
        while True:
            time.sleep(POLL)
            now = {i: c.returncode for i, c in enumerate(gen.children) if i not in ended and c.poll() is not None}
            ended.update(now)
            if self.stopping:
                if len(ended) == len(gen.children):
                    return "failed", max((abs(c) for c in ended.values()), default=0)
                continue
            lost = [i for i, code in now.items() if code < 0 or code not in (0, 1, 2, 3)]
            if lost:
                words = ", ".join(f"process {i} (slot {gen.slots[i]}, {describe_exit(now[i])})" for i in lost)
                return "lost", ([gen.slots[i] for i in lost], f"lost {words}")
            failed = [i for i, code in now.items() if code in (1, 2)]
            if failed:
                i = failed[0]
                self.log(f"error: process {i} ended with {describe_exit(now[i])}; not a lost process, not restarted")
                return "failed", now[i]
            silent = [i for i, code in now.items() if code == 3]
            if silent:  # a peer hung without dying: which one is in that process's error line
                return "lost", ([], f"process {silent[0]} reported a silent peer (exit 3)")
            if len(ended) == len(gen.children):
                return "done", None
            if self.launch.rejoin and len(gen.slots) < len(self.reachable_slots()):
                after = gen.resumed or 0
                if max(saved_steps(self.folder), default=0) > after and self.newest() > after:
                    return self.grow_back(gen)

    def grow_back(self, gen: Generation):
        """Stops a shrunk generation at the checkpoint boundary it just passed (SIGTERM: the processes finish the
        step in flight, save and end with 0) so that every slot can start again (`watch`'s outcomes)."""
        self.log("launch: a checkpoint newer than the restart is complete; stopping to grow back")
        for child in gen.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.cluster.dist_timeout
        for child in gen.children:
            try:
                child.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                return "lost", ([], "the processes did not stop within --dist-timeout while growing back")
        if any(c.returncode != 0 for c in gen.children):
            codes = ", ".join(describe_exit(c.returncode) for c in gen.children)
            return "lost", ([], f"processes ended with {codes} while stopping to grow back")
        if self.newest() >= self.config.loop.steps:  # the stop came with the last step
            return "done", None
        return "grow", self.reachable_slots()

    def reachable(self, slot: int) -> bool:
        """Whether ``slot``'s host can start a process (this host, or a host whose launcher is connected)."""
        host = slot // self.launch.local_processes
        return host == 0 or (host in self.remotes and self.remotes[host].alive)

    def reachable_slots(self) -> list[int]:
        return [s for s in range(self.launch.total_processes) if self.reachable(s)]

    def stop(self, gen: Generation, lost: bool = False) -> None:
        """Ends every process of ``gen`` still running and the service: after a ``lost`` process at once
        (SIGKILL: the survivors are blocked in a collective with the lost one and can neither step nor save),
        otherwise SIGTERM, then SIGKILL after `STOP_GRACE`."""
        alive = [c for c in gen.children if c.poll() is None]
        for child in alive:
            child.send_signal(signal.SIGKILL if lost else signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for child in alive:
            try:
                child.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        gen.service.shutdown()
        self.current = None

    def terminate(self, signum, frame) -> None:
        """SIGTERM or SIGINT to the launcher: passed on, the processes save and end (a stop, not a loss)."""
        self.stopping = True
        if self.current is not None:
            for child in self.current.children:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)


def resumed_config(config):
    """``config`` as a restart runs it: ``--resume`` from the newest verified step (no ``--resume-step``)."""
    checkpoint = dataclasses.replace(config.checkpoint, resume=True, resume_step=None, discard_later=False)
    return config.replace(checkpoint=checkpoint)


def last_recorded_step(run_dir: Path) -> int | None:
    """The last step with a record in ``RUN_DIR/metrics.jsonl`` (None without one)."""
    last = None
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                last = max(last or 0, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
    except OSError:
        return None
    return last
