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
service incarnation. So `train.launcher.peers.PeerWatch` keeps its own heartbeat through the
coordination service's key-value store, a second failure detector that fires
at half of ``--dist-timeout``, before JAX's (set to the whole of it). On a
silent peer, or a coordinator that no longer answers, it prints one
``error:`` line naming the process and the latest complete checkpoint and
leaves with `os._exit` (status `train.launcher.peers.LOST_PROCESS_EXIT`), skipping the shutdown
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
import socket
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

from train.launcher.output import GLOO_CONNECTED, drop_output_lines

LOOPBACK_NAMES = ("localhost", "ip6-localhost", "ip6-loopback")


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
        raise ValueError(f"--cpu-devices {count}: must be positive, e.g. --cpu-devices 8")
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
