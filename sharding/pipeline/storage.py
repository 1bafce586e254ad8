"""Where a pipelined layer stack lives between steps: unpadded rows spread evenly over every device.

A `StageLayout` pads each stage to the largest stage's slot count (``[stage, slots, ...]``): a stage
with 6 layers beside stages with 10 would hold 10 layers of parameters and AdamW moments. The
`StageStorage` instead stores the stack as ``[rows, ...]``: the model's ``L`` layers (plus fewer than
``S*G`` empty rows when ``S*G`` does not divide ``L``), its first dimension split evenly over ``stage``
and the ``G`` devices of each stage the rules shard layer parameters over (``data``/``fsdp``,
`storage_axes`); the layer's other dimensions keep their rules, less those axes. Every device holds
``per_device = ceil(L / (S*G))`` whole layers, so the state per device is the state over the devices
(up to that rounding), whatever the stage split.

Placement (static, `StageStorage.placement`). After the gather, stage ``s``'s working copy has ``R*K'``
slots (the layout's slots, rounded up so that ``G`` divides them); device ``(s, g)`` of the stage provides
slots ``g, g+G, g+2G, ...`` (an all-gather over the group axes interleaves the devices' pieces). It stores
up to ``q`` of the layers in those slots itself; the rest (a stage with more layers than its devices store)
are stored in spare rows of devices ``(s', g)`` of stages with fewer (or, when none has a spare row at that
``g``, of any device).

With ``--pipeline-gather microbatch`` the rows are spread over ``stage`` alone (``G`` = 1 in the placement)
and each row's features keep the rules' batch axes (`storage_axes`): every device of a stage holds its share
of each of the stage's rows, so the per-microbatch gather assembles one layer at a time (an all-gather over
those axes) and returns one layer's gradient (a reduce-scatter), instead of a block of ``G`` whole layers,
one from each device. The state per device is the same (up to the rounding of ``q``).

Gathering once per step (`sharding.pipeline.weights.Weights`): each device sends the rows it stores for
others with one `jax.lax.ppermute` over ``(stage, *groups)`` per distance that moves any, appends what it receives to its
own rows, picks its slots from them (a gather of at most ``R*K'/G`` rows, in the compute dtype) and
all-gathers the pieces over the group axes into the ``[repeats, slots, ...]`` working copy (the empty slots
exist only in that transient copy). The gradients go the reverse way: reduce-scattered over the group
axes, put back into the local rows, the received rows' sent back, and summed over the
remaining batch axes. MaxText's ``pipeline_fsdp_ag_once`` is the same gather for even stages with padded
weights; Megatron-LM and torchtitan give uneven stages unpadded weights by running one program per stage.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sharding import axes as ax
from sharding.pipeline.layout import StageLayout


@dataclasses.dataclass(frozen=True)
class Placement:
    """The static tables of a `StageStorage` (see the module docstring).

    Attributes:
      per_device: q, the rows each device stores: ``ceil(L / (S*G))``.
      chunk_slots: K', slots per chunk of the working copy: the layout's ``K`` rounded up so that ``G``
        divides ``R*K'`` (slots past a chunk's layer count are empty, as in the padded layout).
      row_table: ``[rows]`` int32, the canonical layer stored in each row (-1: empty); row
        ``(s*G + g)*q + j`` is row ``j`` of device ``(s, g)``.
      sends: per distance ``d`` along the ``(stage, *groups)`` ring of ``S*G`` devices (device ``p = s*G + g``
        sends to ``(p + d) % (S*G)``; a multiple of ``G`` stays at the same ``g``), ``[S, G, c_d]`` int32 local
        rows each device sends (0 where it sends nothing; those rows are never read), or None when nothing
        moves by ``d``.
      received: ``C = sum(c_d)``, the rows each device receives (appended after its ``q`` own).
      local_index: ``[S, G, W]`` int32, ``W = R*K' / G``: for device ``(s, g)``, the row of its ``[q + C]``
        local rows that goes to working-copy slot ``w*G + g`` (-1: an empty slot).
    """

    per_device: int
    chunk_slots: int
    row_table: np.ndarray
    sends: tuple[np.ndarray | None, ...]
    received: int
    local_index: np.ndarray


@dataclasses.dataclass(frozen=True)
class StageStorage:
    """The unpadded storage of a pipelined layer stack.

    Attributes:
      layout: the `StageLayout` the stack runs in (which layers each stage computes).
      groups: G, the devices of one stage the rows are spread over (the product of `storage_axes`'
        sizes; 1 when the rules shard no layer parameter over ``data`` or ``fsdp``).
    """

    layout: StageLayout
    groups: int = 1

    @property
    def stages(self) -> int:
        return self.layout.stages

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def per_device(self) -> int:
        """q, the rows every device holds: ``ceil(L / (S*G))``."""
        return self.placement.per_device

    @property
    def rows(self) -> int:
        """``S * G * q``: the stack's rows, ``L`` layers and the empty rest."""
        return self.stages * self.groups * self.per_device

    def stacked_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """``[layers, *rest]`` -> ``[rows, *rest]``.

        Raises:
          ValueError: a first dimension other than the model's layers.
        """
        if shape[0] != self.num_layers:
            raise ValueError(f"a stacked array of shape {tuple(shape)} does not have {self.num_layers} layers")
        return (self.rows, *shape[1:])

    def describe(self) -> str:
        """The layout's description and the storage: ``'10,10,6,6 (gpipe), stored as 32 rows over 4x2'``."""
        return f"{self.layout.describe()}, stored unpadded as {self.rows} rows over {self.stages}x{self.groups} devices"

    def to_meta(self) -> dict[str, Any]:
        """JSON-friendly form, stored with checkpoints (`StageLayout.to_meta` and ``groups``)."""
        return {**self.layout.to_meta(), "storage": "rows", "groups": self.groups}

    @functools.cached_property
    def placement(self) -> Placement:
        """The row table, the sends and the gather index (computed once; pure NumPy)."""
        return _place(self.layout, self.groups)


