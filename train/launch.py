"""Elastic launcher: ``python -m train.launch --local-processes N [train.train flags]``.

Starts N training processes (`train.train`, one per simulated host) on this machine and hosts JAX's
coordination service itself, outside every training process (`train.launcher.distributed.start_service`; the
processes join it with ``--external-coordinator``), so losing any training process, process 0 included,
leaves the service and the launcher up. It watches the processes; when one is lost (killed, crashed,
or reported silent by a peer's `train.launcher.distributed.PeerWatch`), it stops the others (SIGTERM, then
SIGKILL after `STOP_GRACE` seconds: a survivor is blocked in a collective with the lost peer) and starts
training again on the survivors from the newest verified checkpoint (``--resume``: every restart reads
`checkpoints.verify.latest_verified_step`).

Re-planning: the restarted processes keep every flag, so the global batch (``--batch-size``), the model,
the optimizer state and the data position (the checkpoint's sample count, independent of the mesh)
carry over; the mesh's ``-1`` axis is re-derived for the devices left (`train.setup.config.resolve_mesh`),
``--plan auto`` plans again, uneven counts are measured again. Before a restart the launcher checks the
layout on the devices left (`train.setup.config.resolve_mesh`, `train.setup.checks.validate`,
`train.reports.fit.check_estimate`) and, when it does not fit, tries fewer processes (down to
``--min-processes``); when nothing fits it says so and, with ``--rejoin``, waits for the lost processes
to come back. Those checks run once per process count, all of them before the first start, so a restart
does not wait for them; ``--mesh-outer`` is re-derived for the new count (`outer_for`). The training
processes share JAX's persistent compilation cache in the run folder (`COMPILATION_CACHE`), so a restart on
a process count seen before loads its step instead of compiling it. With ``--rejoin`` a lost process's
slot is started again at the next checkpoint boundary: the launcher asks the running processes to stop
(SIGTERM: they finish the step in flight and save) once a newer checkpoint than the one they resumed from
is complete, and restarts on every slot.

Several hosts: one launcher per host, each reading its place from SLURM's, torchrun's or a JobSet's
environment (`train.launcher.hosts.placement`). The launcher on host 0 hosts the service and runs the loop above for
every host's slots (slot ``s`` on host ``s // --local-processes``); the others connect to it at
``--launch-port`` (`gather_hosts`), start the processes it asks for and report their ends (`follow`,
`RemoteHost`), so the launchers agree on every restart because one decides. A host whose launcher goes away
loses its processes; with ``--rejoin`` host 0 keeps listening, and a launcher started on that host again
takes its place (`admit_returning`): its slots rejoin at the next checkpoint boundary.

Each restart is one line: what was lost, the step resumed, the old and new mesh, the steps recomputed.
Exit status: 0 when training finished; the training processes' own status for a non-finite loss (1)
or an error (2); `RESTARTS_EXHAUSTED` when ``--max-restarts`` is used up or too few processes are left.

Elastic restarts on the survivors of an SPMD job follow the in-job restart designs of NVIDIA's
NVRx and torchelastic's agent (a supervisor per host that restarts workers from the last checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from checkpoints.verify import latest_verified_step, saved_steps
from sharding.mesh import format_mesh, split_outer_inner
from train.data.tokenizer import load_tokenizer
from train.launcher.distributed import start_service
from train.launcher.hosts import HostPlacement, child_env, placement
from train.reports import fit
from train.setup import cli, configfile
from train.setup.checks import validate
from train.setup.config import resolve_mesh
from train.setup.parser import build_parser as build_train_parser

STOP_GRACE = 5.0
"""Seconds a survivor gets to end after SIGTERM before SIGKILL (it is usually blocked in a collective)."""
POLL = 0.2
"""Seconds between looks at the training processes."""
RESTARTS_EXHAUSTED = 4
"""Exit status when ``--max-restarts`` is used up or fewer than ``--min-processes`` are left."""
LAUNCHER_FLAGS = {
    "--local-processes": True,
    "--max-restarts": True,
    "--min-processes": True,
    "--rejoin": False,
    "--nodes": True,
    "--launch-port": True,
}
"""The launcher's own flags (True: takes a value); every other flag goes to the training processes."""
GIVEN_BY_LAUNCHER = ("--coordinator", "--num-processes", "--process-id", "--external-coordinator")
GROUP = "elastic launcher (python -m train.launch)"
DEFAULT_LAUNCH_PORT = 29431
"""The launchers' meeting port on host 0 when neither ``--launch-port`` nor ``MASTER_PORT`` gives one."""
HELLO_TIMEOUT = 30.0
"""Seconds host 0 waits for a connecting launcher's first line."""
COMPILATION_CACHE = "compile-cache"
"""The folder in ``--run-dir`` where the training processes keep JAX's persistent compilation cache, unless
``JAX_COMPILATION_CACHE_DIR`` names another: a restart on a process count the job has run on before loads its
compiled programs instead of compiling them again (the run folder is shared by the hosts, as the checkpoints
need, so every process finds what process 0 wrote)."""
DOCUMENTED_GROUPS = (GROUP,)
"""The flags docs/flags.md lists under this command (the others are python -m train.train's)."""


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """The launcher's flags.

    Attributes:
      local_processes: training processes started on this machine (``--local-processes``).
      max_restarts: restarts allowed after lost processes before giving up (``--max-restarts``).
      min_processes: fewest processes worth training on (``--min-processes``).
      rejoin: start a lost process's slot again and grow the job back at the next checkpoint (``--rejoin``).
      placement: this host's place among several (`train.launcher.hosts.placement`), None on one host.
      launch_port: the port on host 0 where the other hosts' launchers connect (``--launch-port``).
    """

    local_processes: int
    max_restarts: int = 3
    min_processes: int = 1
    rejoin: bool = False
    placement: HostPlacement | None = None
    launch_port: int = DEFAULT_LAUNCH_PORT

    @property
    def hosts(self) -> int:
        """Hosts in the job, one launcher each."""
        return self.placement.count if self.placement is not None else 1

    @property
    def total_processes(self) -> int:
        """Training processes over every host (slot ``s`` runs on host ``s // local_processes``)."""
        return self.local_processes * self.hosts


