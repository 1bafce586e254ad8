"""The command line of ``python -m train.launch``: the launcher's own flags beside every ``python -m train.train``
flag, split apart (`parse`) so that the training processes get theirs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from train.launcher.hosts import HostPlacement, placement
from train.setup import cli, configfile
from train.setup.parser import build_parser as build_train_parser

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
