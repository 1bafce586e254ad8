"""Pricing one layout on a (mixed) cluster: what the search may choose (`PlanOptions`), one priced
layout (`Plan`) and the evaluator that prices layouts (`_Evaluator`).

The evaluator prices a layout per device kind with `sharding.costmodel` (one cost per class of
devices that do the same work, the slowest device pacing the step; a pipeline adds its bubble
``(S-1)/(R*M+S-1)``, or the 1F1B family's tick tables), memoised per mesh (device grids, kinds, links) and per
stage (costs shared by a split's stages), and rejects layouts that do not fit a device's memory
(`MEMORY_FRACTION` of it).

Imports nothing of the project outside `sharding`, never the model.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sharding import axes as ax
from sharding import costmodel as cm
from sharding.costmodel.pipeline import stored_rows_moved
from sharding.errors import ConfigError, Field
from sharding.mesh import format_mesh, grid_positions
from sharding.parallel import CONTIGUOUS, Accumulation, Parallelism, UnevenBatch
from sharding.pipeline.layout import PipelinePlan, Schedule, bubble_fraction, pipeline_rules, plan_layout
from sharding.pipeline.ticks import tick_time

#: Share of a device's memory a plan may use; the rest is left to the runtime, the allocator's
#: fragmentation and the activations the cost model misses (it predicts 0.5-0.9x of what the CPU
#: compiler allocates for temporaries, bench/results/costmodel.md).
MEMORY_FRACTION = 0.85

#: What each op of a tick table costs, as shares of a chunk's forward and backward time on its stage (the
#: stage's `Cost`, which already counts the schedule's recomputation): ``(forward, backward, weight)`` in
#: forward-equivalents over their sum. 1F1B's backward recomputes the chunk's forward and runs the two
#: backward products per forward product (1 + 3). Zero bubble's input gradient recomputes the forward and
#: runs the input-gradient products (2); its weight gradient runs the weight-gradient products alone, from
#: each product's input and output cotangent the input gradient kept (1, `sharding.pipeline.split`): 1 + 2 + 1.
TICK_SHARES = {
    Schedule.ONE_F_ONE_B: (0.25, 0.75, 0.0),
    Schedule.FUSED: (0.25, 0.75, 0.0),
    Schedule.ZERO_BUBBLE: (0.25, 0.5, 0.25),
}

#: How a 1F1B pipeline is priced. ``lockstep``: meshwork's schedules as they run, one SPMD program whose
#: ticks each last as long as the busiest stage's work in the tick, read from the schedule's tick table
#: (`sharding.pipeline.ticks.tick_time` with `TICK_SHARES`: ``1f1b``, ``1f1b-fused`` and ``zb`` alike).
#: ``fused``: 1F1B as Megatron-LM executes it, each stage running its own forward and backward passes as
#: their inputs arrive, ``(1 + (S - 1) / (R M))`` of the slowest stage's busy time (Narayanan et al., SC'21,
#: section 2.2: the bubble is ``(S - 1) / (R M)`` of the ideal time, R the interleaved chunks per stage).
PIPELINE_CLOCKS = ("lockstep", "fused")

#: The `cm.Layout` fields a stage's cost base depends on: all but the mesh (keyed by its items) and the split.
_STAGE_KEY_FIELDS = tuple(f.name for f in dataclasses.fields(cm.Layout) if f.name not in ("mesh", "stage_layers"))

#: Stage costs' bases kept whole (with their collectives and products) for another kind's time, most recent last.
_STAGE_FULL = 256


def _within_batch_group(mesh: Mapping[str, int]) -> tuple[int, ...]:
    """The positions in ``mesh`` of the axes inside one data-parallel group (all but ``data`` and ``fsdp``).

    Fixed rather than the rules' `Rules.batch_axes`: only the uneven step has groups of its own, and it splits
    the rows over every batch axis of a mesh without ``expert`` (`train.strategies.uneven.check_uneven` refuses
    a ``batch`` rule that does not), so its groups are the ``data`` x ``fsdp`` positions under any rules it runs.
    """
    return tuple(i for i, name in enumerate(mesh) if name not in (ax.DATA, ax.FSDP))


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """What the search may choose.

    Attributes:
      rules: Presets to try.
      remats: Remat policies to try, cheapest first.
      attentions: Attention implementations to try, by name; None: those the model's description says the
        search includes (`sharding.modeldesc.AttentionTraits.searched`: reference and flash).
      dtype: Compute dtype (``bfloat16`` for GPUs).
      max_microbatches: Largest number of microbatches (per device, uniform) to try; None: every divisor of
        the rows a data-parallel device holds (a pipeline's from its stages up to
        `sharding.planner.search.PIPELINE_MICROBATCHES_PER_STAGE` per stage, at least 64).
      pipeline: Whether to try ``stage > 1`` (`train.setup.layout_flags.PIPELINE_FLAGS`).
      max_stages: Largest ``stage`` to try (None: up to the layers).
      repeats: Circular pipeline repeats to try.
      schedules: Pipeline schedules to use (``--pipeline-schedule`` values): ``gpipe`` (circular with
        repeats), ``1f1b`` (lockstep; interleaved with repeats), ``1f1b-fused`` and ``zb``; each 1F1B-family
        one is priced at every pipeline layout beside GPipe's, and the fastest that fits wins.
      sequence: Whether to try ``sequence > 1``.
      hetero: Whether to try uneven data parallelism.
      efficiency: Fraction of peak FLOP/s all the step's work reaches (`sharding.costmodel.Hardware`); None: the
        step priced from its shapes (`sharding.costmodel.compute_seconds`, the kinds' measured matmul ceilings).
      backend: Collective lowering (`sharding.costmodel.BACKENDS`).
      one_f_one_b_clock: How a 1F1B pipeline's time is priced (`PIPELINE_CLOCKS`): ``lockstep``, what
        meshwork's tick tables run, or ``fused``, 1F1B as Megatron-LM executes it.
      overlaps: Mesh axes whose critical-path collectives the priced run hides behind compute (a published
        run's own overlaps, `sharding.costmodel.step_time`); () for meshwork's own program.

    Raises:
      ValueError: On an unknown ``one_f_one_b_clock``.
    """

    rules: tuple[str, ...] = ("dp", "fsdp", "tp", "fsdp_tp", "tp_sp", "fsdp_tp_sp")
    remats: tuple[str, ...] = ("none", "dots", "full")
    attentions: tuple[str, ...] | None = None
    dtype: str = "bfloat16"
    max_microbatches: int | None = None
    pipeline: bool = True
    max_stages: int | None = None
    repeats: tuple[int, ...] = (1, 2)
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "1f1b-fused", "zb")
    sequence: bool = False
    hetero: bool = True
    efficiency: float | None = None
    backend: str = "gpu"
    one_f_one_b_clock: str = "lockstep"
    overlaps: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.one_f_one_b_clock not in PIPELINE_CLOCKS:
            raise ValueError(
                f"one_f_one_b_clock {self.one_f_one_b_clock!r}: choose one of {', '.join(PIPELINE_CLOCKS)}"
            )


@dataclasses.dataclass(frozen=True)
class Plan:
    """One evaluated layout.

    Attributes:
      layout: Mesh, rules, microbatches, remat, stage split, attention, dtype.
      counts: Microbatches per device along ``data`` x ``fsdp`` for uneven data parallelism (data
        major, as the mesh orders devices), or None for the uniform step.
      microbatch_rows: Sequences per microbatch.
      step_time: Predicted seconds per step.
      tokens_per_second: Global tokens per predicted second.
      mfu: Model FLOPs (PaLM count) per second over the cluster's peak.
      memory: Kind name -> predicted bytes per device of that kind (the largest).
      memory_limit: Kind name -> usable bytes (`MEMORY_FRACTION` of its memory).
      parts: Seconds of the slowest device: ``compute``, ``exposed_comm``, ``overlapped_comm``, ``overlap_exposed``, ``contention``,
        ``optimizer``, ``bubble`` (pipeline idle time).
      paced_by: The kind (and stage) of the slowest device.
      fits: Whether every device fits its memory limit.
      comm: Collective kind -> seconds per step of the slowest device (overlapped and exposed together).
      memory_parts: Kind name -> bytes by part (`sharding.costmodel.Memory` fields) of its largest device.
      idle_kinds: Kinds whose every device gets no microbatch (uneven counts of 0): they hold their
        parameter and optimizer shards but compute nothing.
      kind_counts: The uneven counts by kind, ``((kind name, count), ...)``, when every data-parallel group
        of a kind (its slowest device's) has one count (``--hetero-batch h100_sxm=25,a100_80gb=7``); else None.
      stage_kinds: A pipeline's kinds per stage (names joined by ``+`` where a stage spans kinds); else None.

    With uneven sequence shards, ``layout.context_shares`` holds the real tokens of a sequence per device of
    the ring (ring order), which `parallelism` and the plan's command line carry (``--context-shares``).
    """

    layout: cm.Layout
    counts: tuple[int, ...] | None
    microbatch_rows: float
    step_time: float
    tokens_per_second: float
    mfu: float
    memory: dict[str, float]
    memory_limit: dict[str, float]
    parts: dict[str, float]
    paced_by: str
    fits: bool
    comm: dict[str, float] = dataclasses.field(default_factory=dict)
    memory_parts: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    idle_kinds: tuple[str, ...] = ()
    kind_counts: tuple[tuple[str, int], ...] | None = None
    stage_kinds: tuple[str, ...] | None = None

    @property
    def stage_layers(self) -> tuple[int, ...] | None:
        return self.layout.stage_layers

    def key(self) -> tuple:
        """A description that identifies the plan (for tables and de-duplication)."""
        lay = self.layout
        return (
            format_mesh(lay.mesh),
            lay.rules_name,
            lay.microbatches,
            lay.remat,
            lay.attention,
            lay.stage_layers,
            lay.pipeline_repeats,
            lay.pipeline_schedule,
            lay.pipeline_gather,
            self.counts,
            lay.context_shares,
            lay.optimizer_sharding,
        )

    def parallelism(self) -> Parallelism:
        """The plan as the run's `sharding.parallel.Parallelism` (not bound to a mesh): its mesh, rules,
        strategy (`UnevenBatch` with the counts, else `Accumulation`: over the microbatches, or one pass beside a
        pipeline) and pipeline (a `PipelinePlan` of the stage split over ``stage`` > 1); uneven sequence shards
        as their real tokens per ring device."""
        lay = self.layout
        rules, plan = lay.rules_table(), None
        if self.counts is not None:
            strategy = UnevenBatch(
                counts=tuple(self.counts), microbatches=lay.microbatches, kind_counts=self.kind_counts
            )
        elif lay.mesh[ax.STAGE] > 1:
            stages, _ = plan_layout(sum(lay.stage_layers), lay.mesh[ax.STAGE], lay.pipeline_repeats, lay.stage_layers)
            plan = PipelinePlan(
                stages,
                lay.microbatches,
                schedule=lay.pipeline_schedule,
                gather=lay.pipeline_gather,
            )
            strategy, rules = Accumulation(), pipeline_rules(rules)
        else:
            strategy = Accumulation(lay.microbatches)
        context_layout = lay.context_layout if lay.length_split > 1 else CONTIGUOUS
        shares = None if lay.context_shares is None else tuple(int(n) for n in lay.context_shares)
        return Parallelism(
            lay.mesh,
            rules,
            strategy,
            context_layout,
            context_shares=shares,
            optimizer_sharding=lay.optimizer_sharding,
            pipeline=plan,
        )


@dataclasses.dataclass(frozen=True)
class _Cluster:
    """The cluster grouped by kind: the distinct kinds and, per global device (host order), the index of its
    kind; the search reads kinds per mesh position from it with array operations, never per device object.

    Attributes:
      kinds: The distinct device kinds, in order of first appearance.
      kind_index: ``[devices]`` int, the index into ``kinds`` of each global device.
      hosts: Number of hosts.
      per_host: Devices per host (equal on every host).
      inter_bandwidth: Bytes/s per host to the other hosts.
    """

    kinds: tuple[Any, ...]
    kind_index: np.ndarray
    hosts: int
    per_host: int
    inter_bandwidth: float

    @property
    def size(self) -> int:
        return len(self.kind_index)

    def count(self, kind) -> int:
        """Devices of ``kind``."""
        return int(np.count_nonzero(self.kind_index == self.kinds.index(kind)))


def _cluster(inventory) -> _Cluster:
    counts = {h.count for h in inventory.hosts}
    if len(counts) != 1:
        raise ConfigError(
            Field("cluster"),
            f": the planner needs hosts of equal size, got {', '.join(str(h.count) for h in inventory.hosts)} "
            "devices; describe the cluster as equal hosts, e.g. h100:8,a100:8",
        )
    for kind in inventory.kinds_present:
        if not kind.is_known:
            missing = kind.missing_figures
            raise ConfigError(
                Field("cluster"),
                f": device kind {kind.name!r} lacks {', '.join(missing)}; name a known kind (e.g. h100:8) "
                f'or give them in a cluster file, e.g. "kinds": {{"{kind.name}": {{"{missing[0]}": ...}}}} '
                f"(FLOP/s, bytes, bytes/s)",
            )
    kinds = inventory.kinds_present
    per_host = counts.pop()
    by_host = np.array([kinds.index(h.kind) for h in inventory.hosts], dtype=np.int32)
    return _Cluster(kinds, np.repeat(by_host, per_host), len(inventory.hosts), per_host, inventory.inter_host_bandwidth)


class _Evaluator:
    """Prices layouts on one cluster (caches hardware, grids and kinds per mesh)."""

    def __init__(self, model, inventory, global_batch: int, seq_len: int, options: PlanOptions):
        # a kind without bfloat16 (V100) is planned in a dtype it has: the whole step in float32
        self.no_bfloat16 = tuple(k.name for k in inventory.kinds_present if not getattr(k, "bfloat16", True))
        if options.dtype == "bfloat16" and self.no_bfloat16:
            options = dataclasses.replace(options, dtype="float32")
        self.model, self.batch, self.seq, self.options = cm.describe_model(model), global_batch, seq_len, options
        self.cluster = _cluster(inventory)
        self.hardware = {
            k.name: cm.hardware_for(
                k, self.cluster.per_host, self.cluster.inter_bandwidth, options.efficiency, options.dtype
            )
            for k in inventory.kinds_present
        }
        self._shares: dict[tuple, dict[str, int]] = {}
        self.limit = {k.name: MEMORY_FRACTION * k.memory_bytes for k in inventory.kinds_present}
        self.peak = sum(k.peak_bf16_flops * self.cluster.count(k) for k in self.cluster.kinds)
        self.flops_per_token = self.model.flops_per_token(seq_len)
        self._grids: dict[tuple, np.ndarray] = {}
        self._mesh_memo: dict[tuple, Any] = {}
        # kinds ordered slowest first (peak FLOP/s, then name): the rank of each kind index, and back
        order = sorted(range(len(self.cluster.kinds)), key=lambda i: self._speed(self.cluster.kinds[i]))
        self._rank = np.empty(len(order), dtype=np.int32)
        self._rank[order] = np.arange(len(order))
        self._by_rank = [self.cluster.kinds[i] for i in order]
        # per stage: its base without the moved rows (`stage_cost`), its clock per kind, its costs per moved rows
        self._stage_bases: dict[tuple, tuple] = {}
        self._stage_full: collections.OrderedDict[tuple, cm.StageBase] = collections.OrderedDict()
        self._clock_memo: dict[tuple, dict] = {}
        self._uneven_classes: dict[tuple, tuple] = {}
        self.floor_memo: dict[tuple, dict[str, float]] = {}  # `sharding.planner.prune`'s floors per kind
        searched = tuple(k.name for k in self.model.attention_kernels if k.searched)
        self.attentions = searched if options.attentions is None else options.attentions
        for name in self.attentions:  # an unknown name is refused before the search, naming it
            self.model.attention_kernel(name)

    def grid(self, mesh: Mapping[str, int]) -> np.ndarray:
        """``[data, stage, fsdp, context, sequence, tensor]`` int (the mesh's axes): the kind index (into ``cluster.kinds``) of the device
        at each mesh position, as `sharding.mesh.device_grid` places devices (memoised per mesh)."""
        key = tuple(mesh.values())
        if key not in self._grids:
            positions = grid_positions(dict(mesh), self.cluster.hosts, self.cluster.per_host)
            self._grids[key] = self.cluster.kind_index[positions]
        return self._grids[key]

    def _per_mesh(self, name: str, mesh, make):
        key = (name, tuple(mesh.values()))
        if key not in self._mesh_memo:
            self._mesh_memo[key] = make()
        return self._mesh_memo[key]

    def batch_kinds(self, mesh) -> list[Any]:
        """Slowest kind at each position along ``data`` x ``fsdp`` (data-major)."""

        def make():
            slowest = self._rank[self.grid(mesh)].min(axis=_within_batch_group(mesh)).reshape(-1)
            return tuple(self._by_rank[r] for r in slowest)

        return list(self._per_mesh("batch", mesh, make))

    def stage_kind_sets(self, mesh) -> list[tuple[Any, ...]]:
        """The distinct device kinds of each stage's devices (sorted by name, so not by host order): a
        stage spans ``data``, ``fsdp``, ``sequence`` and ``tensor``, which may cross hosts of different kinds."""

        def make():
            grid, kinds = self.grid(mesh), self.cluster.kinds
            out = []
            for s in range(mesh[ax.STAGE]):
                present = [kinds[i] for i in np.unique(grid[:, s])]
                out.append(tuple(sorted(present, key=lambda k: k.name)))
            return tuple(out)

        return list(self._per_mesh("stages", mesh, make))

    def stage_kinds(self, mesh) -> list[Any]:
        """The slowest kind (by peak FLOP/s, then name) of each stage."""
        return [min(kinds, key=lambda k: (k.peak_bf16_flops, k.name)) for kinds in self.stage_kind_sets(mesh)]

    def ring_kind_sets(self, mesh, length_axes: Sequence[str]) -> list[tuple[Any, ...]]:
        """The distinct device kinds at each position along the length's split (``length_axes``, the rules'
        `sharding.rules.Rules.length_axes`: ``context`` x ``sequence`` under every preset; the first major,
        the ring's order), over every other axis (sorted by name)."""

        def make():
            names = list(mesh)
            ring = [names.index(a) for a in length_axes]
            grid = np.moveaxis(self.grid(mesh), ring, list(range(len(ring))))
            rows = grid.reshape(int(np.prod(grid.shape[: len(ring)])), -1)
            kinds = self.cluster.kinds
            return tuple(tuple(sorted((kinds[i] for i in np.unique(row)), key=lambda k: k.name)) for row in rows)

        return list(self._per_mesh(("ring", *length_axes), mesh, make))

    def ring_kinds(self, mesh, length_axes: Sequence[str]) -> list[Any]:
        """The slowest kind (by peak FLOP/s, then name) at each position along the length's split (``length_axes``,
        ring order)."""
        return [min(kinds, key=self._speed) for kinds in self.ring_kind_sets(mesh, length_axes)]

    def kinds_in(self, mesh) -> list[Any]:
        """The kinds on the mesh, in order of first appearance along it."""

        def make():
            flat = self.grid(mesh).reshape(-1)
            present, first = np.unique(flat, return_index=True)
            return tuple(self.cluster.kinds[i] for i in present[np.argsort(first)])

        return list(self._per_mesh("kinds", mesh, make))

    @staticmethod
    def _speed(kind) -> tuple[float, str]:
        return (kind.peak_bf16_flops, kind.name)

    def links(self, mesh) -> dict[str, str]:
        return cm.link_classes(mesh, self.cluster.per_host)

    def shares(self, mesh) -> dict[str, int]:
        key = tuple(mesh.values())
        if key not in self._shares:
            self._shares[key] = cm.host_shares(mesh, self.cluster.per_host)
        return self._shares[key]

    def clock_memo(self, kind, mesh) -> dict:
        """The seconds of each collective and product shape priced so far on ``kind`` in ``mesh`` (`cm.step_time`'s
        ``memo``)."""
        return self._clock_memo.setdefault((kind.name, tuple(mesh.items())), {})

    def time(self, cost: cm.Cost, kind, mesh) -> cm.StepTime:
        """``cost``'s `cm.StepTime` on a device of ``kind`` in ``mesh``; each collective's and product shape's
        seconds are kept per kind and mesh (`cm.step_time`'s ``memo``), the same figures computed once."""
        memo = self.clock_memo(kind, mesh)
        return cm.step_time(
            cost, self.hardware[kind.name], self.links(mesh), self.shares(mesh), self.options.overlaps, memo
        )

    def finish(
        self,
        layout,
        counts,
        rows,
        devices: list[tuple[str, cm.Cost, cm.StepTime]],
        seconds: float | None = None,
        idle: Sequence[str] = (),
    ) -> Plan:
        """Combines per-device-class results ``(label, cost, time)`` into a `Plan`; the slowest
        class paces the step (``seconds`` overrides its time, e.g. with a pipeline bubble)."""
        label, _, st = max(devices, key=lambda d: d[2].total)
        seconds = st.total if seconds is None else seconds
        memory = self._memory_by_kind(devices)
        parts_of: dict[str, dict[str, float]] = {}
        for name, c, _ in devices:
            kind = name.split("/")[0]
            if c.memory.total >= memory[kind]:  # the last of the largest, as before
                parts_of[kind] = {f.name: getattr(c.memory, f.name) for f in dataclasses.fields(c.memory)}
        fits = all(memory[k] <= self.limit[k] for k in memory)
        tokens = self.batch * self.seq / seconds
        parts = {
            "compute": st.compute,
            "exposed_comm": st.exposed_comm,
            "overlapped_comm": st.overlapped_comm,
            "overlap_exposed": st.overlap_exposed,
            "contention": st.contention,
            "optimizer": st.optimizer,
            "bubble": seconds - st.total,
        }
        return Plan(
            layout,
            counts,
            rows,
            seconds,
            tokens,
            tokens * self.flops_per_token / self.peak,
            memory,
            {k: self.limit[k] for k in memory},
            parts,
            label,
            fits,
            dict(st.by_kind),
            parts_of,
            tuple(idle),
        )

    @staticmethod
    def _memory_by_kind(devices: Sequence[tuple[str, cm.Cost, cm.StepTime]]) -> dict[str, float]:
        """Kind name -> the largest predicted bytes of its devices (labels ``kind`` or ``kind/stageN``)."""
        memory: dict[str, float] = {}
        for name, c, _ in devices:
            kind = name.split("/")[0]
            memory[kind] = max(memory.get(kind, 0.0), c.memory.total)
        return memory

    def uniform(self, layout: cm.Layout) -> Plan | None:
        mesh = layout.mesh
        per = layout.batch_split * layout.microbatches
        if self.batch % per:
            return None
        rows = self.batch / per
        if mesh[ax.STAGE] > 1:
            return self._pipeline(layout, rows)
        if layout.context_shares is not None:
            return self._shared_ring(layout, rows)
        devices = []
        for kind in self.kinds_in(mesh):
            cost = cm.device_cost(self.model, layout, seq_len=self.seq, rows=rows, backend=self.options.backend)
            devices.append((kind.name, cost, self.time(cost, kind, mesh)))
        return self.finish(layout, None, rows, devices)

    def _shared_ring(self, layout: cm.Layout, rows: float) -> Plan:
        """Uneven sequence shards: each device of the ring priced on its own share (`cm.device_cost`'s
        ``ring_position``), once per kind and share; the slowest paces the step. Every device holds the
        same padded blocks, so memory is alike; attention is what differs."""
        mesh, tokens = layout.mesh, cm.ring_tokens(layout, self.seq)
        devices, seen = [], set()
        for position, kinds in enumerate(self.ring_kind_sets(mesh, layout.rules_table().length_axes(mesh))):
            for kind in kinds:
                if (kind.name, tokens[position]) in seen:
                    continue
                seen.add((kind.name, tokens[position]))
                cost = cm.device_cost(
                    self.model,
                    layout,
                    seq_len=self.seq,
                    rows=rows,
                    backend=self.options.backend,
                    ring_position=position,
                )
                devices.append((kind.name, cost, self.time(cost, kind, mesh)))
        return self.finish(layout, None, rows, devices)

    def _pipeline(self, layout: cm.Layout, rows: float) -> Plan | None:
        """The `Plan` of a pipeline layout (`_pipeline_clock`)."""
        clocked = self._pipeline_clock(layout, rows)
        if clocked is None:
            return None
        devices, seconds = clocked
        holders = tuple("+".join(k.name for k in kinds) for kinds in self.stage_kind_sets(layout.mesh))
        return dataclasses.replace(self.finish(layout, None, rows, devices, seconds), stage_kinds=holders)

    def pipeline_seconds(self, layout: cm.Layout) -> tuple[float, bool] | None:
        """``(step seconds, fits)`` of a pipeline layout, as `uniform` prices it, without building its `Plan`
        (brute force over stage splits); None where `uniform` gives None."""
        per = layout.batch_split * layout.microbatches
        if self.batch % per:
            return None
        clocked = self._pipeline_clock(layout, self.batch / per)
        if clocked is None:
            return None
        devices, seconds = clocked
        memory = self._memory_by_kind(devices)
        return seconds, all(memory[k] <= self.limit[k] for k in memory)

    def _pipeline_clock(self, layout: cm.Layout, rows: float) -> tuple[list, float] | None:
        """Stages run in lockstep (one SPMD program). GPipe/circular: each of the ``R*M + S - 1`` steps
        lasts as long as the slowest stage's chunk (forward and backward) for one microbatch. The 1F1B family
        (``1f1b``, ``1f1b-fused``, ``zb``): each tick of its table (`sharding.costmodel.tick_table`) lasts as
        long as the busiest stage's work in it, each op priced at its `TICK_SHARES` share of that stage's
        chunk time (`sharding.pipeline.ticks.tick_time`). The optimizer runs once after. None for a split or
        schedule the run refuses (`plan_layout`: fewer layers than repeats on a stage; interleaved 1F1B: M
        not a multiple of S; zero bubble with repeats), else ``(devices, seconds)``: each stage device's
        ``(label, cost, time)`` and the step's seconds."""
        mesh, stages = layout.mesh, layout.stage_layers
        m, r = layout.microbatches, layout.pipeline_repeats
        try:
            plan_layout(sum(stages), mesh[ax.STAGE], r, stages)
            table = cm.tick_table(layout.pipeline_schedule, mesh[ax.STAGE], m, r)
        except ValueError:
            return None
        slots = max(stages)
        devices, busiest = [], [0.0] * mesh[ax.STAGE]
        for s, kinds in enumerate(self.stage_kind_sets(mesh)):
            for kind in kinds:  # every kind a stage holds: its memory limit and its speed
                cost, st = self.stage_cost(layout, kind, rows, stages[s], slots)
                devices.append((f"{kind.name}/stage{s}", cost, st))
                busiest[s] = max(busiest[s], st.total - st.optimizer)  # its R*M chunks' forward + backward
        return devices, self.pipeline_busy(layout, table, busiest) + max(st.optimizer for _, _, st in devices)

    def pipeline_busy(self, layout: cm.Layout, table, busiest: Sequence[float]) -> float:
        """A pipeline's seconds before its optimizer (`_pipeline_clock`), from ``busiest``: ``[stage]`` seconds of
        each stage's slowest device less its optimizer's (its ``R*M`` chunks, forward and backward). GPipe/circular:
        the slowest stage's over one less the bubble; the fused 1F1B clock: times ``1 + (S - 1) / (R M)``; the
        lockstep one: the tick table's (``table``, `cm.tick_table`) sum of each tick's busiest stage. Each grows
        with every entry of ``busiest`` (`sharding.planner.prune` relies on it)."""
        m, r, stages = layout.microbatches, layout.pipeline_repeats, layout.mesh[ax.STAGE]
        busy = max(busiest)  # the slowest stage's R*M chunks
        if layout.pipeline_schedule.one_f_one_b and self.options.one_f_one_b_clock == "fused":
            return busy * (1 + (stages - 1) / (r * m))
        if layout.pipeline_schedule.one_f_one_b:
            chunk = [b / (r * m) for b in busiest]  # one chunk's forward + backward
            return tick_time(table, *([share * c for c in chunk] for share in TICK_SHARES[layout.pipeline_schedule]))
        return busy / (1.0 - bubble_fraction(stages, m, r))

    def stage_cost(self, layout: cm.Layout, kind, rows: float, layers: int, slots: int):
        """``(cost, time)`` of a stage device holding ``slots`` layers and computing ``layers``, the cost without
        its collectives and products (what the plan reads of it: FLOPs and memory).

        A split changes a stage device's cost only through the stored rows it moves (`stored_rows_moved`):
        the rest is priced once per stage (`cm.stage_cost_base`, whatever the other stages hold) and the
        moved rows' terms added to it (`cm.StageBase.with_moved`); the time continues the base's collective
        sums with the moved rows' transfers (`cm.comm_totals`), which `cm.device_cost` lists last, so each
        figure is the whole cost's to the bit. The cost does not depend on the kind (only its time does): one
        serves every kind of a stage."""
        # Every field of the layout but the split (the optimizer state's layout among them: keyed without it, a
        # split state's stage was priced as the replicated one's, or the other way round, whichever came first)
        key = (tuple(layout.mesh.items()), *(getattr(layout, f) for f in _STAGE_KEY_FIELDS), rows, layers, slots)
        entry = self._stage_bases.get(key)
        if entry is None:
            base = self._stage_base(key, layout, rows, layers, slots)
            light = dataclasses.replace(base, cost=dataclasses.replace(base.cost, comms=(), gemms=()))
            entry = self._stage_bases[key] = (light, {}, {})
        light, clock, by_moved = entry
        moved = stored_rows_moved(self.model, layout)
        if moved not in by_moved:
            by_moved[moved] = (dataclasses.replace(light.with_moved(moved), comms=()), {})
        cost, times = by_moved[moved]
        if kind.name not in times:
            memo = self.clock_memo(kind, layout.mesh)
            hw, links, shares = self.hardware[kind.name], self.links(layout.mesh), self.shares(layout.mesh)
            if kind.name not in clock:
                full = self._stage_full.get(key) or self._stage_base(key, layout, rows, layers, slots)
                clock[kind.name] = (
                    cm.compute_seconds(full.cost, hw, memo),
                    cm.comm_totals(full.cost.comms, hw, links, shares, self.options.overlaps, memo),
                )
            compute, totals = clock[kind.name]
            totals = cm.comm_totals(light.moved_comms(moved), hw, links, shares, self.options.overlaps, memo, totals)
            times[kind.name] = cm.step_time_from(cost, hw, compute, totals)
        return cost, times[kind.name]

    def _stage_base(self, key: tuple, layout: cm.Layout, rows: float, layers: int, slots: int) -> cm.StageBase:
        """`cm.stage_cost_base` of a stage, kept whole (collectives and products) for the last `_STAGE_FULL` keys
        (another kind's time); one evicted is priced again (the same figures)."""
        base = cm.stage_cost_base(
            self.model,
            layout,
            seq_len=self.seq,
            rows=rows,
            layers=layers,
            slots=slots,
            backend=self.options.backend,
        )
        self._stage_full[key] = base
        if len(self._stage_full) > _STAGE_FULL:
            self._stage_full.popitem(last=False)
        return base

    def uneven_class(self, layout: cm.Layout, rows: float, kind, count: int) -> tuple:
        """``(kind name, cost, time)`` of a device of ``kind`` running ``count`` microbatches of ``rows`` rows under
        the uneven step, memoised per layout, rows, kind and count: a search prices many count vectors of one
        layout (`uneven`, `sharding.planner.shares`)."""
        memo = (repr(layout), rows, kind.name, count)
        if memo not in self._uneven_classes:
            cost = cm.device_cost(
                self.model,
                layout,
                seq_len=self.seq,
                rows=rows,
                microbatches=count,
                backend=self.options.backend,
                batch_rows=self.batch,
            )
            self._uneven_classes[memo] = (kind.name, cost, self.time(cost, kind, layout.mesh))
        return self._uneven_classes[memo]

    def uneven(self, layout: cm.Layout, counts: Sequence[int], rows: float) -> Plan:
        """Uneven data parallelism: device ``i`` along data x fsdp runs ``counts[i]`` microbatches."""
        mesh = layout.mesh
        kinds = self.batch_kinds(mesh)
        by_class: dict[tuple[str, int], tuple] = {}
        for kind, count in zip(kinds, counts):
            if (kind.name, count) not in by_class:
                by_class[kind.name, count] = self.uneven_class(layout, rows, kind, count)
        plan_ = self.finish(layout, tuple(counts), rows, list(by_class.values()), idle=self.idle_kinds(mesh, counts))
        per_kind: dict[str, set[int]] = {}
        for kind, count in zip(kinds, counts):
            per_kind.setdefault(kind.name, set()).add(count)
        if all(len(v) == 1 for v in per_kind.values()):
            plan_ = dataclasses.replace(plan_, kind_counts=tuple((k, v.pop()) for k, v in per_kind.items()))
        return plan_

    def idle_kinds(self, mesh, counts: Sequence[int]) -> list[str]:
        """The kinds none of whose data-parallel groups (data x fsdp positions, data major) gets a microbatch."""
        grid, kinds = self.grid(mesh), self.cluster.kinds
        # [data * fsdp, kinds]: whether a data-parallel group holds a device of each kind
        within = _within_batch_group(mesh)
        holds = np.stack([(grid == i).any(axis=within).reshape(-1) for i in range(len(kinds))], axis=1)
        busy = holds[np.asarray(counts) > 0].any(axis=0)
        order = self.kinds_in(mesh)
        return [k.name for k in order if holds[:, kinds.index(k)].any() and not busy[kinds.index(k)]]


def over_memory(p: Plan) -> float:
    """How far a plan is over memory: the largest of its kinds' predicted bytes over their usable bytes
    (1.0 or less fits)."""
    return max(p.memory[k] / p.memory_limit[k] for k in p.memory)
