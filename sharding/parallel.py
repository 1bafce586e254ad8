"""The parallelism of a run: one frozen value, built once and handed down explicitly.

`Parallelism` says how one training step is laid out over the devices:

* ``mesh_shape``: axis -> size over ``data, stage, fsdp, context, sequence, tensor`` (`sharding.mesh`), and
  ``outer``, how much of each axis spans processes (``--mesh-outer``);
* ``rules``: the logical-to-mesh rules (`sharding.rules`);
* ``strategy``: how the step computes its gradients, one of `Accumulation` (microbatches summed
  in a loop) or `UnevenBatch` (each data-parallel group along ``data`` x ``fsdp`` runs its own number of
  microbatches);
* ``pipeline``: the model's execution mode over ``stage``, a `sharding.pipeline.PipelinePlan` (the layer stack
  split over the stages, its M microbatches flowing inside one forward and backward pass), or None (the
  layers run in order on every device); a pipelined layout computes its gradients in that one pass
  (``strategy`` one pass of `Accumulation`);
* ``context_layout``: how tokens lie along the length when it is split over ``sequence``
  (``contiguous`` or ``zigzag``, `models.kernels.ring_attention`);
* ``context_shares``: uneven sequence shards for devices of unequal speed (``--context-shares``): the
  real tokens of a sequence each device of the ring holds, inside equal-shaped padded blocks
  (`models.kernels.ring_attention.uneven_zigzag_layout`); None when every device holds its even share;
* ``optimizer_sharding``: ``data`` splits the float32 parameters the optimizer updates and its moments over
  ``data`` (a distributed optimizer, ZeRO stage 1: `sharding.zero`); ``replicated`` (the default) keeps them
  whole on every ``data`` rank.

The command line builds one (``train.setup.cli``), the planner returns one (`sharding.planner`), and
`train.setup.flags.parallelism_flags` renders any of them as the ``python -m train.train`` flags that reproduce it.

At run time the value is bound to a device mesh (`Parallelism.on`) and passed as an argument to
the model's apply, to attention and to the output layer, which read the mesh and the rules from it
(`constrain`, `spec`); nothing is read from ambient state. Code that runs inside `jax.shard_map`
gets its variant: `inside` for a map that is manual over some axes (the pipeline's stage program:
GSPMD still partitions the other axes), `local` for per-device code (manual over every axis: no
annotation applies and kernels run on their local blocks). A value without a mesh (`UNSHARDED`)
runs the model on one device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from sharding import axes as ax
from sharding.errors import ConfigError, Field
from sharding.mesh import format_mesh
from sharding.pipeline.layout import PipelinePlan, pipeline_rules
from sharding.rules import DEFAULT_PRESET, AxisNames, Rules, get_rules, logical_to_spec
from sharding.varying import to_varying, varying_axes  # noqa: F401  (their home; re-exported here)

CONTIGUOUS = "contiguous"
ZIGZAG = "zigzag"
CONTEXT_LAYOUTS = ("auto", CONTIGUOUS, ZIGZAG)
"""Values of ``--context-layout``; ``auto`` is resolved once the mesh is known."""
REPLICATED = "replicated"
OPTIMIZER_SHARDINGS = (REPLICATED, ax.DATA)
"""Values of ``Parallelism.optimizer_sharding``: ``replicated`` (every ``data`` rank holds the whole float32
parameters and optimizer state) or ``data`` (ZeRO stage 1, `sharding.zero`: split over ``data``)."""


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """Gradient accumulation: the batch is cut into ``microbatches`` strided microbatches (row ``r`` in
    microbatch ``r % M``) whose gradients are summed in a loop, so the update equals the one-shot one.

    Attributes:
      microbatches: M >= 1 (1: no loop).
    """

    microbatches: int = 1

    name = "accumulation"
    uneven = False
    """Every data-parallel group runs the same microbatches."""

    def mean_microbatches(self, groups: int) -> int:
        """M: every data-parallel group runs all of them (`Parallelism.microbatches`)."""
        return self.microbatches


@dataclasses.dataclass(frozen=True)
class UnevenBatch:
    """Uneven data parallelism: data-parallel group ``i`` along ``data`` x ``fsdp`` runs ``counts[i]``
    microbatches (a group is one device, or with ``tensor`` in the mesh the devices of one tensor group,
    which all run its count).

    Attributes:
      counts: Microbatches per data-parallel group (data-major, as the mesh orders devices), or None until
        they are resolved at start-up from device speeds (``speeds``).
      speeds: Where the counts come from: ``given`` (``--hetero-batch 3,3,1,1``), ``kinds`` (device
        kinds' datasheet peaks) or ``measured`` (timed at start-up).
      microbatches: With ``counts`` None, the microbatches each device runs on average
        (``--microbatches``): the step runs ``microbatches x data x fsdp`` of them in all.
      capacity: The padded buffer per device, in microbatches (``--hetero-max-share``): counts are an
        input of the compiled step and may change between steps up to this; None:
        `sharding.balance.default_capacity` (twice the mean, at least ``max(counts)``).
      rebalance_every: Steps between recomputing the counts from the devices' timed loops
        (``--rebalance-every``; 0: never, the step is then not timed).
      kind_counts: Microbatches per data-parallel group by its (slowest) device kind, as ``((kind name,
        count), ...)`` (``--hetero-batch h100_sxm=25,a100_80gb=7``): the counts are read from the groups'
        kinds at start-up (``speeds`` ``given``); None when the counts are given per group or come from speeds.
    """

    counts: tuple[int, ...] | None = None
    speeds: str = "given"
    microbatches: int = 1
    capacity: int | None = None
    rebalance_every: int = 0
    kind_counts: tuple[tuple[str, int], ...] | None = None

    name = "uneven"
    uneven = True
    """Each data-parallel group runs its own count of microbatches (the uneven step)."""

    @property
    def total(self) -> int | None:
        """Microbatches per step over all devices (None before the counts are resolved)."""
        return None if self.counts is None else sum(self.counts)

    def mean_microbatches(self, groups: int) -> int:
        """Microbatches per data-parallel group on average over ``groups`` (at least 1), or ``microbatches``
        before the counts are resolved (`Parallelism.microbatches`)."""
        return self.microbatches if self.counts is None else max(1, self.total // groups)


def counts_of_kinds(by_kind: Mapping[str, int], kinds: Sequence[str]) -> tuple[tuple[int, ...], str, str]:
    """Per-kind counts (``--hetero-batch h100_sxm=25,a100_80gb=7``) read for data-parallel groups whose
    (slowest) kinds are ``kinds``: ``(counts, problem, example)``. ``problem`` is empty when every group's kind
    has a count and every kind named is one of ``kinds``; else it says what is wrong (``no count for the
    a100_80gb devices``) and ``example`` gives counts that would do (``h100_sxm=25,a100_80gb=1``), for the
    caller's one-line refusal, which names its own flag or field. The runtime (`train.strategies.uneven`) and
    the planner read them alike.
    """
    present = list(dict.fromkeys(kinds))
    missing = [k for k in present if k not in by_kind]
    absent = [k for k in by_kind if k not in present]
    example = ",".join(f"{k}={by_kind.get(k, 1)}" for k in present)
    if missing:
        return (), f"no count for the {', '.join(missing)} devices", example
    if absent:
        return (), f"no {', '.join(absent)} devices here (its kinds: {', '.join(present)})", example
    return tuple(by_kind[k] for k in kinds), "", ""


Strategy = Accumulation | UnevenBatch
"""A strategy value, how the step computes its gradients: ``name``, ``uneven``, ``microbatches`` and
``mean_microbatches(groups)``; what the step does with it is `train.strategies`'. A pipeline is not one: it is
the model's execution mode, `Parallelism.pipeline`."""


def _full_shape(shape: Mapping[str, int]) -> dict[str, int]:
    full = {a: 1 for a in ax.MESH_AXES}
    for name, size in shape.items():
        if name not in full:
            raise ValueError(f"mesh axis {name!r} unknown; known: {', '.join(ax.MESH_AXES)}")
        full[name] = int(size)
    return full


@dataclasses.dataclass(frozen=True, eq=False)
class Parallelism:
    """How a step is laid out over devices; see the module docstring.

    Attributes:
      mesh_shape: Axis -> size over all of `sharding.axes.MESH_AXES` (missing axes are 1).
      rules: Logical-to-mesh rules (with ``layers -> stage`` for a pipeline).
      strategy: `Accumulation` or `UnevenBatch`: how the step computes its gradients.
      context_layout: ``contiguous`` or ``zigzag`` (``auto`` until the mesh is resolved).
      outer: Axis -> the part of it that spans processes, or None (the default split).
      mesh: The `jax.sharding.Mesh` (or, inside `jax.shard_map`, the abstract mesh) once bound; None
        before (`on`) or for one device.
      manual: Mesh axes that are manual here (inside `jax.shard_map`).
      context_shares: Real tokens per sequence on each device of the ring (the length's devices in
        ring order; even ints summing to the sequence length), ``"auto"`` until measured at start-up,
        or None (even shards).
      optimizer_sharding: One of `OPTIMIZER_SHARDINGS`: where the train state's float32 parameters and
        optimizer moments live (`sharding.zero`); the forward and backward see the parameters laid out by
        ``rules`` either way.
      pipeline: The `sharding.pipeline.PipelinePlan` the model runs its layer stack with over ``stage``, or
        None (no pipeline); its rules carry ``layers -> stage`` (`sharding.pipeline.pipeline_rules`).

    Raises:
      ConfigError: An unknown ``context_layout`` or ``optimizer_sharding``, ``optimizer_sharding`` ``data``
        with the uneven step (`UnevenBatch` lays its parameters out inside its own map).
      ValueError: A ``pipeline`` beside a ``strategy`` other than one pass of accumulation (the pipeline runs
        its own microbatches; the command line's checks refuse this before a `Parallelism` is built).
      TypeError: A `sharding.pipeline.PipelinePlan` given as ``strategy`` (it belongs in ``pipeline``).
    """

    mesh_shape: Mapping[str, int]
    rules: Rules
    strategy: Strategy = Accumulation()
    context_layout: str = CONTIGUOUS
    outer: Mapping[str, int] | None = None
    mesh: Any = None
    manual: frozenset[str] = frozenset()
    context_shares: tuple[int, ...] | str | None = None
    optimizer_sharding: str = REPLICATED
    pipeline: PipelinePlan | None = None

    def __post_init__(self):
        object.__setattr__(self, "mesh_shape", _full_shape(self.mesh_shape))
        if isinstance(self.strategy, PipelinePlan):
            raise TypeError(
                "Parallelism: a PipelinePlan is the model's execution mode, not a strategy; pass it as pipeline="
            )
        if self.pipeline is not None and self.strategy != Accumulation():
            # Not reachable from the command line (its checks refuse the combination first): a programming error,
            # so a ValueError naming the dataclass fields rather than a ConfigError the CLI turns into flags.
            raise ValueError(
                f"Parallelism: strategy {self.strategy!r} beside a pipeline; a pipelined model runs its "
                f"{self.pipeline.microbatches} microbatches inside one forward and backward pass: pass "
                "strategy=Accumulation(1)"
            )
        if self.context_layout not in CONTEXT_LAYOUTS:
            raise ConfigError(
                Field("context_layout", repr(self.context_layout)), f": choose one of {', '.join(CONTEXT_LAYOUTS)}"
            )
        if self.optimizer_sharding not in OPTIMIZER_SHARDINGS:
            raise ConfigError(
                Field("optimizer_sharding", self.optimizer_sharding),
                ": choose one of ",
                ", ".join(OPTIMIZER_SHARDINGS),
                ", e.g. ",
                Field("optimizer_sharding", ax.DATA),
            )
        if self.optimizer_sharding == ax.DATA and self.strategy.uneven:
            raise ConfigError(
                Field("optimizer_sharding", ax.DATA),
                ": the uneven data-parallel step (",
                Field("hetero_batch"),
                ") gathers and reduces its parameters itself; use ",
                Field("optimizer_sharding", REPLICATED),
            )

    # Construction ----------------------------------------------------------------------------

    @classmethod
    def of(
        cls,
        mesh,
        rules: Rules | str = DEFAULT_PRESET,
        strategy: Strategy | None = None,
        context_layout: str = CONTIGUOUS,
        pipeline: PipelinePlan | None = None,
    ) -> Parallelism:
        """A value bound to ``mesh`` (tests and scripts): its shape, ``rules`` (a preset name or `Rules`),
        ``strategy`` (default no accumulation), ``context_layout`` and ``pipeline`` (default none).

        A pipeline adds ``layers -> stage`` to the rules (`sharding.pipeline.pipeline_rules`).

        Raises:
          ConfigError: As the constructor.
        """
        rules = get_rules(rules) if isinstance(rules, str) else rules
        strategy = Accumulation() if strategy is None else strategy
        if pipeline is not None:
            rules = pipeline_rules(rules)
        return cls(dict(mesh.shape), rules, strategy, context_layout, mesh=mesh, pipeline=pipeline)

    def on(self, mesh) -> Parallelism:
        """This layout bound to a device mesh of its shape.

        Raises:
          ValueError: When the mesh's shape is not ``mesh_shape``.
        """
        if dict(mesh.shape) != dict(self.mesh_shape):
            raise ValueError(f"mesh {format_mesh(dict(mesh.shape))} is not the layout's {format_mesh(self.mesh_shape)}")
        return dataclasses.replace(self, mesh=mesh)

    def replace(self, **changes) -> Parallelism:
        return dataclasses.replace(self, **changes)

    def inside(self, axes: Sequence[str]) -> Parallelism:
        """The variant for code inside `jax.shard_map` manual over ``axes`` (call while tracing it).

        Its mesh is the abstract mesh of the map (`jax.sharding.get_abstract_mesh`), whose other axes
        GSPMD still partitions from the same rules.
        """
        import jax

        manual = self.manual | frozenset(axes)
        mesh = jax.sharding.get_abstract_mesh() if self.mesh is not None else None
        return dataclasses.replace(self, mesh=mesh, manual=manual)

    def local(self) -> Parallelism:
        """The variant for per-device code (inside `jax.shard_map` manual over every axis): annotations
        do nothing and kernels run on the local blocks."""
        return dataclasses.replace(self, mesh=None, manual=frozenset(ax.MESH_AXES))

    # Reading it ------------------------------------------------------------------------------

    @property
    def is_sharded(self) -> bool:
        """Whether annotations apply: a mesh is bound and some axis of size > 1 is not manual."""
        return self.mesh is not None and any(size > 1 and a not in self.manual for a, size in self.auto_shape.items())

    @property
    def auto_shape(self) -> dict[str, int]:
        """The mesh shape with manual axes counted as size 1 (what annotations may split over)."""
        return {a: (1 if a in self.manual else size) for a, size in self.mesh_shape.items()}

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape.values())

    @property
    def data_parallel(self) -> int:
        """Devices the batch is split over: the mesh axes the rules map ``batch`` to (`Rules.batch_split`;
        ``data`` x ``fsdp`` x ``expert`` under every preset), as `length_shards` reads ``length``'s."""
        return self.rules.batch_split(self.mesh_shape)

    @property
    def length_shards(self) -> int:
        """P: devices the activations' ``length`` is split over (its rule's mesh axes, `Rules.length_split`)."""
        return self.rules.length_split(self.mesh_shape)

    @property
    def padded_length(self) -> int | None:
        """Positions per sequence with uneven shards: the ring's devices times the largest share (each
        device's block padded to it); None without uneven shares (or before they are measured)."""
        if not isinstance(self.context_shares, tuple):
            return None
        return len(self.context_shares) * max(self.context_shares)

    def positions(self, seq_len: int) -> int:
        """Positions per sequence that a step of ``seq_len`` tokens runs: ``seq_len``, or with uneven shards
        `padded_length` (every compiled step, the loop's, the dry run's and the pipeline's check, takes this)."""
        return self.padded_length or seq_len

    @property
    def microbatches(self) -> int:
        """Microbatches per step: the pipeline's (which flow inside its one pass), else the strategy's
        (accumulation steps, or uneven microbatches per device on average)."""
        if self.pipeline is not None:
            return self.pipeline.microbatches
        return self.strategy.mean_microbatches(self.data_parallel)

    def spec(self, names: AxisNames, shape: Sequence[int] | None = None):
        """The `PartitionSpec` of an array with logical ``names`` (and ``shape``: mesh axes that do not
        divide a dimension are left out) over the axes annotations may use here."""
        spec, _ = logical_to_spec(tuple(names), self.rules, shape, self.auto_shape)
        return spec

    def sharding(self, names: AxisNames, shape: Sequence[int] | None = None):
        """`jax.sharding.NamedSharding` of an array with logical ``names`` on the bound mesh."""
        from jax.sharding import NamedSharding

        return NamedSharding(self.mesh, self.spec(names, shape))

    def constrain(self, x, names: AxisNames):
        """Annotates an activation with the sharding its logical names imply.

        Args:
          x: An array being traced, e.g. ``[batch, length, act_embed]``.
          names: One logical name per dimension of ``x``.

        Returns:
          ``x`` with a `jax.lax.with_sharding_constraint` for this mesh and rules (mesh axes that do
          not divide a dimension are left out); ``x`` itself when nothing is sharded here.

        Raises:
          ValueError: When ``names`` does not have one entry per dimension, or two names map to one
            mesh axis.
        """
        if len(names) != x.ndim:
            raise ValueError(f"constrain: names {tuple(names)} have {len(names)} entries for an array of rank {x.ndim}")
        if not self.is_sharded:
            return x
        import jax

        return jax.lax.with_sharding_constraint(x, self.sharding(names, x.shape))

    # Flags -------------------------------------------------------------------------------------


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one `PartitionSpec` entry: ``None`` -> ``()``, ``'fsdp'`` -> ``('fsdp',)``."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(spec, dim: int):
    """The entry of a `PartitionSpec` for dimension ``dim``: ``None`` past its end (`Parallelism.spec` drops
    trailing unsplit dimensions, so a replicated ``[batch]`` has the empty spec ``P()``)."""
    return spec[dim] if dim < len(spec) else None