def build_parser():
    """The parser of ``python -m train.launch``: `train.setup.parser.build_parser`'s flags plus the launcher's."""
    p = build_train_parser()
    p.prog = "python -m train.launch"
    p.description = (
        "Starts the training processes of train.train on this machine, hosts their coordination service, and "
        "restarts training on the survivors from the newest verified checkpoint when a process is lost. Takes "
        "every flag of python -m train.train (but --coordinator, --num-processes, --process-id, which it gives), "
        "plus these."
    )
    g = p.add_argument_group(GROUP)
    g.add_argument(
        "--local-processes",
        type=int,
        default=None,
        metavar="N",
        help="training processes to start on this machine (on each host under SLURM or Kubernetes), each with "
        "--cpu-devices devices (required)",
    )
    g.add_argument(
        "--max-restarts", type=int, default=3, metavar="N", help="restarts after lost processes before giving up"
    )
    g.add_argument("--min-processes", type=int, default=1, metavar="N", help="fewest processes to continue training on")
    g.add_argument(
        "--rejoin",
        action="store_true",
        help="start a lost process again and grow the job back to every process at the next checkpoint",
    )
    g.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="hosts in the job, one launcher each, where the environment does not say (a Kubernetes JobSet); "
        "SLURM and torchrun's variables (MASTER_ADDR, NNODES, NODE_RANK) say it themselves",
    )
    g.add_argument(
        "--launch-port",
        type=int,
        default=None,
        metavar="PORT",
        help=f"port on host 0 where the other hosts' launchers connect (default: MASTER_PORT, else "
        f"{DEFAULT_LAUNCH_PORT})",
    )
    return p


def parse(argv: Sequence[str], env: dict[str, str] | None = None) -> tuple[LaunchConfig, list[str], object]:
    """``(launch, train_argv, run_config)``: the launcher's flags, the training processes' flags and their
    `train.setup.config.RunConfig` (checked as `train.setup.cli.parse` checks it). ``env`` (``os.environ``) says which
    host this is (`train.launcher.hosts.placement`).

    Raises:
      SystemExit: From argparse, for unknown flags or ``--help``.
      ValueError: A launcher flag out of range, a flag the launcher gives itself, or as `train.setup.cli.parse`.
    """
    parser = build_parser()
    argv = list(argv)
    args = parser.parse_args(configfile.expand(argv, parser))
    if args.local_processes is None:
        raise ValueError(
            "--local-processes: required (processes to start on this machine), e.g. --local-processes 2; "
            "on several hosts run one launcher per host with the same flags"
        )
    if args.local_processes < 1:
        raise ValueError(f"--local-processes {args.local_processes}: must be at least 1, e.g. --local-processes 2")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts}: must be >= 0, e.g. --max-restarts 3")
    if args.nodes is not None and args.nodes < 1:
        raise ValueError(f"--nodes {args.nodes}: must be at least 1, e.g. --nodes 2")
    where = placement(os.environ if env is None else env, args.nodes)
    if where is not None and where.count == 1:  # one host: the processes meet on the loopback address
        where = None
    total = args.local_processes * (where.count if where is not None else 1)
    if not 1 <= args.min_processes <= total:
        raise ValueError(
            f"--min-processes {args.min_processes}: must be in 1..{total} (--local-processes on every host), "
            "e.g. --min-processes 1"
        )
    port = args.launch_port
    if port is None:
        port = where.port if where is not None and where.port is not None else DEFAULT_LAUNCH_PORT
    if not 0 < port < 65536:
        raise ValueError(f"--launch-port {port}: must be in 1..65535, e.g. --launch-port {DEFAULT_LAUNCH_PORT}")
    train_argv = strip_flags(argv, LAUNCHER_FLAGS)
    for flag in GIVEN_BY_LAUNCHER:
        if any(a == flag or a.startswith(flag + "=") for a in train_argv):
            raise ValueError(f"{flag}: the launcher gives it to each process; leave it out")
    launch = LaunchConfig(args.local_processes, args.max_restarts, args.min_processes, args.rejoin, where, port)
    return launch, train_argv, cli.from_args(args)


