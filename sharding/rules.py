"""Logical-to-mesh sharding rules.

Model code names each array dimension with a logical axis (`sharding.axes`);
a `Rules` table maps each logical axis to zero or more mesh axes. The tables
are data: six presets and ``--rule NAME=AXIS[+AXIS]`` overrides.

==========  ==================================================================
preset      what it shards
==========  ==================================================================
dp          the batch over ``data`` and ``fsdp``; parameters replicated
fsdp        dp + parameters' ``embed`` dimension over ``fsdp`` and ``expert`` (ZeRO-3 style; the
            experts' weights' ``expert_embed`` over ``fsdp`` only)
tp          dp + ``heads``, ``kv_heads``, ``mlp``, ``vocab`` over ``tensor``
            (Megatron-LM style column/row splits)
fsdp_tp     fsdp and tp together (the default)
tp_sp       tp + sequence parallelism: the residual stream's ``act_length`` over ``tensor`` too
fsdp_tp_sp  fsdp_tp + sequence parallelism
==========  ==================================================================

In every preset the activations' ``length`` goes over ``context`` and ``sequence``
(context parallelism; ``context`` outer), and so does the residual stream's ``act_length`` (the length
outside the attention and MLP blocks); the ``_sp`` presets split ``act_length`` over ``tensor`` as well,
inside the context split (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.2.2: Megatron-LM's sequence parallelism). The norms, residual adds, the
embedding output and the loss's input then take 1/``tensor`` of their memory, and each block's
all-reduce over ``tensor`` becomes an all-gather before the block and a reduce-scatter after it, which
XLA's SPMD partitioner places from the two names' shardings. A mixture of experts' ``expert`` dimension
goes over ``expert``, which also splits the batch (the batch over ``data``, ``fsdp`` and ``expert``).

Rules are checked per array: two logical axes of one array that land on the
same mesh axis raise an error naming both. A dimension that a mesh axis does
not divide is left unsplit along that axis (replicated) and reported, rather
than padded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sharding import axes as ax
from sharding.errors import ConfigError, Field

AxisNames = tuple[str | None, ...]
"""Logical names of an array's dimensions, one per dimension (None: unnamed)."""

_BATCH_RULES = {
    ax.BATCH: (ax.DATA, ax.FSDP, ax.EXPERT),
    ax.LENGTH: ax.LENGTH_MESH_AXES,
    ax.ACT_LENGTH: ax.LENGTH_MESH_AXES,
    ax.EXPERT: (ax.EXPERT,),
}
# The weights' embed over every batch axis that may split it (ZeRO-3): fsdp, and expert for the weights
# outside the experts; the experts' own embed over fsdp only (their experts dimension holds expert).
_FSDP_RULES = {ax.EMBED: (ax.FSDP, ax.EXPERT), ax.EXPERT_EMBED: (ax.FSDP,)}
_TP_RULES = {
    ax.HEADS: (ax.TENSOR,),
    ax.KV_HEADS: (ax.TENSOR,),
    ax.MLP: (ax.TENSOR,),
    ax.VOCAB: (ax.TENSOR,),
}
# Sequence parallelism: the residual stream's length over the context axes, then tensor (innermost).
_SP_RULES = {ax.ACT_LENGTH: (*ax.LENGTH_MESH_AXES, ax.TENSOR)}

PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    "dp": dict(_BATCH_RULES),
    "fsdp": {**_BATCH_RULES, **_FSDP_RULES},
    "tp": {**_BATCH_RULES, **_TP_RULES},
    "fsdp_tp": {**_BATCH_RULES, **_FSDP_RULES, **_TP_RULES},
    "tp_sp": {**_BATCH_RULES, **_TP_RULES, **_SP_RULES},
    "fsdp_tp_sp": {**_BATCH_RULES, **_FSDP_RULES, **_TP_RULES, **_SP_RULES},
}
SEQUENCE_PARALLEL_PRESETS: dict[str, str] = {"tp": "tp_sp", "fsdp_tp": "fsdp_tp_sp"}
"""Each tensor-parallel preset and its sequence-parallel variant (the planner tries both)."""
DEFAULT_PRESET = "fsdp_tp"


