"""Processes of one job agree on their compiled step's collectives before the first step.

XLA builds one executable per device model, so in a job whose processes hold different GPU kinds (A100 and
H100 hosts) each process compiles its own program from the same StableHLO. Choices the compiler makes from
the device (the latency-hiding scheduler's cost model, collective-combining thresholds, autotuned fusions)
can then order, merge or split the collectives differently on different processes, and collectives issued
in a different order on different ranks wait on each other for ever (NCCL hangs; nothing fails).

Two measures, both before the first step:

* `mixed_kind_options`: where the processes report more than one device kind, the step is compiled with
  `MIXED_KIND_OPTIONS`, XLA options that take the device-dependent choices out of the collective schedule.
* `check_same_collectives`: each process publishes its compiled step's collective schedule
  (`sharding.hlo.collective_schedule`: kind, shapes, device groups, in the order issued) and its fingerprint
  through the distributed runtime's key-value store; after a barrier every process reads all fingerprints
  and, on any difference, stops with the same one-line `CollectiveMismatchError` naming process 0 and the
  first process that differs, their device kinds, the first differing collective, and the fix.

`docs/heterogeneous.md` ("Mixed GPU kinds in one job") explains both.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from jax._src import distributed as jax_distributed  # the client JAX made (no public accessor)

from sharding import hlo

MIXED_KIND_OPTIONS: dict[str, Any] = {
    # The latency-hiding scheduler orders collectives by a cost model of the device (its analytical latency
    # estimator, or a profile of that GPU): off, collectives keep the program's order on every kind.
    "xla_gpu_enable_latency_hiding_scheduler": False,
    # Combining thresholds given explicitly (XLA's long-standing 30 MiB), so that no default derived from the
    # device (its memory) decides which collectives are merged.
    "xla_gpu_all_reduce_combine_threshold_bytes": 30 * 2**20,
    "xla_gpu_all_gather_combine_threshold_bytes": 30 * 2**20,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 30 * 2**20,
    "xla_gpu_collective_permute_combine_threshold_bytes": 30 * 2**20,
}
"""XLA compile options for a job whose processes hold different device kinds (each a `DebugOptions` field;
every one accepted as a compile option by the jaxlib of JAX 0.10.2 and 0.12.1, checked by
`tests/test_agreement.py`; 0.11 not checked)."""

_PREFIX = "meshwork/collectives"


class CollectiveMismatchError(RuntimeError):
    """The processes compiled the step with different collective schedules: running it would hang."""


def client():
    """JAX's distributed runtime client (after ``jax.distributed.initialize``).

    Raises:
      RuntimeError: When the distributed runtime was not started.
    """
    found = getattr(getattr(jax_distributed, "global_state", None), "client", None)
    if found is None:
        raise RuntimeError("no distributed runtime client: the processes were not started together")
    return found


def fingerprint(schedule: Sequence[str]) -> str:
    """A short hash of a collective schedule (`sharding.hlo.collective_schedule` lines)."""
    return hashlib.sha256("\n".join(schedule).encode()).hexdigest()[:16]


def mixed_kind_options(kinds: Sequence[str]) -> dict[str, Any]:
    """`MIXED_KIND_OPTIONS` when ``kinds`` (one device kind per process) holds more than one kind, else none."""
    return dict(MIXED_KIND_OPTIONS) if len(set(kinds)) > 1 else {}


def exchange_kinds(client, process_index: int, process_count: int, kind: str, timeout_s: float) -> list[str]:
    """Every process's device kind, in process order, through the key-value store of ``client``.

    Args:
      client: JAX's distributed runtime client (``key_value_set``, ``blocking_key_value_get``).
      process_index, process_count: This process and how many there are.
      kind: This process's ``device.device_kind``.
      timeout_s: How long to wait for the slowest process.
    """
    client.key_value_set(f"{_PREFIX}/kind/{process_index}", kind, allow_overwrite=True)
    ms = int(timeout_s * 1000)
    return [client.blocking_key_value_get(f"{_PREFIX}/kind/{p}", ms) for p in range(process_count)]


def first_difference(mine: Sequence[str], theirs: Sequence[str]) -> tuple[int, str, str]:
    """``(index, one's line, other's line)`` of the first collective where two schedules differ; a schedule
    that ends first shows ``(none: N collectives)``."""
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else f"(none: {len(mine)} collectives)"
        b = theirs[i] if i < len(theirs) else f"(none: {len(theirs)} collectives)"
        if a != b:
            return i, a, b
    raise ValueError("the schedules are the same")


def mismatch_message(first: int, other: int, kinds: Sequence[str], index: int, lines: tuple[str, str]) -> str:
    """The one line every process stops with: the two processes, their kinds, the first differing collective
    and what to do."""
    same_kind = kinds[first] == kinds[other]
    remedy = (
        "the device kinds are the same, so the programs differ by something else the processes were given "
        "(XLA_FLAGS, JAX versions): start every process with the same ones"
        if same_kind
        else "run each device kind as its own job, or start every process with the same XLA_FLAGS and JAX version "
        "(meshwork already compiles mixed kinds with the options of docs/heterogeneous.md); if they still differ, "
        "add the XLA_FLAGS that pin what differs (docs/heterogeneous.md, 'Mixed GPU kinds in one job')"
    )
    return (
        f"the processes compiled different collective schedules for the train step, which would hang at its "
        f"first collective: process {first} ({kinds[first]}) and process {other} ({kinds[other]}) differ first at "
        f"collective #{index}: {lines[0]!r} against {lines[1]!r}; {remedy}"
    )


def check_same_collectives(
    hlo_text: str,
    *,
    client,
    process_index: int,
    process_count: int,
    kinds: Sequence[str],
    timeout_s: float,
    tag: str = "train",
    clock: Callable[[], float] = time.perf_counter,
) -> str:
    """Compares this process's compiled step's collective schedule with every other process's.

    Each process publishes its schedule's fingerprint and lines under ``tag``, waits at a barrier for all,
    then reads every fingerprint (one directory read). All processes see the same fingerprints, so all stop,
    with the same message (process 0 against the lowest-numbered process that differs from it).

    Args:
      hlo_text: This process's ``compiled.as_text()``.
      client: JAX's distributed runtime client (``key_value_set``, ``wait_at_barrier``, ``key_value_dir_get``,
        ``blocking_key_value_get``).
      process_index, process_count: This process and how many there are.
      kinds: Every process's device kind (`exchange_kinds`).
      timeout_s: How long to wait for the slowest process to compile.
      tag: Which program (a key prefix; one check per program and job).
      clock: Seconds, for the line's timing.

    Returns:
      A line for the log: the collectives agreed on, the seconds the check took (reading the schedule, the
      key-value store's round trips) and, apart, the seconds spent at the barrier waiting for the others.

    Raises:
      CollectiveMismatchError: When any process's schedule differs (`mismatch_message`).
    """
    start = clock()
    schedule = hlo.collective_schedule(hlo_text)
    mine = fingerprint(schedule)
    base = f"{_PREFIX}/{tag}"
    client.key_value_set(f"{base}/lines/{process_index}", "\n".join(schedule), allow_overwrite=True)
    client.key_value_set(f"{base}/print/{process_index}", json.dumps(mine), allow_overwrite=True)
    ms = int(timeout_s * 1000)
    waited = clock()
    client.wait_at_barrier(f"{base}/published", ms)
    waited = clock() - waited
    prints = {
        int(key.rsplit("/", 1)[1]): json.loads(value) for key, value in client.key_value_dir_get(f"{base}/print/")
    }
    differing = sorted(p for p, value in prints.items() if value != prints[0])
    if differing:
        other = differing[0]
        texts = (client.blocking_key_value_get(f"{base}/lines/{p}", ms) for p in (0, other))
        first_lines, other_lines = (text.split("\n") if text else [] for text in texts)
        index, a, b = first_difference(first_lines, other_lines)
        raise CollectiveMismatchError(mismatch_message(0, other, kinds, index, (a, b)))
    return (
        f"collectives: the {process_count} processes compiled the same {len(schedule)} collectives "
        f"(fingerprint {mine}; the check took {clock() - start - waited:.3f} s besides {waited:.2f} s waiting for "
        "the slowest process to compile)"
    )