def strip_flags(argv: Sequence[str], flags: dict[str, bool]) -> list[str]:
    """``argv`` without ``flags`` (name -> whether it takes a value; ``--name value`` or ``--name=value``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = flags[name] and "=" not in arg
            continue
        out.append(arg)
    return out


def mesh_text(shape: dict[str, int]) -> str:
    """``data=2,fsdp=2`` for a resolved mesh shape (axes of size 1 left out)."""
    return ",".join(f"{a}={n}" for a, n in shape.items() if n != 1) or "data=1"


def outer_for(config, processes: int, total: int | None = None) -> dict[str, int] | None:
    """``--mesh-outer`` for ``processes`` processes (None when it is not given).

    The processes of a restart keep their devices, so each axis keeps its part inside a process and only the
    mesh's ``-1`` axis changes size: its part across processes becomes what the other axes' parts leave of
    ``processes`` (``data=-1,fsdp=2 --mesh-outer data=3`` on 3 processes -> ``data=2`` on 2). On ``total``
    processes (the job's first layout) and on one process (where it has no effect) it is the flag as given.

    Raises:
      ValueError: The other axes' parts across processes do not divide ``processes``.
    """
    given = config.parallelism.outer
    if given is None or processes in (total, 1):
        return None if given is None else dict(given)
    fill = next((a for a, n in config.parallelism.mesh_shape.items() if n == -1), None)
    outer = dict(given)
    if fill is None:  # no axis can change size: the mesh check refuses other device counts
        return outer
    rest = math.prod(n for a, n in outer.items() if a != fill)
    if processes % rest:
        raise ValueError(
            f"--mesh-outer {format_mesh(given)}: the axes other than {fill} span {rest} processes, which does not "
            f"divide {processes} processes"
        )
    outer[fill] = processes // rest
    return outer


def layout_for(config, processes: int, total: int | None = None) -> str:
    """The mesh ``config`` resolves to on ``processes`` processes of ``--cpu-devices`` devices each (of ``total``
    at the start: see `outer_for`), checked as the training processes will check it before any device work.

    Returns:
      The mesh as ``data=2,fsdp=2``, or a phrase when the processes decide it themselves (``--plan auto``,
      or no ``--cpu-devices`` to count the devices by).

    Raises:
      ValueError: The layout does not fit those devices (the check's one-line reason).
    """
    outer = outer_for(config, processes, total)
    if config.cluster.plan == "auto":
        return "planned by --plan auto"
    if config.cluster.cpu_devices is None:
        return "resolved by the processes"
    devices = processes * config.cluster.cpu_devices
    resolved = resolve_mesh(config, devices)
    tokenizer = load_tokenizer(config.data.tokenizer, config.data.eod_token)
    validate(resolved, devices, tokenizer)
    fit.check_estimate(resolved)
    if outer is not None and processes > 1:
        split_outer_inner(resolved.parallelism.mesh_shape, processes, config.cluster.cpu_devices, outer)
    return mesh_text(resolved.parallelism.mesh_shape)


def choose(
    config, available: int, least: int, layout: Callable[[int], str] | None = None
) -> tuple[int, str, list[str]]:
    """The most processes, from ``available`` down to ``least``, whose layout fits (``layout``: count -> mesh,
    raising ValueError; `layout_for` by default).

    Returns:
      ``(processes, mesh, refusals)``: processes 0 when none fits; one reason per count refused.
    """
    layout = layout or (lambda count: layout_for(config, count))
    refusals = []
    for count in range(available, least - 1, -1):
        try:
            return count, layout(count), refusals
        except ValueError as e:
            refusals.append(f"{count} process{'es' if count > 1 else ''}: {e}")
    return 0, "", refusals


def free_port() -> int:
    """A TCP port free on this machine now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL it when the launcher dies (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


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
                self.layouts[processes] = f"error: {e}"
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
            children.append(subprocess.Popen(command, env=env, preexec_fn=_die_with_parent))
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


class RemoteHost:
    """Host 0's end of another host's launcher: starts and signals training processes there and learns when they
    end (JSON lines over TCP, `follow` on the other end). A host whose launcher disconnects is lost: each of
    its running processes then counts as killed (SIGKILL)."""

    def __init__(self, sock, index: int):
        import threading

        self.sock, self.index, self.alive = sock, index, True
        self.children: dict[int, RemoteChild] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name=f"launch-host-{index}", daemon=True).start()

    def send(self, message: dict) -> None:
        try:
            with self._lock:
                self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            self._lose()

    def start(self, slot: int, command: list[str], env: dict[str, str]) -> RemoteChild:
        """Starts ``command`` in ``slot`` there, with ``env`` added to that host's environment where it does not
        set those variables itself."""
        child = self.children[slot] = RemoteChild(self, slot)
        if not self.alive:
            child.returncode = -signal.SIGKILL
        self.send({"op": "start", "slot": slot, "command": command, "env": env})
        return child

    def _read(self) -> None:
        with self.sock.makefile("r") as lines:
            try:
                for line in lines:
                    message = json.loads(line)
                    child = self.children.get(message.get("slot"))
                    if child is not None and "exit" in message:
                        child.returncode = int(message["exit"])
            except (OSError, ValueError):
                pass
        self._lose()

    def _lose(self) -> None:
        self.alive = False
        for child in self.children.values():
            if child.returncode is None:
                child.returncode = -signal.SIGKILL


class RemoteChild:
    """A training process on another host (the part of `subprocess.Popen` the launcher uses), told about by
    that host's launcher (`RemoteHost`)."""

    def __init__(self, host: RemoteHost, slot: int):
        self.host, self.slot, self.pid, self.returncode = host, slot, None, None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            self.host.send({"op": "signal", "slot": self.slot, "signal": int(signum)})

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"process in slot {self.slot} on host {self.host.index}", timeout)
            time.sleep(0.05)
        return self.returncode


def gather_hosts(launch: LaunchConfig, timeout: float, log: Callable[[str], None]) -> dict[int, RemoteHost]:
    """On host 0: waits for every other host's launcher to connect to ``--launch-port``. With ``--rejoin`` it
    keeps listening afterwards (`admit_returning`): a host whose launcher is started again takes its place.

    Raises:
      RuntimeError: A host did not connect within ``timeout`` seconds (``--dist-timeout``), or said an index
        outside the job.
    """
    import socket

    server = socket.create_server(("", launch.launch_port), reuse_port=False)
    server.settimeout(1.0)
    remotes: dict[int, RemoteHost] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(remotes) < launch.hosts - 1:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, launch.hosts)) - set(remotes))
                raise RuntimeError(
                    f"--dist-timeout {timeout:.0f}: host(s) {', '.join(map(str, missing))} did not connect to "
                    f"--launch-port {launch.launch_port} on {launch.placement.coordinator}; start one launcher per host"
                )
            try:
                sock, _ = server.accept()
            except TimeoutError:
                continue
            index = _hello(sock, launch)
            if index in remotes:
                sock.close()
                raise RuntimeError(f"two launchers said they are host {index}; give each host its own index")
            remotes[index] = RemoteHost(sock, index)
            log(f"launch: host {index} of {launch.hosts} connected")
    except BaseException:
        server.close()
        raise
    if not launch.rejoin:
        server.close()
        return remotes
    import threading

    threading.Thread(
        target=admit_returning, args=(server, launch, remotes, log), name="launch-admit", daemon=True
    ).start()
    return remotes


