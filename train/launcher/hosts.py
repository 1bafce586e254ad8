"""Which host a launcher runs on: the job's hosts, this host's index and where host 0 is, from the scheduler's
environment (SLURM, torchrun / Kubeflow PyTorchJob, Kubernetes JobSet).

One `train.launch` runs per host; the launcher on host 0 hosts the coordination service and decides the
restarts, the others connect to it (`HostPlacement.coordinator`). Pure Python: nothing here touches JAX.

Sources, first match wins:

- torchrun's variables (``MASTER_ADDR``, ``MASTER_PORT``, ``NNODES``/``NODE_RANK``, or a PyTorchJob's
  ``WORLD_SIZE``/``RANK`` with one launcher per pod);
- SLURM (``SLURM_STEP_NODELIST`` or ``SLURM_JOB_NODELIST`` expanded, ``SLURM_NODEID``, ``SLURM_NNODES``;
  host 0 is the first host of the node list, as ``scontrol show hostnames`` orders it);
- a Kubernetes JobSet of one replicated job with one Job (``replicas: 1``) whose indexed pods are the hosts
  (``JOBSET_NAME``, ``REPLICATED_JOB_NAME``, ``JOB_COMPLETION_INDEX``); host 0 is the pod ``<jobset>-<replicated job>-0-0.<subdomain>``, the JobSet's DNS name, the subdomain
  the JobSet's name unless ``JOBSET_SUBDOMAIN`` says otherwise; the count comes from ``--nodes``, as a
  JobSet puts no host count in the environment).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from train.launcher.orphan import PARENT_GONE_SIGNAL

POLL = 0.2
"""Seconds between looks at the training processes."""
CONSUMED = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "WORLD_SIZE", "RANK")
"""torchrun's variables: read by the launcher and kept from the training processes (they get explicit flags,
so neither JAX's cluster detection nor the loopback check reads the scheduler's view)."""


@dataclasses.dataclass(frozen=True)
class HostPlacement:
    """Where this launcher stands in a job of several hosts.

    Attributes:
      coordinator: host 0's name or address (the others connect to it).
      index: this host's index in ``0..count-1``.
      count: hosts in the job, one launcher each.
      port: the launchers' meeting port on host 0 from the environment (``MASTER_PORT``), or None.
      source: the environment it was read from, for the log (``SLURM``, ``torchrun``, ``JobSet``).
    """

    coordinator: str
    index: int
    count: int
    port: int | None
    source: str


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list expanded, in order: ``node[01-03,7],login1`` -> node01, node02, node03,
    node7, login1 (zero padding kept; several bracket groups in a name multiply out).

    Raises:
      ValueError: An unbalanced bracket or a range that runs backwards.
    """
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            if text[start:i]:
                names.extend(_expand_name(text[start:i], text))
            start = i + 1
    if depth:
        raise ValueError(f"host list {text!r}: unbalanced '['")
    return names


def _expand_name(name: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    out = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"host list {whole!r}: {part!r} is not a number or a range like 01-04")
        if high and int(high) < int(low):
            raise ValueError(f"host list {whole!r}: the range {part} runs backwards")
        for n in range(int(low), int(high or low) + 1):
            out.extend(_expand_name(f"{head}{n:0{len(low)}d}{tail}", whole))
    return out


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    if not value.strip().isdigit():
        raise ValueError(f"{name}={value!r}: expected a whole number")
    return int(value)


def placement(env: Mapping[str, str], nodes: int | None = None) -> HostPlacement | None:
    """This launcher's place among the job's hosts, read from ``env`` (None: one host, nothing says otherwise).

    Args:
      env: the environment (``os.environ``).
      nodes: ``--nodes``, the host count where the environment has none (a JobSet); otherwise it must agree.

    Raises:
      ValueError: An index outside the host count, a count that disagrees with ``--nodes``, a JobSet
        without ``--nodes``, or a malformed value (naming the variable).
    """
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
    if "MASTER_ADDR" in env:
        index_name = "NODE_RANK" if "NODE_RANK" in env else "RANK"
        count_name = "NNODES" if "NNODES" in env else "WORLD_SIZE"
        if index_name not in env or count_name not in env:
            raise ValueError(
                "MASTER_ADDR is set but not NODE_RANK/NNODES (torchrun) nor RANK/WORLD_SIZE (PyTorchJob): "
                "set e.g. NNODES=2 NODE_RANK=0 on the first host"
            )
        found = HostPlacement(env["MASTER_ADDR"], _int(env, index_name), _int(env, count_name), port, "torchrun")
    elif "SLURM_JOB_NODELIST" in env or "SLURM_STEP_NODELIST" in env:
        hosts = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
        count = _int(env, "SLURM_NNODES") if "SLURM_NNODES" in env else len(hosts)
        index = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        if not hosts:
            raise ValueError("SLURM_JOB_NODELIST is empty: run the launcher inside an allocation (srun)")
        found = HostPlacement(hosts[0], index, count, port, "SLURM")
    elif "JOBSET_NAME" in env:
        if nodes is None:
            raise ValueError("--nodes: a JobSet does not say how many hosts it has; pass e.g. --nodes 2")
        jobset, job = env["JOBSET_NAME"], env.get("REPLICATED_JOB_NAME", "")
        if env.get("JOB_INDEX", "0") != "0":
            raise ValueError(
                f"JOB_INDEX={env['JOB_INDEX']}: the launcher expects one Job (replicas: 1) whose pods are the hosts"
            )
        index = _int(env, "JOB_COMPLETION_INDEX")
        subdomain = env.get("JOBSET_SUBDOMAIN") or jobset
        found = HostPlacement(f"{jobset}-{job}-0-0.{subdomain}", index, nodes, port, "JobSet")
    else:
        if nodes not in (None, 1):
            raise ValueError(
                f"--nodes {nodes}: no SLURM, torchrun (MASTER_ADDR) or JobSet environment says where host 0 is; "
                "set MASTER_ADDR=HOST0 NNODES=N NODE_RANK=I on each host"
            )
        return None
    if nodes is not None and nodes != found.count:
        raise ValueError(f"--nodes {nodes}: the {found.source} environment says {found.count} hosts; leave --nodes out")
    if found.count < 1 or not 0 <= found.index < found.count:
        raise ValueError(f"{found.source}: host index {found.index} is outside 0..{found.count - 1}")
    return found


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment of a training process a launcher starts: ``env`` without the scheduler's placement
    variables (SLURM_*, torchrun's), which the launcher has turned into explicit flags."""
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") and k not in CONSUMED}


def die_with_parent() -> None:
    """In a child before exec: signal it when the launcher dies (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing),
    with `train.launcher.orphan.PARENT_GONE_SIGNAL`, which the training process answers with one line and exits
    (`train.launcher.orphan.watch_launcher`) instead of being killed without a word."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, PARENT_GONE_SIGNAL)
    except (OSError, AttributeError):
        pass
