"""A run folder is owned by one run: ``RUN_DIR/run.lock``.

The lock is a small JSON file naming its owner (``host``, ``pid``, the process's start time as Linux
counts it, ``since``), created atomically (``O_CREAT | O_EXCL``), so of two runs starting together on
one folder exactly one gets it. With several processes only process 0 takes it; the others share the
folder by design (each writes its own shards).

A lock is stale when its owner is on this host and that process has ended (no such pid, or a pid
reused by a process that started later): it is reclaimed with one line. An owner on another host
cannot be checked from here, so the run is refused unless ``--break-lock`` is given. The lock is
released when the run ends (`RunLock.release`, also called at interpreter exit); a run killed with
SIGKILL leaves a stale lock, which the next run reclaims.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from sharding.errors import ConfigError, Field, FieldText

LOCK_FILE = "run.lock"


class RunFolderLocked(ConfigError):
    """Another live run owns the folder (one line: the owner and what to do, naming the fields ``run_dir`` and
    ``break_lock``)."""


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux ``/proc/PID/stat`` field 22), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # the command name in parentheses may hold spaces
    return int(fields[19]) if len(fields) > 19 else None


def _alive(pid: int, started: int | None) -> bool:
    """Whether process ``pid`` (started at ``started``, when known) still runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    now = _start_time(pid)
    return started is None or now is None or now == started


class RunLock:
    """The lock of one run folder, held by this process.

    Use `RunLock.acquire`; `release` removes the file if it is still ours.

    Attributes:
      path: the lock file.
      owner: what it records: ``host``, ``pid``, ``started`` (clock ticks since boot), ``since`` (UTC).
    """

    def __init__(self, path: Path, owner: dict):
        self.path, self.owner, self._held = path, owner, True
        atexit.register(self.release)

    @classmethod
    def acquire(
        cls, run_dir: str | Path, log: Callable[[str], None], break_lock: bool = False, launcher: int | None = None
    ) -> RunLock:
        """Takes ``RUN_DIR/run.lock`` (creating the folder), reclaiming a stale lock with one line.

        Args:
          run_dir: the run folder.
          log: called with the line saying a stale lock was reclaimed or a lock broken (a
            `sharding.errors.FieldText`: it names ``run_dir``).
          break_lock: take over a lock whose owner runs on another host (``--break-lock``).
          launcher: the pid of the launcher that started this process, recorded as ``launcher_pid`` and named
            in a refusal (the launcher is what to stop), or None.

        Returns:
          The held `RunLock`.

        Raises:
          RunFolderLocked: a live process on this host owns the folder, or one on another host does and
            ``break_lock`` is false; names the owner, the field ``run_dir`` and what to do.
          ConfigError: the folder cannot be written, naming ``run_dir``.
        """
        folder = Path(run_dir)
        path = folder / LOCK_FILE
        host, pid = socket.gethostname(), os.getpid()
        owner = {
            "host": host,
            "pid": pid,
            "started": _start_time(pid),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **({} if launcher is None else {"launcher_pid": launcher}),
        }
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                Field("run_dir", folder), f": cannot write there ({e.strerror}); choose a writable folder"
            ) from None
        for _ in range(3):  # another run may reclaim the same stale lock meanwhile: then judge its lock
            if _create(path, owner):
                return cls(path, owner)
            held = _read(path)
            if held is None:
                if path.exists():  # not a lock this module wrote (locks are never seen half written)
                    _remove_if_same(path, None)
                    log(
                        FieldText(
                            "note: ", Field("run_dir", folder), f": replaced {path}, which did not parse as a lock"
                        )
                    )
                continue
            who = f"pid {held.get('pid')} on host {held.get('host')} (since {held.get('since')})"
            if held.get("launcher_pid") is not None:
                who += f", started by the launcher pid {held['launcher_pid']}"
            if held.get("host") == host:
                if held["pid"] != pid and not _alive(held["pid"], held.get("started")):
                    _remove_if_same(path, held)
                    log(
                        FieldText(
                            "note: ", Field("run_dir", folder), f": reclaimed the stale lock of {who}, which has ended"
                        )
                    )
                    continue
                raise RunFolderLocked(
                    Field("run_dir", folder),
                    f" is in use by another run, {who}; wait for it to end (or stop it), or choose another ",
                    Field("run_dir"),
                    " (nothing was touched)",
                )
            if not break_lock:
                raise RunFolderLocked(
                    Field("run_dir", folder),
                    f" is locked by {who}, another host, which cannot be checked from here; if that run has "
                    "ended pass ",
                    Field("break_lock"),
                    ", or choose another ",
                    Field("run_dir"),
                    " (nothing was touched)",
                )
            _remove_if_same(path, held)
            log(
                FieldText(
                    "note: ", Field("run_dir", folder), ": ", Field("break_lock"), f" took over the lock of {who}"
                )
            )
            break_lock = False  # break one lock, not a new owner's
        raise RunFolderLocked(
            Field("run_dir", folder), ": another run keeps taking the lock; choose another ", Field("run_dir")
        )

    def release(self) -> None:
        """Removes the lock file if it still names this process (idempotent)."""
        if not self._held:
            return
        self._held = False
        atexit.unregister(self.release)
        held = _read(self.path)
        if held is not None and held.get("pid") == self.owner["pid"] and held.get("host") == self.owner["host"]:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _create(path: Path, owner: dict) -> bool:
    """Creates ``path`` holding ``owner`` if it does not exist; returns whether it did.

    The owner is written to a file of this process's own, then hard-linked to ``path`` (atomic, and
    refused when ``path`` exists), so a lock file is never seen half written.
    """
    temp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        temp.write_text(json.dumps(owner) + "\n")
        os.link(temp, path)
    except FileExistsError:
        return False
    except OSError as e:
        raise ConfigError(
            Field("run_dir", path.parent), f": cannot write there ({e.strerror}); choose a writable folder"
        ) from None
    finally:
        temp.unlink(missing_ok=True)
    return True


def _read(path: Path) -> dict | None:
    """The owner a lock file records, or None when it is gone or does not parse."""
    try:
        held = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(held, dict) or not isinstance(held.get("pid"), int) or held["pid"] <= 0:
        return None  # not a lock this module wrote
    return held


def _remove_if_same(path: Path, held: dict | None) -> None:
    """Removes a stale lock file unless another run has replaced it since it was read.

    The file is first renamed to a name of this process's own, then checked: a lock taken meanwhile by
    another run is put back rather than removed.
    """
    aside = path.with_name(f"{path.name}.stale-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if _read(aside) == held or held is None:
        aside.unlink(missing_ok=True)
    elif not _create_from(aside, path):
        aside.unlink(missing_ok=True)


def _create_from(aside: Path, path: Path) -> bool:
    """Puts a lock moved to ``aside`` back at ``path`` unless a new lock is already there."""
    try:
        os.link(aside, path)
    except FileExistsError:
        return False
    aside.unlink(missing_ok=True)
    return True