def _hello(sock, launch: LaunchConfig) -> int:
    """Reads a connecting launcher's first line and returns its host index.

    Raises:
      RuntimeError: An index outside the job, or other flags than this launcher's (the socket is closed).
    """
    sock.settimeout(HELLO_TIMEOUT)
    hello = json.loads(sock.makefile("r").readline() or "{}")
    sock.settimeout(None)
    index = hello.get("host")
    if not isinstance(index, int) or not 0 < index < launch.hosts:
        sock.close()
        raise RuntimeError(f"a launcher said it is host {index!r}; expected one of 1..{launch.hosts - 1}")
    if hello.get("local_processes") != launch.local_processes:
        sock.close()
        raise RuntimeError(
            f"host {index} runs --local-processes {hello.get('local_processes')}, host 0 "
            f"{launch.local_processes}: give every launcher the same flags"
        )
    return index


def admit_returning(server, launch: LaunchConfig, remotes: dict[int, RemoteHost], log: Callable[[str], None]) -> None:
    """On host 0 with ``--rejoin``, for the rest of the job: a launcher started again on a host whose launcher
    went away takes that host's place in ``remotes``, so its slots are reachable again and the job grows back
    onto them at the next checkpoint boundary (`Launcher.watch`). A launcher for a host still connected, or
    with other flags, is turned away with one line."""
    while True:
        try:
            sock, _ = server.accept()
        except TimeoutError:
            continue
        except OSError:  # the server was closed
            return
        try:
            index = _hello(sock, launch)
        except (RuntimeError, OSError, ValueError) as e:
            log(f"launch: turned a connecting launcher away: {e}")
            continue
        if index in remotes and remotes[index].alive:
            sock.close()
            log(f"launch: turned away a second launcher for host {index}: its first is still connected")
            continue
        remotes[index] = RemoteHost(sock, index)
        log(f"launch: host {index} of {launch.hosts} connected again; its processes rejoin at the next checkpoint")


