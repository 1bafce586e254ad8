"""Several processes (one per host) on JAX's own distributed runtime.

`initialize` starts `jax.distributed` from ``--coordinator HOST:PORT
--num-processes N --process-id I``; with none of them given it leaves cluster
detection to JAX (SLURM, Open MPI, Kubernetes, or ``JAX_COORDINATOR_ADDRESS``)
when such an environment is present, and otherwise runs as one process.
CPU devices exchange data through the gloo collectives, so several processes
on one machine behave like several hosts.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import zlib

LOOPBACK_NAMES = ("localhost", "ip6-localhost", "ip6-loopback")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """``--coordinator``, ``--num-processes``, ``--process-id``, ``--dist-timeout`` (seconds)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    timeout: int = 300

    @property
    def explicit(self) -> bool:
        return self.coordinator is not None or self.num_processes is not None or self.process_id is not None

    def validate(self) -> None:
        """Raises ValueError naming the flag when the flags are incomplete or inconsistent."""
        if self.timeout <= 0:
            raise ValueError(f"--dist-timeout {self.timeout}: must be a positive number of seconds, e.g. 300")
        if not self.explicit:
            return
        missing = [flag for flag, value in (("--coordinator", self.coordinator),
                                            ("--num-processes", self.num_processes),
                                            ("--process-id", self.process_id)) if value is None]
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
    if config.explicit:
        jax.distributed.initialize(
            coordinator_address=config.coordinator,
            num_processes=config.num_processes,
            process_id=config.process_id,
            initialization_timeout=config.timeout,
        )
        _check_loopback_single_host(config)
        return f"process {config.process_id} of {config.num_processes}, coordinator {config.coordinator}"
    cluster = detected_cluster()
    if cluster is None:
        return "one process"
    jax.distributed.initialize(initialization_timeout=config.timeout)
    return f"process {jax.process_index()} of {jax.process_count()} (detected by JAX from {cluster})"


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
      RuntimeError: When the backend already started with another count.
    """
    if cpu_devices is None:
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have != cpu_devices:
            raise RuntimeError(
                f"--cpu-devices {cpu_devices}: JAX already started with {have} CPU devices in this process"
            ) from None
