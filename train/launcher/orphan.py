"""A training process whose launcher is gone says so and stops, instead of dying without a word.

`train.launch` starts each training process with its own pid in `LAUNCHER_ENV` and asks the kernel to send
the process `PARENT_GONE_SIGNAL` when the launcher dies (Linux ``PR_SET_PDEATHSIG``,
`train.launcher.hosts.die_with_parent`).
`watch_launcher`, called early in the training process, answers that signal (and, should the main thread be
blocked inside a collective where no Python signal handler runs, a daemon thread that sees its parent change
within half a second) with one line: which launcher is gone, the newest complete checkpoint and how to go on,
then exit status `train.launcher.peers.LOST_PROCESS_EXIT`. Without the variable (not started by a launcher)
nothing is installed.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

LAUNCHER_ENV = "MESHWORK_LAUNCHER_PID"
"""The environment variable holding the pid of the launcher that started a training process."""
PARENT_GONE_SIGNAL = signal.SIGUSR2
"""The signal the kernel sends a training process when its launcher dies."""
POLL_SECONDS = 0.5


def launcher_pid(env=None) -> int | None:
    """The pid in `LAUNCHER_ENV` (None: not started by a launcher, or not a number)."""
    value = (os.environ if env is None else env).get(LAUNCHER_ENV, "")
    return int(value) if value.isdigit() else None


def gone_message(pid: int, note: str) -> str:
    """The line of a process whose launcher ``pid`` is gone; ``note``: the newest checkpoint in words."""
    return (
        f"the launcher (pid {pid}) that started this process is gone (killed?), so this process stops; {note}; "
        "start python -m train.launch again with the same flags and --resume"
    )


def watch_launcher(note: Callable[[], str], stop: Callable[[str], None]) -> int | None:
    """Answers the launcher's death (see the module docstring) with ``stop(gone_message(...))``; ``note``
    gives the newest checkpoint in words when it happens. Returns the launcher's pid (None: no launcher, nothing
    installed)."""
    pid = launcher_pid()
    if pid is None:
        return None
    fired = threading.Event()

    def gone(*_):
        if not fired.is_set():
            fired.set()
            stop(gone_message(pid, note()))

    if threading.current_thread() is threading.main_thread():
        signal.signal(PARENT_GONE_SIGNAL, gone)

    def poll():
        while not fired.wait(POLL_SECONDS):
            if os.getppid() != pid:
                gone()

    threading.Thread(target=poll, name="meshwork-launcher-watch", daemon=True).start()
    if os.getppid() != pid:  # it died before the watch began
        gone()
    return pid
