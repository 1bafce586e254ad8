"""Peers of a multi-process run: a heartbeat through the coordination service that reports a lost process in one
line and ends the survivors (`PeerWatch`, its reasons in `train.launcher.distributed`'s module docstring), and
the few agreements between processes the run needs (`any_process`, `sync_processes`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from train.launcher.distributed import DistributedConfig
from train.launcher.output import close_output_filters
from train.setup.flagnames import render

LOST_PROCESS_EXIT = 3  # exit status of a survivor that lost a peer (1: non-finite loss, 2: bad input/failed save)


_BEAT_KEY = "meshwork/beat/"


_DONE_KEY = "meshwork/done/"


class PeerWatch:
    """Notices a process that stopped answering and ends this one with a message instead of an abort.

    Two daemon threads: one writes this process's heartbeat counter into the
    coordination service's key-value store every ``interval`` seconds and
    reads everyone's; the other (no I/O, so a hung call cannot silence it)
    judges: a peer whose counter has not moved for ``grace`` seconds, or a
    coordinator that has not answered for as long, is lost. Then
    ``lost(message)`` runs, by default printing ``error: MESSAGE`` and
    ``os._exit(LOST_PROCESS_EXIT)``. A process that finishes calls `close`,
    which tells the others it is done, so its silence is not a loss.

    Args:
      process_id: this process (0 hosts the coordinator).
      num_processes: how many processes the job has.
      timeout: ``--dist-timeout`` in seconds; ``grace`` is half of it.
      client: the key-value client: ``key_value_set(key, value,
        allow_overwrite)`` and ``key_value_dir_get(prefix)`` (JAX's
        distributed runtime client by default).
      checkpoint_note: returns the words for the latest complete checkpoint
        (e.g. `checkpoint_note`), called once a peer is lost.
      lost: called with the one-line message (default: print and exit).
    """

    def __init__(
        self,
        process_id: int,
        num_processes: int,
        timeout: float,
        client=None,
        checkpoint_note: Callable[[], str] | None = None,
        lost: Callable[[str], None] | None = None,
    ):
        if timeout <= 0:
            raise ValueError(f"--dist-timeout {timeout}: must be a positive number of seconds, e.g. 300")
        self.process_id, self.num_processes = process_id, num_processes
        self.grace = timeout / 2
        self.interval = min(1.0, self.grace / 5)
        self._client = client
        self._note = checkpoint_note
        self._lost = lost or exit_lost
        self._stop = threading.Event()
        now = time.monotonic()
        self._seen = {p: (None, now) for p in range(num_processes) if p != process_id}  # peer -> (beat, when it moved)
        self._done: set[int] = set()
        self._contact = now  # the coordinator's last answer
        self._threads: list[threading.Thread] = []

    def start(self) -> PeerWatch:
        if self._client is None:
            from jax._src import distributed as jax_distributed  # the client JAX made (no public accessor)

            self._client = getattr(getattr(jax_distributed, "global_state", None), "client", None)
            if self._client is None:
                raise RuntimeError("no jax.distributed client to watch the other processes with: call initialize first")
        for target, name in ((self._beat, "meshwork-peer-beat"), (self._judge, "meshwork-peer-judge")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self) -> None:
        """Tells the other processes this one ended on purpose, and stops watching."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._client.key_value_set(f"{_DONE_KEY}{self.process_id}", "1", allow_overwrite=True)
        except Exception:  # the coordinator is gone too; nothing left to tell
            pass

    def __enter__(self) -> PeerWatch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _beat(self) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            try:
                self._client.key_value_set(f"{_BEAT_KEY}{self.process_id}", str(count), allow_overwrite=True)
                beats = dict(self._client.key_value_dir_get(_BEAT_KEY))
                done = dict(self._client.key_value_dir_get(_DONE_KEY))
            except Exception:  # the coordinator did not answer; the judge counts the silence
                self._stop.wait(self.interval)
                continue
            now = time.monotonic()
            self._contact = now
            self._done = {int(k.rsplit("/", 1)[-1]) for k in done}
            for peer, (last, _) in list(self._seen.items()):
                beat = beats.get(f"{_BEAT_KEY}{peer}")
                if beat != last:
                    self._seen[peer] = (beat, now)
            self._stop.wait(self.interval)

    def _judge(self) -> None:
        while not self._stop.wait(self.interval):
            message = self.verdict(time.monotonic())
            if message is not None:
                note = self._note() if self._note is not None else ""
                self._lost(f"{message}{'; ' + note if note else ''}")
                return

    def verdict(self, now: float) -> str | None:
        """The lost-process message at time ``now`` (`time.monotonic`), or None while all answer."""
        if now - self._contact > self.grace and self.process_id != 0:
            return (
                f"process 0 of {self.num_processes} (the coordinator) stopped answering: no reply for "
                f"{now - self._contact:.0f} s"
            )
        silent = [p for p, (_, when) in sorted(self._seen.items()) if now - when > self.grace and p not in self._done]
        if silent:
            who = ", ".join(map(str, silent))
            return (
                f"process{'es' if len(silent) > 1 else ''} {who} of {self.num_processes} stopped answering: "
                f"no heartbeat for {now - self._seen[silent[0]][1]:.0f} s"
            )
        return None


def exit_lost(message: str) -> None:
    """Prints ``error: MESSAGE`` and leaves at once: no shutdown barrier, no stack trace."""
    print(f"error: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    close_output_filters()
    os._exit(LOST_PROCESS_EXIT)


def checkpoint_note(directory, launched: bool = False) -> str:
    """Words for the latest complete checkpoint under ``directory`` and how to continue.

    E.g. ``the latest complete checkpoint is step 15 in runs/a/checkpoints; restart every
    process with --resume``; under `train.launch` (``launched``: ``--external-coordinator``) the
    launcher restarts by itself, and the words say so. Damaged steps are skipped (`checkpoints.verify`).
    """
    from checkpoints.verify import latest_verified_step  # slow: orbax

    try:
        step = latest_verified_step(directory).step
    except Exception as e:  # a damaged folder: say so, never raise from the failure path
        return f"no complete checkpoint in {directory} ({render(e).splitlines()[0] if str(e) else e})"
    how = "the launcher restarts from it" if launched else "restart every process with --resume"
    if step is None:
        return f"no checkpoint in {directory} yet; restarting begins at step 0"
    return f"the latest complete checkpoint is step {step} in {directory}; {how}"


def watch_peers(config: DistributedConfig, checkpoint_dir=None) -> PeerWatch | None:
    """Starts a `PeerWatch` after `initialize` when the job has several processes (None otherwise).

    Args:
      config: the flags given to `initialize` (``--dist-timeout`` sets the grace).
      checkpoint_dir: the run's checkpoint folder, named in the message.

    Returns:
      The started watch; call ``close()`` when the run ends on purpose.
    """
    import jax

    if jax.process_count() == 1:
        return None
    note = (lambda: checkpoint_note(checkpoint_dir, config.external)) if checkpoint_dir is not None else None
    return PeerWatch(jax.process_index(), jax.process_count(), config.timeout, checkpoint_note=note).start()


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (every process must call it; one process: ``flag`` itself)."""
    import jax

    if jax.process_count() == 1:
        return bool(flag)
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.int32(bool(flag)))).any())


def sync_processes(name: str) -> None:
    """Waits until every process has called this with ``name`` (a barrier; one process: returns at once)."""
    import jax

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
