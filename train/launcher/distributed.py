"""Several processes (one per host) on JAX's own distributed runtime.

`initialize` starts `jax.distributed` from ``--coordinator HOST:PORT
--num-processes N --process-id I``; with none of them given it leaves cluster
detection to JAX (SLURM, Open MPI, Kubernetes, or ``JAX_COORDINATOR_ADDRESS``)
when such an environment is present, and otherwise runs as one process.
CPU devices exchange data through the gloo collectives, so several processes
on one machine behave like several hosts.

A lost process (kill -9, a dead host) is reported, not aborted on. JAX's own
failure path cannot be made clean: its coordination service notices missing
heartbeats after ``heartbeat_timeout_seconds`` and then terminates every
survivor with a C++ check failure (exit 134); a ``missed_heartbeat_callback``
cannot be given through ``jax.distributed.initialize``, and the client's
binding aborts with ``std::bad_cast`` when one is passed (jax 0.10);
``jax_enable_recoverability`` with ``get_live_nodes`` aborts on a wrong
service incarnation. So `PeerWatch` keeps its own heartbeat through the
coordination service's key-value store, a second failure detector that fires
at half of ``--dist-timeout``, before JAX's (set to the whole of it). On a
silent peer, or a coordinator that no longer answers, it prints one
``error:`` line naming the process and the latest complete checkpoint and
leaves with `os._exit` (status `LOST_PROCESS_EXIT`), skipping the shutdown
barrier that would otherwise wait for the lost process. A survivor blocked
inside a gloo collective is covered too: the watch runs in its own threads.

Limit (jax 0.10): when process 0 hosts the coordinator and is killed, the
survivors' JAX clients poll the closed coordinator for errors and abort at
once (C++ LOG(FATAL), exit 134), before any Python code runs; nothing a
caller of ``jax.distributed.initialize`` can set prevents it. `start_service`
and ``--external-coordinator`` move the service out of the training
processes (`train.launch` hosts it), which makes that loss survivable too;
they read JAX's private runtime binding, in one place (`_runtime_module`).
The watch's coordinator branch still covers a coordinator that hangs without closing.

Usage (the entry point, after `initialize` and before the first step)::

    initialize(config)
    watch = watch_peers(config, run_dir / "checkpoints")   # None with one process
    ...train...
    if watch is not None:
        watch.close()                                      # ended on purpose: not a lost process
"""

from __future__ import annotations

import dataclasses
import inspect
import ipaddress
import os
import re
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

LOOPBACK_NAMES = ("localhost", "ip6-localhost", "ip6-loopback")
LOST_PROCESS_EXIT = 3  # exit status of a survivor that lost a peer (1: non-finite loss, 2: bad input/failed save)
_BEAT_KEY = "meshwork/beat/"
_DONE_KEY = "meshwork/done/"
GLOO_CONNECTED = (
    b"[Gloo] Rank ",
    (b" is connected to ", b" peer ranks. ", b"Expected number of connected peer ranks is : "),
)
"""gloo's connection line, ``[Gloo] Rank R is connected to P peer ranks. Expected number of connected peer
ranks is : P``, as its opening and the fixed pieces after it (numbers and the newline between), written to
standard output for each group of devices that first exchanges data."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """``--coordinator``, ``--num-processes``, ``--process-id``, ``--dist-timeout`` (seconds) and
    ``--external-coordinator`` (the coordination service runs outside the training processes, e.g. in
    `train.launch`, so process 0 only connects to it)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    timeout: int = 300
    external: bool = False

    @property
    def explicit(self) -> bool:
        return self.coordinator is not None or self.num_processes is not None or self.process_id is not None

    def validate(self) -> None:
        """Raises ValueError naming the flag when the flags are incomplete or inconsistent."""
        if self.timeout <= 0:
            raise ValueError(f"--dist-timeout {self.timeout}: must be a positive number of seconds, e.g. 300")
        if not self.explicit:
            if self.external:
                raise ValueError(
                    "--external-coordinator: needs --coordinator HOST:PORT --num-processes N --process-id I "
                    "(train.launch gives them)"
                )
            return
        missing = [
            flag
            for flag, value in (
                ("--coordinator", self.coordinator),
                ("--num-processes", self.num_processes),
                ("--process-id", self.process_id),
            )
            if value is None
        ]
        if missing:
            raise ValueError(
                f"{', '.join(missing)} missing: give all of --coordinator HOST:PORT --num-processes N "
                "--process-id I (e.g. --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0), or none"
            )
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--coordinator {self.coordinator!r}: expected HOST:PORT, e.g. 10.0.0.1:1234")
        if self.num_processes < 1:
            raise ValueError(f"--num-processes {self.num_processes}: must be at least 1")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"--process-id {self.process_id}: must be in 0..{self.num_processes - 1} for "
                f"--num-processes {self.num_processes}"
            )
        if is_loopback(host) and _cluster_spans_hosts():
            raise ValueError(
                f"--coordinator {self.coordinator}: a loopback address cannot be reached from other hosts, "
                "and this job spans several nodes; give the coordinator host's network address"
            )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 possibly in brackets) is a loopback address."""
    host = host.strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cluster_spans_hosts() -> bool:
    """Whether the scheduler's environment says the job runs on several nodes."""
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if os.environ.get(name, "1").isdigit() and int(os.environ.get(name, "1")) > 1:
            return True
    return False