def follow(launch: LaunchConfig, timeout: float, log: Callable[[str], None]) -> int:
    """On a host other than 0: connects to host 0's launcher and runs the training processes it asks for on
    this host, telling it when each ends, until host 0's launcher says the job ended (its exit status is
    returned) or disconnects (`LOST_LAUNCHER`)."""
    import select
    import socket

    where = launch.placement
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((where.coordinator, launch.launch_port), timeout=5)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"--launch-port {launch.launch_port}: no launcher answers on host 0 ({where.coordinator}) "
                    f"within --dist-timeout {timeout:.0f} s ({e})"
                ) from e
            time.sleep(0.5)
    sock.settimeout(None)
    sock.sendall((json.dumps({"host": where.index, "local_processes": launch.local_processes}) + "\n").encode())
    log(f"launch: host {where.index} of {where.count} connected to {where.coordinator}:{launch.launch_port}")
    children: dict[int, subprocess.Popen] = {}
    env, buffer = child_env(os.environ), b""
    FOLLOWING.update(children=children)
    try:
        while True:
            for slot, child in list(children.items()):
                if child.poll() is not None:
                    del children[slot]
                    sock.sendall((json.dumps({"slot": slot, "exit": child.returncode}) + "\n").encode())
            if not select.select([sock], [], [], POLL)[0]:
                continue
            data = sock.recv(65536)
            if not data:
                log(f"error: the launcher on host 0 ({where.coordinator}) went away; stopping this host's processes")
                return LOST_LAUNCHER
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                message = json.loads(line)
                if message["op"] == "start":
                    extra = {k: v for k, v in message.get("env", {}).items() if k not in env}
                    child = subprocess.Popen(message["command"], env=env | extra, preexec_fn=_die_with_parent)
                    children[message["slot"]] = child
                    index = message["command"][message["command"].index("--process-id") + 1]
                    count = message["command"][message["command"].index("--num-processes") + 1]
                    log(f"launch: process {index} of {count} (slot {message['slot']}) started, pid {child.pid}")
                elif message["op"] == "signal" and message["slot"] in children:
                    children[message["slot"]].send_signal(message["signal"])
                elif message["op"] == "end":
                    return int(message["code"])
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()
        sock.close()


LOST_LAUNCHER = 3
"""Exit status of a launcher on host 1.. whose host 0 launcher went away (as a training process that lost a peer)."""
FOLLOWING: dict = {}
"""The training processes a following launcher runs (`follow`), for its signal handler."""


def _pass_on(signum, frame) -> None:
    """SIGTERM or SIGINT to a following launcher: passed to its training processes (they save and end)."""
    for child in FOLLOWING.get("children", {}).values():
        if child.poll() is None:
            child.send_signal(signum)


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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        launch, train_argv, config = parse(argv)

        def log(line):
            print(line, flush=True)

        timeout = config.cluster.dist_timeout
        if launch.placement is not None and launch.placement.index != 0:
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, _pass_on)
            return follow(launch, timeout, log)
        remotes = gather_hosts(launch, timeout, log) if launch.hosts > 1 else {}
        launcher = Launcher(launch, train_argv, config, log=log, remotes=remotes)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, launcher.terminate)
        code = 2  # an error below ends the other hosts' launchers as it ends this one
        try:
            code = launcher.run()
            return code
        finally:
            for remote in list(remotes.values()):
                remote.send({"op": "end", "code": code})
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
