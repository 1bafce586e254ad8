"""Mesh specs and device meshes.

A mesh is written as in ``--mesh data=2,fsdp=-1,tensor=2``: named axes from
`sharding.axes.MESH_AXES` with their sizes, at most one ``-1`` that takes the
remaining devices. Axes left out have size 1, so every meshwork mesh has all
six axes, in the order of `MESH_AXES` (slowest links outermost, ``tensor``
innermost).

With several processes (one per host), each axis is split into an *outer* part
that spans processes (slow network links) and an *inner* part inside one
process (fast links such as NVLink), in the manner of
`jax.experimental.mesh_utils.create_hybrid_device_mesh`. By default the inner
part is filled from the innermost axis outwards, so ``tensor`` (then
``sequence``, ``context``, then ``fsdp``) stays inside a process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sharding.axes import MESH_AXES, RESERVED_MESH_AXES
from sharding.errors import ConfigError, Field

MESH_EXAMPLE = "data=2,fsdp=-1,tensor=2"

MeshShape = dict[str, int]
"""Axis name -> size, over all of `MESH_AXES` in their order."""


def _field_error(field: str, spec: str, problem: str, example: str = MESH_EXAMPLE) -> ConfigError:
    return ConfigError(Field(field, repr(spec)), f": {problem} (example: ", Field(field, example), ")")


def parse_axis_sizes(spec: str, *, field: str = "mesh", allow_fill: bool = True) -> dict[str, int]:
    """Parses ``AXIS=SIZE,...`` into sizes in mesh order, without resolving ``-1``.

    Args:
      spec: e.g. ``"data=2,fsdp=-1,tensor=2"``; spaces around items are ignored, empty items are not.
      field: the configuration field the errors name (``mesh``, or ``mesh_outer``).
      allow_fill: whether one size may be ``-1``.

    Returns:
      Axis -> size for every axis of `MESH_AXES` (1 where not given), in mesh
      order; the axis given as ``-1``, if any, keeps ``-1``.

    Raises:
      ConfigError: an empty spec or an empty item (two commas in a row, a comma at an end: a typing slip
        rather than a choice, so never read as "the default"), an unknown or reserved axis, an axis given twice, a size
        that is not an integer, zero, negative other than ``-1``, or a second
        ``-1``. The message names the field, the item and shows a valid example.
    """
    sizes = {axis: 1 for axis in MESH_AXES}
    seen: set[str] = set()
    fill_axis = None
    if not spec.strip():
        raise _field_error(field, spec, "is empty; give at least one axis")
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            raise _field_error(field, spec, "has an empty item (two commas in a row, or one at an end)")
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise _field_error(field, spec, f"item {item!r} is not AXIS=SIZE")
        if name in RESERVED_MESH_AXES:
            raise _field_error(field, spec, f"mesh axis {name!r} is reserved and not supported yet")
        if name not in MESH_AXES:
            raise _field_error(field, spec, f"unknown mesh axis {name!r}; known axes are {', '.join(MESH_AXES)}")
        if name in seen:
            raise _field_error(field, spec, f"axis {name!r} is given twice")
        seen.add(name)
        try:
            size = int(value)
        except ValueError:
            raise _field_error(field, spec, f"size {value.strip()!r} of axis {name!r} is not an integer") from None
        if size == -1 and allow_fill:
            if fill_axis is not None:
                raise _field_error(field, spec, f"both {fill_axis!r} and {name!r} are -1; at most one axis may be -1")
            fill_axis = name
        elif size <= 0:
            allowed = "a positive integer, or -1 for the remaining devices" if allow_fill else "a positive integer"
            raise _field_error(field, spec, f"size {size} of axis {name!r} must be {allowed}")
        sizes[name] = size
    return sizes


def parse_mesh(spec: str, num_devices: int, seen_by: str = "JAX sees") -> MeshShape:
    """Parses a mesh (the field ``mesh``, ``AXIS=SIZE,...``) and resolves it against the device count.

    Args:
      spec: ``AXIS=SIZE,...`` over the axes ``data, stage, fsdp, context, sequence,
        tensor``; at most one size may be ``-1``, meaning all devices the
        other axes leave. Empty means ``fsdp=-1``.
      num_devices: the number of devices the mesh must cover.
      seen_by: who counts them, for the messages: ``"JAX sees"``, or ``"the cluster has"`` where a planner
        describes devices it does not run on.

    Returns:
      Axis -> size for all of `MESH_AXES`, in mesh order; the product is
      ``num_devices``.

    Raises:
      ValueError: as `parse_axis_sizes`, or when the product of the sizes is
        not ``num_devices``, or ``-1`` cannot take a whole number of devices.
        The message names the device count and suggests a shape that fits.
    """
    if not spec.strip():
        spec = "fsdp=-1"
    sizes = parse_axis_sizes(spec)
    fill = [axis for axis, size in sizes.items() if size == -1]
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if num_devices % known:
            raise _field_error(
                "mesh",
                spec,
                f"the other axes use {known} devices, which does not divide the {num_devices} devices {seen_by}",
                _suggest(num_devices),
            )
        sizes[fill[0]] = num_devices // known
    elif known != num_devices:
        raise _field_error(
            "mesh",
            spec,
            f"the sizes multiply to {known} but {seen_by} {num_devices} devices; "
            f"make the product {num_devices} or give one axis -1",
            _suggest(num_devices),
        )
    return sizes


def _suggest(num_devices: int) -> str:
    if num_devices >= 4 and num_devices % 2 == 0:
        return f"fsdp={num_devices // 2},tensor=2"
    return f"fsdp={num_devices}"


def format_mesh(shape: Mapping[str, int]) -> str:
    """``{'data': 2, 'fsdp': 4, ...}`` -> ``"data=2,fsdp=4"`` (size-1 axes left out)."""
    items = [f"{axis}={size}" for axis, size in shape.items() if size != 1]
    return ",".join(items) if items else "single device"


def split_outer_inner(
    shape: Mapping[str, int],
    num_processes: int,
    devices_per_process: int,
    outer: Mapping[str, int] | None = None,
) -> tuple[dict[str, int], dict[str, int]]:
    """Splits each axis into a part across processes and a part inside one.

    Args:
      shape: resolved mesh shape (axis -> total size).
      num_processes: number of processes (hosts); the outer parts multiply to it.
      devices_per_process: devices in each process; the inner parts multiply to it.
      outer: axis -> how much of it spans processes (``--mesh-outer``). When
        None, the inner parts are filled from the innermost axis outwards
        (``tensor``, ``sequence``, ``context``, ``fsdp``, ``stage``, ``data``).

    Returns:
      ``(outer, inner)``: axis -> size dicts in mesh order, with
      ``outer[a] * inner[a] == shape[a]`` for each axis ``a``.

    Raises:
      ValueError: when an outer size does not divide its axis, or the parts do
        not multiply to the process and per-process device counts.
    """
    if outer is None:
        inner = {axis: 1 for axis in shape}
        remaining = devices_per_process
        for axis in reversed(list(shape)):
            inner[axis] = math.gcd(shape[axis], remaining)
            remaining //= inner[axis]
        if remaining != 1:
            raise ConfigError(
                f"mesh {format_mesh(shape)} cannot be laid out with whole groups of "
                f"{devices_per_process} devices per process; give ",
                Field("mesh_outer"),
            )
        outer_sizes = {axis: shape[axis] // inner[axis] for axis in shape}
    else:
        outer_sizes = {axis: int(outer.get(axis, 1)) for axis in shape}
        for axis, size in outer_sizes.items():
            if size <= 0 or shape[axis] % size:
                raise ConfigError(
                    Field("mesh_outer", f"{axis}={size}"),
                    f" does not divide the axis size {shape[axis]} of ",
                    Field("mesh", format_mesh(shape)),
                )
        inner = {axis: shape[axis] // outer_sizes[axis] for axis in shape}
    if math.prod(outer_sizes.values()) != num_processes:
        raise ValueError(
            f"the outer (across-process) parts {format_mesh(outer_sizes)} multiply to "
            f"{math.prod(outer_sizes.values())}, but there are {num_processes} processes"
        )
    if math.prod(inner.values()) != devices_per_process:
        raise ValueError(
            f"the inner (in-process) parts {format_mesh(inner)} multiply to "
            f"{math.prod(inner.values())}, but each process has {devices_per_process} devices"
        )
    return outer_sizes, inner


def device_grid(
    shape: Mapping[str, int],
    devices: Sequence[Any],
    outer: Mapping[str, int] | None = None,
) -> np.ndarray:
    """Arranges devices into an array of the mesh shape.

    Devices are sorted by ``(process_index, id)``. Each axis index is
    ``outer_index * inner_size + inner_index``, so the devices along the inner
    part of an axis belong to one process.

    Args:
      shape: resolved mesh shape; its product must be ``len(devices)``.
      devices: objects with ``process_index`` and ``id`` (JAX devices).
      outer: optional across-process split, as in `split_outer_inner`.

    Returns:
      An object array of devices with shape ``tuple(shape.values())``.

    Raises:
      ValueError: when processes hold different numbers of devices, or as
        `split_outer_inner`.
    """
    if math.prod(shape.values()) != len(devices):
        raise ValueError(f"mesh {format_mesh(shape)} needs {math.prod(shape.values())} devices, got {len(devices)}")
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    processes = sorted({d.process_index for d in ordered})
    per_process = len(ordered) // len(processes)
    counts = {p: sum(d.process_index == p for d in ordered) for p in processes}
    if any(count != per_process for count in counts.values()):
        raise ValueError(f"processes hold different numbers of devices: {counts}")
    grid = np.empty(len(ordered), dtype=object)
    grid[:] = ordered
    return grid[grid_positions(shape, len(processes), per_process, outer)]


def grid_positions(
    shape: Mapping[str, int], num_processes: int, per_process: int, outer: Mapping[str, int] | None = None
) -> np.ndarray:
    """`device_grid` as positions: the index, in ``(process_index, id)`` order, of the device at each mesh
    position (int array of the mesh's shape). Needs no device objects, so a planner can lay out thousands of
    simulated devices without making them.

    Args:
      shape: resolved mesh shape; its product must be ``num_processes * per_process``.
      num_processes: processes (hosts), each holding ``per_process`` devices.
      per_process: devices per process.
      outer: optional across-process split, as in `split_outer_inner`.

    Raises:
      ValueError: as `split_outer_inner`.
    """
    outer_sizes, inner = split_outer_inner(shape, num_processes, per_process, outer)
    n = len(shape)
    grid = np.arange(num_processes * per_process).reshape(tuple(outer_sizes.values()) + tuple(inner.values()))
    interleave = [i for axis in range(n) for i in (axis, n + axis)]
    return grid.transpose(interleave).reshape(tuple(shape.values()))


def make_mesh(
    shape: Mapping[str, int],
    devices: Sequence[Any] | None = None,
    outer: Mapping[str, int] | None = None,
):
    """Builds the `jax.sharding.Mesh` for a resolved mesh shape.

    All axes are `AxisType.Auto`: XLA's SPMD partitioner places the work from
    sharding annotations (GSPMD/Shardy), rather than explicit-sharding mode.

    Args:
      shape: axis -> size over `MESH_AXES` (as returned by `parse_mesh`).
      devices: the devices to use; default `jax.devices()`.
      outer: optional across-process split (``--mesh-outer``); see
        `split_outer_inner`.

    Returns:
      A `jax.sharding.Mesh` with axis names `MESH_AXES`.

    Raises:
      ValueError: when the shape does not fit the devices.
    """
    import jax
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    grid = device_grid(shape, devices, outer)
    return Mesh(grid, tuple(shape), axis_types=(AxisType.Auto,) * len(shape))


def mesh_shape(mesh) -> MeshShape:
    """The axis -> size dict of a `jax.sharding.Mesh`."""
    return dict(mesh.shape)


def crossing_axes(mesh) -> dict[str, int]:
    """Axis -> number of processes it spans, for the axes that cross processes.

    Args:
      mesh: a `jax.sharding.Mesh`.

    Returns:
      Only axes that span more than one process, with the number of distinct
      process indices along that axis (from device 0's position).
    """
    devices = mesh.devices
    result = {}
    for i, axis in enumerate(mesh.axis_names):
        index = [0] * devices.ndim
        index[i] = slice(None)
        spanned = {d.process_index for d in devices[tuple(index)]}
        if len(spanned) > 1:
            result[axis] = len(spanned)
    return result