def detected_cluster() -> str | None:
    """The cluster environment JAX would detect, if any (name for the log)."""
    if "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", os.environ.get("SLURM_NPROCS", "1"))) > 1:
        return "SLURM"
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "Open MPI"
    if "JAX_COORDINATOR_ADDRESS" in os.environ:
        return "JAX_COORDINATOR_ADDRESS"
    if "KUBERNETES_SERVICE_HOST" in os.environ and "JOBSET_NAME" in os.environ:
        return "Kubernetes JobSet"
    return None


def initialize(config: DistributedConfig) -> str:
    """Starts the distributed runtime when asked for or detected.

    Must run before anything touches JAX devices.

    Returns:
      A line for the log saying how the processes were set up.

    Raises:
      ValueError: as `DistributedConfig.validate`, or when a loopback
        coordinator turns out to serve processes on several hosts.
      RuntimeError: from JAX when the coordinator cannot be reached within
        ``--dist-timeout`` seconds.
    """
    import jax

    config.validate()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = _timeouts(jax.distributed.initialize, config.timeout)
    if config.explicit:
        with _service_elsewhere(config.external):
            jax.distributed.initialize(
                coordinator_address=config.coordinator,
                num_processes=config.num_processes,
                process_id=config.process_id,
                initialization_timeout=config.timeout,
                **timeouts,
            )
        _default_sigterm()
        if config.num_processes > 1:
            drop_output_lines(*GLOO_CONNECTED)
        _check_loopback_single_host(config)
        hosted = " (service outside the training processes)" if config.external else ""
        return f"process {config.process_id} of {config.num_processes}, coordinator {config.coordinator}{hosted}"
    cluster = detected_cluster()
    if cluster is None:
        return "one process"
    jax.distributed.initialize(initialization_timeout=config.timeout, **timeouts)
    _default_sigterm()
    if jax.process_count() > 1:
        drop_output_lines(*GLOO_CONNECTED)
    return f"process {jax.process_index()} of {jax.process_count()} (detected by JAX from {cluster})"


