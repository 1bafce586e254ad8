"""Elastic launcher: ``python -m train.launch --local-processes N [train.train flags]``.

Starts N training processes (`train.train`, one per simulated host) on this machine and hosts JAX's
coordination service itself, outside every training process (`train.launcher.distributed.start_service`; the
processes join it with ``--external-coordinator``), so losing any training process, process 0 included,
leaves the service and the launcher up. It watches the processes; when one is lost (killed, crashed,
or reported silent by a peer's `train.launcher.peers.PeerWatch`), it stops the others (SIGTERM, then
SIGKILL after `train.launcher.supervisor.STOP_GRACE` seconds: a survivor is blocked in a collective with the lost peer) and starts
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
does not wait for them; ``--mesh-outer`` is re-derived for the new count (`train.launcher.replan.outer_for`). The training
processes share JAX's persistent compilation cache in the run folder (`train.launcher.supervisor.COMPILATION_CACHE`), so a restart on
a process count seen before loads its step instead of compiling it. With ``--rejoin`` a lost process's
slot is started again at the next checkpoint boundary: the launcher asks the running processes to stop
(SIGTERM: they finish the step in flight and save) once a newer checkpoint than the one they resumed from
is complete, and restarts on every slot.

Several hosts: one launcher per host, each reading its place from SLURM's, torchrun's or a JobSet's
environment (`train.launcher.hosts.placement`). The launcher on host 0 hosts the service and runs the loop above for
every host's slots (slot ``s`` on host ``s // --local-processes``); the others connect to it at
``--launch-port`` (`train.launcher.remote.gather_hosts`), start the processes it asks for and report their ends (`train.launcher.remote.follow`,
`train.launcher.remote.RemoteHost`), so the launchers agree on every restart because one decides. A host whose launcher goes away
loses its processes; with ``--rejoin`` host 0 keeps listening, and a launcher started on that host again
takes its place (`train.launcher.remote.admit_returning`): its slots rejoin at the next checkpoint boundary.

Each restart is one line: what was lost, the step resumed, the old and new mesh, the steps recomputed.
Exit status: 0 when training finished; the training processes' own status for a non-finite loss (1)
or an error (2); `train.launcher.supervisor.RESTARTS_EXHAUSTED` when ``--max-restarts`` is used up or too few processes are left.

Elastic restarts on the survivors of an SPMD job follow the in-job restart designs of NVIDIA's
NVRx and torchelastic's agent (a supervisor per host that restarts workers from the last checkpoint).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from train.launcher.command import parse
from train.launcher.remote import follow, gather_hosts, pass_on
from train.launcher.supervisor import Launcher
from train.setup.flagnames import render


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
                signal.signal(signum, pass_on)
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
        print(f"error: {render(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