@dataclasses.dataclass(frozen=True)
class Rules:
    """A logical-axis -> mesh-axes table.

    Attributes:
      name: the preset it came from, with ``+overrides`` when overridden.
      table: ``(logical_axis, mesh_axes)`` pairs; a logical axis not in the
        table is replicated.
    """

    name: str
    table: tuple[tuple[str, tuple[str, ...]], ...]

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes a logical axis maps to (empty: replicated)."""
        if logical is None:
            return ()
        return dict(self.table).get(logical, ())

    @property
    def sequence_parallel(self) -> bool:
        """Whether the residual stream's length is split over ``tensor`` (sequence parallelism)."""
        return ax.TENSOR in self.mesh_axes(ax.ACT_LENGTH)

    def sequence_split(self, mesh_shape: Mapping[str, int]) -> int:
        """Devices the residual stream's length (``act_length``) is split over beyond the blocks' ``length``:
        ``tensor``'s size under sequence parallelism, else 1 (``mesh_shape``: mesh axis -> size)."""
        block = self.mesh_axes(ax.LENGTH)
        return math.prod(mesh_shape.get(a, 1) for a in self.mesh_axes(ax.ACT_LENGTH) if a not in block)

    def batch_axes(self, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
        """The mesh axes of size > 1 a step's batch is split over: ``batch``'s rule, in its order
        (``mesh_shape``: mesh axis -> size, missing axes 1). Under every preset these are the mesh's
        ``data``, ``fsdp`` and ``expert`` (`sharding.axes.BATCH_MESH_AXES`); an override such as
        ``--rule batch=data+fsdp`` keeps the batch whole over ``expert``."""
        return tuple(a for a in self.mesh_axes(ax.BATCH) if mesh_shape.get(a, 1) > 1)

    def batch_split(self, mesh_shape: Mapping[str, int]) -> int:
        """Devices a step's batch is split over: the product of `batch_axes`' sizes (>= 1). The rows of a
        batch the product does not divide are checked elsewhere (`logical_to_spec` drops such an axis)."""
        return math.prod(mesh_shape[a] for a in self.batch_axes(mesh_shape))

    def length_axes(self, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
        """The mesh axes of size > 1 a sequence's length is split over inside the attention and MLP blocks:
        ``length``'s rule, in its order, outermost first (``mesh_shape``: mesh axis -> size, missing axes 1).
        Under every preset these are the mesh's ``context`` and ``sequence`` (`sharding.axes.LENGTH_MESH_AXES`);
        an override such as ``--rule length=none`` keeps the length whole over ``sequence``."""
        return tuple(a for a in self.mesh_axes(ax.LENGTH) if mesh_shape.get(a, 1) > 1)

    def length_split(self, mesh_shape: Mapping[str, int]) -> int:
        """Devices a sequence's length is split over: the product of `length_axes`' sizes (>= 1), what the
        cost model prices a device's tokens from and the run's `sharding.parallel.Parallelism.length_shards`."""
        return math.prod(mesh_shape[a] for a in self.length_axes(mesh_shape))

    def as_dict(self) -> dict[str, list[str]]:
        """JSON-friendly form, for reports and checkpoint metadata."""
        return {name: list(mesh_axes) for name, mesh_axes in self.table}

    def with_overrides(self, overrides: Mapping[str, Sequence[str]]) -> Rules:
        """A copy with some logical axes remapped (an empty sequence replicates)."""
        if not overrides:
            return self
        table = dict(self.table)
        table.update({name: tuple(mesh_axes) for name, mesh_axes in overrides.items()})
        suffix = ",".join(f"{n}={'+'.join(m) or 'none'}" for n, m in overrides.items())
        return Rules(f"{self.name}+{suffix}", tuple(table.items()))


def get_rules(preset: str = DEFAULT_PRESET, overrides: Iterable[str] = ()) -> Rules:
    """Builds rules from a preset name and ``--rule`` overrides.

    Args:
      preset: one of `PRESETS` (``dp``, ``fsdp``, ``tp``, ``fsdp_tp``, ``tp_sp``, ``fsdp_tp_sp``).
      overrides: strings ``NAME=AXIS[+AXIS]``; ``NAME=none`` or ``NAME=``
        replicates that logical axis.

    Returns:
      The `Rules`.

    Raises:
      ValueError: an unknown preset, logical axis or mesh axis, or a malformed
        override; the message lists what is valid.
    """
    if preset not in PRESETS:
        raise ConfigError(Field("rules", repr(preset)), f": unknown preset; choose one of {', '.join(PRESETS)}")
    rules = Rules(preset, tuple(PRESETS[preset].items()))
    return rules.with_overrides(parse_rule_overrides(overrides))


def parse_rule_overrides(overrides: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Parses ``--rule NAME=AXIS[+AXIS]`` strings into logical -> mesh axes.

    Raises:
      ConfigError: naming the bad override (the field ``rule``) and what would work.
    """
    parsed: dict[str, tuple[str, ...]] = {}
    for item in overrides:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise ConfigError(
                Field("rule", repr(item)), ": expected NAME=AXIS[+AXIS], e.g. ", Field("rule", "mlp=tensor+fsdp")
            )
        if name not in ax.LOGICAL_AXES:
            raise ConfigError(
                Field("rule", repr(item)), f": unknown logical axis {name!r}; known: {', '.join(ax.LOGICAL_AXES)}"
            )
        value = value.strip()
        mesh_axes = () if value.lower() in ("", "none") else tuple(v.strip() for v in value.split("+"))
        for mesh_axis in mesh_axes:
            if mesh_axis not in ax.MESH_AXES:
                raise ConfigError(
                    Field("rule", repr(item)),
                    f": unknown mesh axis {mesh_axis!r}; known: {', '.join(ax.MESH_AXES)} (or 'none' to replicate)",
                )
        if len(set(mesh_axes)) != len(mesh_axes):
            raise ConfigError(Field("rule", repr(item)), ": a mesh axis is repeated")
        parsed[name] = mesh_axes
    return parsed


@dataclasses.dataclass(frozen=True)
class Dropped:
    """A mesh axis left out of an array's sharding because it does not divide the dimension."""

    dim: int
    logical: str
    mesh_axis: str
    dim_size: int
    axis_size: int


def logical_to_spec(
    names: AxisNames,
    rules: Rules,
    shape: Sequence[int] | None = None,
    mesh_shape: Mapping[str, int] | None = None,
):
    """The `PartitionSpec` of an array from its logical axis names.

    Args:
      names: one logical name (or None) per dimension.
      rules: the rules table.
      shape: the array's shape; with ``mesh_shape``, mesh axes that do not
        divide their dimension are dropped (that dimension is replicated
        along them).
      mesh_shape: mesh axis -> size; axes of size 1 are left out of the spec.

    Returns:
      ``(spec, dropped)``: a `jax.sharding.PartitionSpec` and the list of
      `Dropped` axes (empty when nothing was dropped or no shape was given).

    Raises:
      ValueError: when ``shape`` and ``names`` differ in length, or two
        logical axes of the array map to the same mesh axis (naming both).
    """
    spec, dropped = _logical_to_spec(
        tuple(names),
        rules,
        None if shape is None else tuple(int(n) for n in shape),
        None if mesh_shape is None else tuple(sorted(mesh_shape.items())),
    )
    return spec, list(dropped)


@functools.lru_cache(maxsize=1 << 16)
def _logical_to_spec(
    names: tuple, rules: Rules, shape: tuple[int, ...] | None, mesh_items: tuple[tuple[str, int], ...] | None
):
    """`logical_to_spec` on hashable arguments, memoised (the planner prices the same arrays under the same
    rules and meshes hundreds of thousands of times); ``dropped`` as a tuple, so a caller cannot change what
    the cache holds. Errors are raised, not cached."""
    from jax.sharding import PartitionSpec

    mesh_shape = None if mesh_items is None else dict(mesh_items)
    if shape is not None and len(shape) != len(names):
        raise ValueError(f"logical names {names} have {len(names)} entries for an array of shape {tuple(shape)}")
    owner: dict[str, str] = {}
    for logical in names:
        for mesh_axis in rules.mesh_axes(logical):
            if mesh_axis in owner:
                raise ConfigError(
                    f"logical axes {owner[mesh_axis]!r} and {logical!r} of one array {tuple(names)} both "
                    f"map to mesh axis {mesh_axis!r} under rules {rules.name!r}; remap one with ",
                    Field("rule", f"{logical}=none"),
                    " (or another axis)",
                )
            owner[mesh_axis] = logical
    entries: list[Any] = []
    dropped: list[Dropped] = []
    for dim, logical in enumerate(names):
        kept: list[str] = []
        for mesh_axis in rules.mesh_axes(logical):
            if mesh_shape is not None and mesh_shape.get(mesh_axis, 1) == 1:
                continue  # a size-1 axis shards nothing; leave it out of the spec
            if shape is not None and mesh_shape is not None:
                axis_size = mesh_shape[mesh_axis]
                if shape[dim] % (math.prod(mesh_shape[a] for a in kept) * axis_size):
                    dropped.append(Dropped(dim, logical, mesh_axis, shape[dim], axis_size))
                    continue
            kept.append(mesh_axis)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries), tuple(dropped)


@dataclasses.dataclass
class ShardingReport:
    """What the rules did to a parameter tree.

    Attributes:
      rows: ``(path, shape, dtype, names, spec, dropped)`` per array.
      total_bytes: bytes of all arrays (unsharded).
      reduced_bytes: bytes of arrays with at least one dropped mesh axis.
    """

    rows: list[tuple[str, tuple[int, ...], Any, AxisNames, Any, list[Dropped]]]
    total_bytes: int
    reduced_bytes: int

    @property
    def reduced(self):
        return [row for row in self.rows if row[5]]

    def format_replicated(self) -> str:
        """Lines listing each array left (partly) replicated, and the byte share."""
        if not self.reduced:
            return "every parameter is sharded as its rules ask"
        lines = ["parameters left replicated where a mesh axis does not divide their dimension:"]
        for path, shape, _, _, _, dropped in self.reduced:
            why = "; ".join(
                f"dim {d.dim} ({d.logical}={d.dim_size}) not divisible by {d.mesh_axis}={d.axis_size}" for d in dropped
            )
            lines.append(f"  {path} {shape}: {why}")
        share = self.reduced_bytes / max(self.total_bytes, 1)
        lines.append(f"  {share:.1%} of parameter bytes are sharded less than the rules ask")
        return "\n".join(lines)


def path_str(path) -> str:
    """A readable ``a/b/c`` string for a `jax.tree_util` key path."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def tree_shardings(abstract_tree, names_tree, mesh, rules: Rules):
    """`NamedSharding`s for a whole tree of arrays from their logical names.

    Args:
      abstract_tree: tree of arrays or `jax.ShapeDtypeStruct`s.
      names_tree: the same tree structure with an `AxisNames` tuple per leaf.
      mesh: the `jax.sharding.Mesh`.
      rules: the rules table.

    Returns:
      ``(shardings, report)``: a tree of `jax.sharding.NamedSharding` with the
      structure of ``abstract_tree``, and a `ShardingReport`.

    Raises:
      ValueError: as `logical_to_spec`, with the array's path prepended.
    """
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_tree)
    names = treedef.flatten_up_to(names_tree)
    rows, shardings = [], []
    total = reduced = 0
    for (path, leaf), leaf_names in zip(leaves, names, strict=True):
        where = path_str(path)
        try:
            spec, dropped = logical_to_spec(tuple(leaf_names), rules, leaf.shape, dict(mesh.shape))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        total += nbytes
        reduced += nbytes if dropped else 0
        rows.append((where, tuple(leaf.shape), leaf.dtype, tuple(leaf_names), spec, dropped))
        shardings.append(NamedSharding(mesh, spec))
    return treedef.unflatten(shardings), ShardingReport(rows, total, reduced)