def only_axes(spec, axes: Sequence[str]):
    """``spec`` with every entry cut to the mesh axes in ``axes`` (the block a `jax.shard_map` manual over
    ``axes`` sees; the other axes stay automatic inside it).

    Args:
      spec: A `jax.sharding.PartitionSpec`.
      axes: The manual mesh axes.

    Returns:
      A `jax.sharding.PartitionSpec` of the same length naming only axes of ``axes``.
    """
    from jax.sharding import PartitionSpec

    def cut(entry):
        kept = tuple(a for a in spec_axes(entry) if a in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return PartitionSpec(*(cut(e) for e in spec))


def gather_shards(x, spec):
    """The whole array from this device's block (inside `jax.shard_map`, manual over ``spec``'s axes).

    Args:
      x: this device's block of an array laid out as ``spec``.
      spec: `jax.sharding.PartitionSpec` naming manual mesh axes only.

    Returns:
      The array with every split dimension all-gathered (tiled) over its axes; same dtype.
    """
    import jax

    for dim, entry in enumerate(spec):
        names = spec_axes(entry)
        if names:
            x = jax.lax.all_gather(x, names, axis=dim, tiled=True)
    return x


def reduce_shards(g, spec, axes: Sequence[str]):
    """Sums a whole-array gradient over ``axes`` and keeps this device's block of ``spec``.

    The inverse of `gather_shards` for gradients: each split dimension is reduce-scattered over its
    axes (``psum_scatter``, tiled), then the (smaller) block is summed over the axes of ``axes`` the
    spec does not split over (``psum``).

    Args:
      g: ``[...]`` the gradient of the whole array on this device (device-varying over ``axes``).
      spec: the array's `jax.sharding.PartitionSpec` (manual axes only); its split axes must be in ``axes``.
      axes: the mesh axes the per-device gradients are partial sums over.

    Returns:
      This device's block of the summed gradient, laid out as ``spec``.
    """
    import jax

    for dim, entry in enumerate(spec):
        names = spec_axes(entry)
        if names:
            g = jax.lax.psum_scatter(g, names, scatter_dimension=dim, tiled=True)
    return psum_unsplit(g, spec, axes)


def psum_unsplit(g, spec, axes: Sequence[str], reduced: Sequence[str] = ()):
    """A block's gradient summed over the axes of ``axes`` that ``spec`` does not split over (those it splits
    over were summed by the reduce-scatter that made the block), nor ``reduced`` (summed some other way).

    Args:
      g: ``[...]`` this device's block, a partial sum over the axes left.
      spec: the block's `jax.sharding.PartitionSpec` (manual axes only).
      axes: the mesh axes the per-device gradients are partial sums over.
      reduced: axes already summed over besides ``spec``'s.

    Returns:
      ``g`` summed (``psum``) over the axes left; ``g`` itself where none is.
    """
    import jax

    split = {a for entry in spec for a in spec_axes(entry)} | set(reduced)
    rest = tuple(a for a in axes if a not in split)
    return jax.lax.psum(g, rest) if rest else g


UNSHARDED = Parallelism({}, Rules("none", ()))
"""One device: no annotation, kernels run directly (the reference for every parallel layout)."""


__all__ = [
    "Accumulation",
    "CONTEXT_LAYOUTS",
    "CONTIGUOUS",
    "OPTIMIZER_SHARDINGS",
    "Parallelism",
    "REPLICATED",
    "Strategy",
    "UNSHARDED",
    "UnevenBatch",
    "ZIGZAG",
    "gather_shards",
    "only_axes",
    "psum_unsplit",
    "reduce_shards",
    "spec_axes",
    "to_varying",
    "varying_axes",
]