def _working_table(layout: StageLayout, groups: int) -> np.ndarray:
    """``[S, R*K']``: the canonical layer in each slot of each stage's working copy (-1: empty)."""
    k = layout.chunk_slots
    while (layout.repeats * k) % groups:
        k += 1
    table = layout.layer_table().reshape(layout.stages, layout.repeats, layout.chunk_slots)
    padded = np.full((layout.stages, layout.repeats, k), -1, np.int32)
    padded[:, :, : layout.chunk_slots] = table
    return padded.reshape(layout.stages, -1)


def _place(layout: StageLayout, groups: int) -> Placement:
    """`StageStorage.placement`: of the placements that prefer each distance between devices of the same
    index ``g`` for the moved rows, the one that receives the fewest rows per device (one ``ppermute`` of
    ``c_d`` rows per distance that moves any)."""
    devices = layout.stages * groups
    work = _working_table(layout, groups)
    column = [[_filled(work[s, g::groups]) for g in range(groups)] for s in range(layout.stages)]
    q = -(-layout.num_layers // devices)
    # no device holds more than its q rows' worth: nothing moves, every preferred distance places alike
    distances = range(groups, devices, groups) if max(len(c) for row in column for c in row) > q else (groups,)
    return min((_place_preferring(layout, groups, d, work, column) for d in distances), key=lambda p: p.received)


def _filled(slots: np.ndarray) -> list[int]:
    """The layers of a working-copy column, empty slots (-1) left out."""
    return slots[slots >= 0].tolist()


def _place_preferring(
    layout: StageLayout, groups: int, prefer: int, work: np.ndarray, column: list[list[list[int]]]
) -> Placement:
    """A placement whose moved rows travel ``prefer`` devices along the ``(stage, *groups)`` ring where they can.

    Device ``(s, g)`` (ring index ``s*G + g``) provides the working-copy slots ``w*G + g`` of stage ``s``
    (the all-gather over the group axes interleaves them): it stores up to ``q = ceil(L / (S*G))`` of those
    layers itself and receives the rest from devices with spare rows: of other stages at the same ``g``
    where there are any (a ``ppermute`` over ``stage`` alone), else any device. ``S*G*q >= L`` rows, so the
    spare rows always suffice. ``work`` is `_working_table`, ``column[s][g]`` the layers of its slots
    ``w*G + g`` on stage ``s`` (`_filled`), shared by the distances `_place` tries.
    """
    stages = layout.stages
    devices = stages * groups
    width = work.shape[1] // groups
    q = -(-layout.num_layers // devices)
    # per device p = s*G + g (the ring index), flat: its stored layers and how many
    held = [column[p // groups][p % groups][:q] for p in range(devices)]
    count = [len(rows) for rows in held]
    received: list[list[tuple[int, int, int]]] = [[] for _ in range(devices)]  # (source p, its local row, layer)
    for here in range(devices):
        s, g = divmod(here, groups)
        moved = column[s][g][q:]
        if not moved:
            continue
        # the source of each moved row: of the devices with spare rows (those at the same g on other stages
        # where there are any), the largest (travels `prefer`, spare rows, -distance); distances differ, so
        # the largest is unique
        distance = [(here - p) % devices for p in range(devices)]
        rank = [(d == prefer, -d) for d in distance]
        same = [p for p in range(g, devices, groups) if p != here]
        for layer in moved:
            pool = [p for p in same if count[p] < q] or [p for p in range(devices) if count[p] < q]
            source = max(pool, key=lambda p: (rank[p][0], -count[p], rank[p][1]))
            received[here].append((source, count[source], layer))
            held[source].append(layer)
            count[source] += 1
    row_table = np.full((devices, q), -1, np.int32)
    for p, rows in enumerate(held):
        row_table[p, : len(rows)] = rows
    sends: list[np.ndarray | None] = []
    offsets: dict[tuple[int, int], int] = {}  # (destination p, layer) -> row of its receive buffer
    total = 0
    # the moved rows by distance, then by source, in (destination, receive order): one pass over them
    by_distance: dict[int, dict[int, list]] = {}
    for here in range(devices):
        for source, local, layer in received[here]:
            by_distance.setdefault((here - source) % devices, {}).setdefault(source, []).append((local, layer, here))
    for d in range(devices):
        moves = by_distance.get(d, {})
        cap = max((len(v) for v in moves.values()), default=0)
        if d == 0 or cap == 0:
            sends.append(None)
            continue
        send = np.zeros((devices, cap), np.int32)
        for source, items in moves.items():
            for j, (local, layer, here) in enumerate(items):
                send[source, j] = local
                offsets[(here, layer)] = total + j
        sends.append(send.reshape(stages, groups, cap))
        total += cap
    local_index = np.full((devices, width), -1, np.int32)
    table = work.tolist()
    for here in range(devices):
        s, g = divmod(here, groups)
        where = {layer: j for j, layer in enumerate(column[s][g][:q])}
        where.update({layer: q + offsets[(here, layer)] for _, _, layer in received[here]})
        for w in range(width):
            layer = table[s][w * groups + g]
            if layer >= 0:
                local_index[here, w] = where[layer]
    local_index = local_index.reshape(stages, groups, width)
    return Placement(q, work.shape[1] // layout.repeats, row_table.reshape(-1), tuple(sends), total, local_index)


def storage_axes(
    names: Sequence[Sequence[str | None]], rules, mesh_shape: Mapping[str, int], gather: str = "once"
) -> tuple[str, ...]:
    """The batch mesh axes (``data``, ``fsdp``, in that order) the rows are spread over besides ``stage``.

    Gathering once per step (``gather`` ``"once"``): those of size > 1 that the rules map a layer
    parameter's dimension to (ZeRO-3 style sharding of the parameters over them): ``fsdp`` under the
    ``fsdp`` and ``fsdp_tp`` presets, none under ``dp`` (parameters replicated over the batch axes stay
    replicated over them, only split over ``stage``). Every device then stores whole layers, and a block
    the stage's devices gather together is ``G`` layers, one from each.

    Gathering per microbatch (``"microbatch"``): none. The rows are spread over ``stage`` alone and each
    layer's features keep the rules' batch axes (each device of a stage holds ``1/G`` of every one of its
    rows, the usual FSDP split), so one all-gather over those axes assembles one layer and one
    reduce-scatter returns one layer's gradient: the per-microbatch working set is one layer, not ``G``
    (`feature_devices` says how many devices a layer is split over).

    Args:
      names: the canonical logical names ``(layers, ...)`` of each stacked layer parameter.
      rules: the `sharding.rules.Rules`.
      mesh_shape: mesh axis -> size.
      gather: ``--pipeline-gather``, ``"once"`` or ``"microbatch"``.
    """
    if gather == "microbatch":
        return ()
    return _batch_axes_used(names, rules, mesh_shape)


def _batch_axes_used(names, rules, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes of size > 1 that may split a batch (the stage program's manual axes besides ``stage``)
    the rules map some layer parameter's non-layer dimension to; the program refuses one the rules do not
    split the microbatches over (`sharding.pipeline.program.check_split`)."""
    used = {a for leaf in names for n in leaf[1:] for a in rules.mesh_axes(n)}
    return tuple(a for a in ax.BATCH_MESH_AXES if a in used and mesh_shape.get(a, 1) > 1)


def feature_devices(names, rules, mesh_shape: Mapping[str, int]) -> int:
    """The devices of a stage a layer's features are split over in the per-microbatch gather's storage
    (`storage_axes` with ``"microbatch"``): the product of the batch axes the rules map a layer parameter
    to (1 under ``dp``). The forward pass saves one activation per this many layers (`Streamed`)."""
    return math.prod(mesh_shape[a] for a in _batch_axes_used(names, rules, mesh_shape))


def storage_for(layout: StageLayout, names, rules, mesh_shape: Mapping[str, int], gather: str = "once") -> StageStorage:
    """The `StageStorage` of ``layout`` on a mesh: ``groups`` the product of `storage_axes`' sizes."""
    return StageStorage(layout, math.prod(mesh_shape[a] for a in storage_axes(names, rules, mesh_shape, gather)))


def storage_spec(spec, rows: int, mesh_shape: Mapping[str, int], axes: Sequence[str]):
    """A stacked layer parameter's `PartitionSpec` in the storage: rows over ``stage`` and ``axes``.

    Args:
      spec: the parameter's spec with its first dimension over ``stage`` (`pipeline_rules`), the
        others as the rules say.
      rows: the first dimension's size.
      mesh_shape: mesh axis -> size.
      axes: `storage_axes`.

    Returns:
      ``P((stage, *axes), *rest)``, ``rest`` the spec's other entries without those axes; the longest
      prefix of ``(stage, *axes)`` whose product divides ``rows`` (a checkpoint's storage read onto
      another mesh may not divide).
    """
    from jax.sharding import PartitionSpec

    lead = [a for a in (ax.STAGE, *axes) if mesh_shape.get(a, 1) > 1]
    while lead and rows % math.prod(mesh_shape[a] for a in lead):
        lead.pop()
    rest = []
    for entry in tuple(spec)[1:]:
        kept = tuple(
            a for a in (() if entry is None else (entry,) if isinstance(entry, str) else entry) if a not in lead
        )
        rest.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    first = None if not lead else lead[0] if len(lead) == 1 else tuple(lead)
    return PartitionSpec(first, *rest)


def spread_over_stage(spec, shape: Sequence[int], mesh_shape: Mapping[str, int]):
    """A non-layer parameter's `PartitionSpec` with ``stage`` added to one dimension it divides.

    Under a pipeline every stage uses the embedding, final norm and output projection whole (GSPMD gathers
    them over the batch axes), so storing them split over ``stage`` as well divides their persistent bytes
    (and their AdamW moments') by the stage count at no extra gathered bytes: ``stage`` joins the dimension
    already split over ``data``/``fsdp`` (one all-gather over both), else the largest it divides. Unchanged
    when none divides.
    """
    from jax.sharding import PartitionSpec

    stages = mesh_shape.get(ax.STAGE, 1)
    entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in tuple(spec)]
    entries += [()] * (len(shape) - len(entries))
    if stages == 1 or any(ax.STAGE in e for e in entries):
        return spec
    batch = set(ax.BATCH_MESH_AXES)
    for dim in sorted(range(len(shape)), key=lambda d: (not batch & set(entries[d]), -shape[d])):
        if shape[dim] % (math.prod(mesh_shape[a] for a in entries[dim]) * stages) == 0:
            entries[dim] = (*entries[dim], ax.STAGE)
            break
    else:
        return spec
    return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in entries))


def layout_from_meta(meta: dict[str, Any] | None) -> StageLayout | StageStorage | None:
    """The stack's layout saved with a checkpoint: None (canonical ``[layers, ...]``), a padded
    `StageLayout` (checkpoints saved before unpadded storage: no ``storage`` key) or a `StageStorage`."""
    layout = StageLayout.from_meta(meta)
    if layout is None or meta.get("storage") != "rows":
        return layout
    return StageStorage(layout, int(meta["groups"]))


def stack_table(layout: StageLayout | StageStorage | None, num_layers: int) -> np.ndarray:
    """The canonical layer in each row of a stack, in the stack's leading shape (-1: empty):
    ``[layers]`` (None), ``[stages, slots]`` (`StageLayout`) or ``[rows]`` (`StageStorage`)."""
    if layout is None:
        return np.arange(num_layers, dtype=np.int32)
    if isinstance(layout, StageStorage):
        return layout.placement.row_table
    return layout.layer_table()
