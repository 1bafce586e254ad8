"""The layout of a restart: how many processes to train on after some were lost, and the mesh split over
them (the ``-1`` axis and ``--mesh-outer`` re-derived for the process count, checked before any start).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sharding.mesh import format_mesh, split_outer_inner
from train.data.tokenizer import load_tokenizer
from train.reports import fit
from train.setup.checks import validate
from train.setup.flagnames import render
from train.setup.mesh_fit import resolve_mesh_or_suggest


def mesh_text(shape: dict[str, int]) -> str:
    """``data=2,fsdp=2`` for a resolved mesh shape (axes of size 1 left out)."""
    return ",".join(f"{a}={n}" for a, n in shape.items() if n != 1) or "data=1"


def outer_for(config, processes: int, total: int | None = None) -> dict[str, int] | None:
    """``--mesh-outer`` for ``processes`` processes (None when it is not given).

    The processes of a restart keep their devices, so each axis keeps its part inside a process and only the
    mesh's ``-1`` axis changes size: its part across processes becomes what the other axes' parts leave of
    ``processes`` (``data=-1,fsdp=2 --mesh-outer data=3`` on 3 processes -> ``data=2`` on 2). On ``total``
    processes (the job's first layout) and on one process (where it has no effect) it is the flag as given.

    Raises:
      ValueError: The other axes' parts across processes do not divide ``processes``.
    """
    given = config.parallelism.outer
    if given is None or processes in (total, 1):
        return None if given is None else dict(given)
    fill = next((a for a, n in config.parallelism.mesh_shape.items() if n == -1), None)
    outer = dict(given)
    if fill is None:  # no axis can change size: the mesh check refuses other device counts
        return outer
    rest = math.prod(n for a, n in outer.items() if a != fill)
    if processes % rest:
        raise ValueError(
            f"--mesh-outer {format_mesh(given)}: the axes other than {fill} span {rest} processes, which does not "
            f"divide {processes} processes"
        )
    outer[fill] = processes // rest
    return outer


def layout_for(config, processes: int, total: int | None = None) -> str:
    """The mesh ``config`` resolves to on ``processes`` processes of ``--cpu-devices`` devices each (of ``total``
    at the start: see `outer_for`), checked as the training processes will check it before any device work.

    Returns:
      The mesh as ``data=2,fsdp=2``, or a phrase when the processes decide it themselves (``--plan auto``,
      or no ``--cpu-devices`` to count the devices by).

    Raises:
      ValueError: The layout does not fit those devices (the check's one-line reason).
    """
    outer = outer_for(config, processes, total)
    if config.cluster.plan == "auto":
        return "planned by --plan auto"
    if config.cluster.cpu_devices is None:
        return "resolved by the processes"
    devices = processes * config.cluster.cpu_devices
    resolved = resolve_mesh_or_suggest(config, devices)
    tokenizer = load_tokenizer(config.data.tokenizer, config.data.eod_token)
    validate(resolved, devices, tokenizer)
    fit.check_estimate(resolved)
    if outer is not None and processes > 1:
        split_outer_inner(resolved.parallelism.mesh_shape, processes, config.cluster.cpu_devices, outer)
    return mesh_text(resolved.parallelism.mesh_shape)


def choose(
    config, available: int, least: int, layout: Callable[[int], str] | None = None
) -> tuple[int, str, list[str]]:
    """The most processes, from ``available`` down to ``least``, whose layout fits (``layout``: count -> mesh,
    raising ValueError; `layout_for` by default).

    Returns:
      ``(processes, mesh, refusals)``: processes 0 when none fits; one reason per count refused.
    """
    layout = layout or (lambda count: layout_for(config, count))
    refusals = []
    for count in range(available, least - 1, -1):
        try:
            return count, layout(count), refusals
        except ValueError as e:
            refusals.append(f"{count} process{'es' if count > 1 else ''}: {render(e)}")
    return 0, "", refusals