def _default_sigterm() -> None:
    """Gives SIGTERM its default action (end the process) back after ``jax.distributed.initialize``.

    JAX's preemption notifier installs a C handler for SIGTERM there that only records the signal (and
    Python's `signal.getsignal` does not see it), so a SIGTERM before the training loop installs its own
    handler (`train.runtime.loop.StopFlag`) would be swallowed, and a launcher stopping a process that is still
    starting would wait for its SIGKILL. Before the loop there is nothing to save, so ending is right; nothing
    here reads JAX's preemption sync point.
    """
    import signal

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class LineFilter:
    """Passes every byte written to a file descriptor through, in order, except the lines of one C++ message.

    gloo, as bundled in jaxlib, prints ``[Gloo] Rank R is connected to P peer ranks. Expected number of
    connected peer ranks is : P`` for each group of devices that first exchanges data (a dozen per process in
    the two-process example of docs/multiprocess.md), from C++ straight to file descriptor 1, and has no
    switch to silence it (``GLOO_LOG_LEVEL`` does not reach it). The lines come while the run compiles and
    runs its first collectives, not only inside ``jax.distributed.initialize``, so the filter stays for the
    life of the process: ``fd`` is pointed at a pipe, and a daemon thread copies what arrives to the
    original descriptor. Several gloo threads write their lines at once, piece by piece, so the pieces of
    two lines interleave (``[Gloo] Rank [Gloo] Rank 00 is connected to  is connected to 11 ...``): a line
    cannot be matched whole. The filter therefore reads a *burst*: from an ``opening``, it drops the fixed
    ``pieces``, numbers, further openings and newlines until it has seen as many newlines as openings; any
    other byte inside a burst is passed on. Outside a burst everything passes at once (a prompt, a progress
    bar's carriage return); only a piece cut by the end of what the pipe gave so far waits for the next read.

    `close` (at exit, and before `os._exit`) points ``fd`` back at the original and copies what is left
    in the pipe. What a C++ abort of the process leaves in the pipe is lost: a line at most, as the thread
    copies what it reads at once.

    Args:
      fd: The descriptor (1: standard output).
      opening: What each line to drop begins with (``b"[Gloo] Rank "``).
      pieces: The fixed text after the opening, between the numbers.
    """

    def __init__(self, fd: int, opening: bytes, pieces: tuple[bytes, ...]):
        self.fd, self.opening = fd, opening
        self._fixed = (opening, *pieces, b"\n")
        self._token = re.compile(b"|".join(re.escape(t) for t in self._fixed) + rb"|\d+")
        self._open = 0  # lines of the current burst not yet ended by their newline
        self._saved: int | None = None
        self._read: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> LineFilter:
        """Points ``fd`` at the pipe and starts the copying thread; returns self."""
        sys.stdout.flush()
        self._saved = os.dup(self.fd)
        self._read, write = os.pipe()
        os.dup2(write, self.fd)
        os.close(write)
        self._thread = threading.Thread(target=self._copy, name="line-filter", daemon=True)
        self._thread.start()
        return self

    def _copy(self) -> None:
        held = b""
        while True:
            try:
                chunk = os.read(self._read, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            out, held = self.filter(held + chunk, final=False)
            self._write(out)
        self._write(self.filter(held, final=True)[0])

    def filter(self, text: bytes, final: bool) -> tuple[bytes, bytes]:
        """``(what to pass on, what to hold for the next read)`` of ``text``; with ``final`` nothing is held."""
        out, i, n = bytearray(), 0, len(text)
        while i < n:
            if not self._open:
                j = text.find(self.opening, i)
                if j < 0:
                    k = next(
                        (
                            n - k
                            for k in range(min(len(self.opening) - 1, n - i), 0, -1)
                            if text.endswith(self.opening[:k])
                        ),
                        n,
                    )  # an end that may become the opening
                    out += text[i:k]
                    return (bytes(out), text[k:]) if not final else (bytes(out + text[k:]), b"")
                out += text[i:j]
                i, self._open = j + len(self.opening), 1
                continue
            rest = text[i:]
            m = self._token.match(text, i)
            if not final and (
                (m and m.end() == n) or any(t.startswith(rest) for t in self._fixed if len(t) > len(rest))
            ):
                return bytes(out), rest  # a piece (or number) cut by the end of this read
            if m:
                token = m.group()
                self._open += token == self.opening
                self._open -= token == b"\n"
                i = m.end()
            else:  # something else inside a burst: pass it on
                out += text[i : i + 1]
                i += 1
        return bytes(out), b""

    def _write(self, data: bytes) -> None:
        while data:
            try:
                data = data[os.write(self._saved, data) :]
            except OSError:  # the reader of our output is gone; nothing left to do with it
                return

    def close(self, timeout: float = 2.0) -> None:
        """Points ``fd`` back at the original descriptor and copies what the pipe still holds (waits at most
        ``timeout`` seconds: a child process may still hold the pipe open)."""
        if self._thread is None:
            return
        thread, self._thread = self._thread, None
        try:
            sys.stdout.flush()
        except (OSError, ValueError):  # closed or broken: nothing of Python's own to pass on
            pass
        os.dup2(self._saved, self.fd)  # closes this process's last write end of the pipe: the thread reads to its end
        thread.join(timeout)
        if not thread.is_alive():  # else a child still holds the pipe; the process is ending anyway
            os.close(self._read)
            os.close(self._saved)


_FILTERS: list[LineFilter] = []


def drop_output_lines(opening: bytes, pieces: tuple[bytes, ...]) -> LineFilter:
    """Drops standard output's lines of one C++ message (`LineFilter`: ``opening``, then ``pieces`` between
    numbers) for the rest of the process; the filter is closed at exit (and by `close_output_filters` before
    `os._exit`)."""
    import atexit

    if not _FILTERS:
        atexit.register(close_output_filters)
    line_filter = LineFilter(1, opening, pieces).start()
    _FILTERS.append(line_filter)
    return line_filter


def close_output_filters() -> None:
    """Closes every `drop_output_lines` filter, copying what they hold (call before `os._exit`)."""
    while _FILTERS:
        _FILTERS.pop().close()


def _runtime_module(purpose: str):
    """JAX's private binding of the distributed runtime (``jax._src.distributed._jax``), the one place it is read.

    Public JAX offers no way to host the coordination service apart from process 0: ``jax.distributed``
    starts it inside process 0's ``initialize``. Both halves below (starting a service alone, and joining
    one without starting another) go through this module's ``get_distributed_runtime_service``, present
    in jax 0.10 to 0.12.

    Raises:
      RuntimeError: naming ``purpose`` and the JAX version when this JAX lacks the binding.
    """
    import jax
    from jax._src import distributed as jax_distributed

    module = getattr(jax_distributed, "_jax", None)
    if module is None or not hasattr(module, "get_distributed_runtime_service"):
        raise RuntimeError(
            f"{purpose}: this JAX ({jax.__version__}) has no jax._src.distributed._jax."
            "get_distributed_runtime_service to host the coordination service with; use jax 0.10 to 0.12, "
            "or run train.train on each host without the launcher"
        )
    return jax_distributed, module


class _NoService:
    """Stands in for JAX's runtime binding while process 0 joins a service hosted elsewhere: every attribute
    is the binding's except ``get_distributed_runtime_service``, which starts nothing (``initialize`` then
    keeps ``global_state.service`` None, and ``shutdown`` skips it)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        if name == "get_distributed_runtime_service":
            return lambda *args, **kwargs: None
        return getattr(self._module, name)


class _service_elsewhere:
    """Context in which ``jax.distributed.initialize`` of process 0 connects to ``--coordinator`` without
    starting a coordination service of its own (``external``; otherwise it changes nothing)."""

    def __init__(self, external: bool):
        self.external = external
        self._saved = None

    def __enter__(self):
        if self.external:
            jax_distributed, module = _runtime_module("--external-coordinator")
            self._saved = (jax_distributed, module)
            jax_distributed._jax = _NoService(module)
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            jax_distributed, module = self._saved
            jax_distributed._jax = module


def start_service(port: int, num_processes: int, timeout: int):
    """Starts JAX's coordination service in this process, listening on every address at ``port``.

    For a launcher that outlives its training processes: they connect with ``--coordinator HOST:PORT
    --external-coordinator``, so losing any of them, process 0 included, leaves the service (and the
    other processes' clients) up.

    Args:
      port: TCP port to listen on.
      num_processes: how many training processes will connect.
      timeout: ``--dist-timeout`` in seconds: the service's heartbeat and shutdown timeouts.

    Returns:
      The service; call ``shutdown()`` on it once its processes have ended.

    Raises:
      RuntimeError: when this JAX lacks the binding (`_runtime_module`).
    """
    _, module = _runtime_module("train.launch")
    return module.get_distributed_runtime_service(
        f"[::]:{port}", num_processes, heartbeat_timeout=timeout, shutdown_timeout=timeout
    )


def _check_loopback_single_host(config: DistributedConfig) -> None:
    host = config.coordinator.rpartition(":")[0]
    if config.num_processes == 1 or not is_loopback(host):
        return
    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.int64(zlib.crc32(socket.gethostname().encode()))
    hosts = set(np.asarray(multihost_utils.process_allgather(mine)).ravel().tolist())
    if len(hosts) > 1:
        raise ValueError(
            f"--coordinator {config.coordinator} is a loopback address but the {config.num_processes} processes "
            f"run on {len(hosts)} hosts; give the coordinator host's network address"
        )


def setup_devices(cpu_devices: int | None) -> None:
    """Applies ``--cpu-devices`` before JAX starts its backend.

    Raises:
      ValueError: A count out of bounds (`check_cpu_devices`).
      RuntimeError: When the backend already started with another count.
    """
    if cpu_devices is None:
        return
    check_cpu_devices(cpu_devices)
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have != cpu_devices:
            raise RuntimeError(
                f"--cpu-devices {cpu_devices}: JAX already started with {have} CPU devices in this process"
            ) from None


MAX_CPU_DEVICES = 4096  # XLA's CPU client starts one stream per device; far beyond this it only grows
MIN_CPU_DEVICE_SHARE = 4 * 2**20  # bytes of available host memory per simulated device, at the least


def check_cpu_devices(count: int, available: int | None = None) -> None:
    """``--cpu-devices``: positive, at most `MAX_CPU_DEVICES`, and each device's share of the host's
    available memory at least `MIN_CPU_DEVICE_SHARE` (4 MiB).

    Without a bound, ``--cpu-devices 100000`` printed nothing and grew by 50-60 MB/s until killed; measured
    here, a CPU client with 1,024 devices starts in 1.3 s at 326 MiB resident (212 MiB with 8).

    Args:
      count: the flag's value.
      available: host memory available in bytes (default: ``MemAvailable`` of ``/proc/meminfo``; unknown
        elsewhere, then only the count is bounded).

    Raises:
      ValueError: naming ``--cpu-devices``, the bound and a count that works.
    """
    if count <= 0:
        raise ValueError(f"--cpu-devices {count}: must be positive, e.g. 8")
    if available is None:
        available = _available_memory()
    limit = MAX_CPU_DEVICES if available is None else min(MAX_CPU_DEVICES, available // MIN_CPU_DEVICE_SHARE)
    if count > limit:
        memory = (
            ""
            if available is None
            else (
                f"; this host has {available / 2**30:.1f} GiB available, at least "
                f"{MIN_CPU_DEVICE_SHARE // 2**20} MiB per device"
            )
        )
        raise ValueError(
            f"--cpu-devices {count}: at most {limit} simulated CPU devices{memory}, e.g. "
            f"--cpu-devices {min(8, max(limit, 1))}"
        )


def _available_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _timeouts(initialize: Callable, seconds: int) -> dict[str, int]:
    """JAX's heartbeat and shutdown timeouts set to ``--dist-timeout``, where this JAX accepts them.

    JAX's failure detector then fires after `PeerWatch` (half the timeout),
    and a shutdown barrier waits at most ``seconds`` for a missing process.
    """
    accepted = inspect.signature(initialize).parameters
    wanted = {"heartbeat_timeout_seconds": seconds, "shutdown_timeout_seconds": seconds}
    return {name: value for name, value in wanted.items() if name in accepted}


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
        self._lost = lost or _exit_lost
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


def _exit_lost(message: str) -> None:
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
        return f"no complete checkpoint in {directory} ({str(e).splitlines()[0] if str(e) else e})"
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
