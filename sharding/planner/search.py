"""The layout planner: the fastest layout of one training step on a (mixed) cluster.

Given the model's dimensions, an inventory (`sharding.devices.Inventory`: hosts, their device
kinds, the network), the global batch and the sequence length, `plan` searches

* the mesh: ``data``, ``stage``, ``fsdp``, ``sequence``, ``tensor`` sizes whose product is the
  device count; each ``tensor`` (and ``sequence``) group inside one host, hence one kind;
* the rules preset (``dp``, ``fsdp``, ``tp``, ``fsdp_tp``), the attention implementation,
  microbatches and the remat policy;
* per-kind batch shares (uneven data parallelism, `train.hetero`): each device runs a number of
  microbatches proportional to its kind's speed, then refined on the cost model;
* stage splits (pipeline): layers per stage proportional to the speed of the kind that holds the
  stage, then moved one at a time while that lowers the predicted step time, within each kind's
  memory;

predicts each layout's step time with `sharding.costmodel` (the slowest device paces the step;
a pipeline adds its bubble ``(S-1)/(R*M+S-1)``), rejects layouts that do not fit a device's memory
(`MEMORY_FRACTION` of it), and returns the plans fastest first, each with why it lost to the best.

The search is the systematic part of Metis (Um et al., USENIX ATC'24: enumerate device groups and
parallelism, prune by memory, price with a cost model) and FlashFlex (Yan et al., 2024), with the
proportional work split of HAP (Zhang et al., EuroSys'24) and AMP (Li et al., NeurIPS'22) instead of
their integer programs: shares and splits are derived, not enumerated, which keeps a plan under
a second; `brute_force` enumerates them all, for tests.

This module imports jax only (through `sharding.costmodel`), never the model.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from sharding import axes as ax
from sharding import costmodel as cm
from sharding.mesh import device_grid, format_mesh
from sharding.modeldesc import ModelDescription
from sharding.parallel import Accumulation, Parallelism, UnevenBatch
from sharding.pipeline.layout import PipelinePlan, bubble_fraction, one_f_one_b_ticks, pipeline_rules, plan_layout
from sharding.splits import largest_remainder, min_max_assign

__all__ = [
    "MEMORY_FRACTION",
    "Plan",
    "PlanOptions",
    "brute_force",
    "evaluate",
    "format_table",
    "plan",
    "uniform_baseline",
]

#: Share of a device's memory a plan may use; the rest is left to the runtime, the allocator's
#: fragmentation and the activations the cost model misses (it predicts 0.5-0.9x of what the CPU
#: compiler allocates for temporaries, bench/results/costmodel.md).
MEMORY_FRACTION = 0.85

#: A 1F1B tick's share of a chunk's forward and backward time: the tick lasts as long as the slowest op,
#: a backward, which recomputes the chunk's forward and then runs the backward's two products per forward
#: product (3 of the 4 forward-equivalents; `sharding.pipeline.onef1b`, "Lockstep cost").
ONE_F_ONE_B_TICK = 0.75


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """What the search may choose.

    Attributes:
      rules: Presets to try.
      remats: Remat policies to try, cheapest first.
      attentions: Attention implementations to try.
      dtype: Compute dtype (``bfloat16`` for GPUs).
      max_microbatches: Largest number of microbatches (per device, uniform) to try.
      pipeline: Whether to try ``stage > 1`` (the pipeline flags of train.py).
      max_stages: Largest ``stage`` to try (None: up to the layers).
      repeats: Circular pipeline repeats to try.
      schedules: Pipeline schedules to use: ``gpipe`` (circular with repeats) and ``1f1b`` (interleaved with
        repeats), priced where GPipe does not fit (slower in lockstep, at most about S microbatches'
        stage inputs kept).
      sequence: Whether to try ``sequence > 1``.
      hetero: Whether to try uneven data parallelism.
      efficiency: Fraction of peak FLOP/s the step reaches (`sharding.costmodel.Hardware`).
      backend: Collective lowering (`sharding.costmodel.BACKENDS`).
    """

    rules: tuple[str, ...] = ("dp", "fsdp", "tp", "fsdp_tp")
    remats: tuple[str, ...] = ("none", "dots", "full")
    attentions: tuple[str, ...] = ("flash", "reference")
    dtype: str = "bfloat16"
    max_microbatches: int = 64
    pipeline: bool = True
    max_stages: int | None = None
    repeats: tuple[int, ...] = (1, 2)
    schedules: tuple[str, ...] = ("gpipe", "1f1b")
    sequence: bool = False
    hetero: bool = True
    efficiency: float = 0.5
    backend: str = "gpu"


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
      parts: Seconds of the slowest device: ``compute``, ``exposed_comm``, ``overlapped_comm``,
        ``optimizer``, ``bubble`` (pipeline idle time).
      paced_by: The kind (and stage) of the slowest device.
      fits: Whether every device fits its memory limit.
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

    @property
    def stage_layers(self) -> tuple[int, ...] | None:
        return self.layout.stage_layers

    def key(self) -> tuple:
        """A description that identifies the plan (for tables and de-duplication)."""
        lay = self.layout
        return (format_mesh(lay.mesh), lay.rules_name, lay.microbatches, lay.remat, lay.attention,
                lay.stage_layers, lay.pipeline_repeats, lay.one_f_one_b, self.counts)

    def parallelism(self) -> Parallelism:
        """The plan as the run's `sharding.parallel.Parallelism` (not bound to a mesh): its mesh, rules
        and strategy: `UnevenBatch` with the counts, a `PipelinePlan` of the stage split, or
        `Accumulation` over the microbatches."""
        lay = self.layout
        rules = lay.rules_table()
        if self.counts is not None:
            strategy = UnevenBatch(counts=tuple(self.counts), microbatches=lay.microbatches)
        elif lay.mesh[ax.STAGE] > 1:
            stages, _ = plan_layout(sum(lay.stage_layers), lay.mesh[ax.STAGE], lay.pipeline_repeats, lay.stage_layers)
            strategy = PipelinePlan(stages, lay.microbatches, one_f_one_b=lay.one_f_one_b)
            rules = pipeline_rules(rules)
        else:
            strategy = Accumulation(lay.microbatches)
        return Parallelism(lay.mesh, rules, strategy)

    def flags(self, cluster: str | None = None) -> str:
        """The ``python -m train.train`` flags that reproduce the plan: `Parallelism.flags` of
        `parallelism`, then the model's execution flags (``--remat``, ``--attention``, ``--dtype``) and
        ``--cluster`` when given."""
        lay = self.layout
        parts = self.parallelism().flags() + ["--remat", lay.remat, "--attention", lay.attention, "--dtype", lay.dtype]
        if cluster:
            parts += ["--cluster", cluster]
        return " ".join(parts)


# --- The cluster ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Cluster:
    kinds: tuple[Any, ...]  # kind of each global device
    hosts: tuple[int, ...]  # host of each global device
    per_host: int
    inter_bandwidth: float

    @property
    def size(self) -> int:
        return len(self.kinds)


class _FakeDevice:
    def __init__(self, index: int, host: int):
        self.id, self.process_index = index, host


def _cluster(inventory) -> _Cluster:
    counts = {h.count for h in inventory.hosts}
    if len(counts) != 1:
        raise ValueError(
            f"--cluster: the planner needs hosts of equal size, got {', '.join(str(h.count) for h in inventory.hosts)} "
            f"devices; describe the cluster as equal hosts, e.g. h100:8,a100:8"
        )
    for kind in inventory.kinds_present:
        if not kind.is_known:
            raise ValueError(f"--cluster: the figures of device kind {kind.name!r} are unknown; name a known kind "
                             f"(e.g. h100:8) or give them in a cluster file")
    return _Cluster(inventory.device_kinds(), inventory.device_hosts(), counts.pop(), inventory.inter_host_bandwidth)


# --- Enumeration ------------------------------------------------------------------------------


def _factorizations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, parts - 1):
                yield (d,) + rest


def _meshes(model: ModelDescription, cluster: _Cluster, options: PlanOptions) -> Iterator[dict[str, int]]:
    """Mesh shapes: tensor and sequence groups inside a host; the model's ``heads``, ``mlp`` and
    ``vocab`` divisible by ``tensor``."""
    for data, stage, fsdp, sequence, tensor in _factorizations(cluster.size, 5):
        if tensor * sequence > cluster.per_host or cluster.per_host % (tensor * sequence):
            continue
        if sequence > 1 and not options.sequence:
            continue
        if stage > 1 and (not options.pipeline or stage > model.num_layers
                          or (options.max_stages is not None and stage > options.max_stages)):
            continue
        if tensor > 1 and any(model.axis_sizes[a] % tensor for a in (ax.HEADS, ax.MLP, ax.VOCAB)):
            continue
        yield {ax.DATA: data, ax.STAGE: stage, ax.FSDP: fsdp, ax.SEQUENCE: sequence, ax.TENSOR: tensor}


def _rules_for(model: ModelDescription, mesh: Mapping[str, int], options: PlanOptions) -> list[str]:
    """Presets that differ on this mesh: ``fsdp*`` only with ``fsdp`` > 1, ``*tp`` only with ``tensor`` > 1."""
    out = []
    for name in options.rules:
        wants_fsdp, wants_tp = name.startswith("fsdp"), name.endswith("tp")
        if wants_fsdp != (mesh[ax.FSDP] > 1) or wants_tp != (mesh[ax.TENSOR] > 1):
            continue
        if wants_fsdp and model.axis_sizes[ax.EMBED] % mesh[ax.FSDP]:
            continue
        out.append(name)
    return out


def _microbatch_options(per_device_rows: int, limit: int, at_least: int = 1) -> list[int]:
    out, m = [], 1
    while m <= min(per_device_rows, limit):
        if per_device_rows % m == 0 and m >= at_least:
            out.append(m)
        m *= 2
    return out


# --- Evaluation -------------------------------------------------------------------------------


class _Evaluator:
    """Prices layouts on one cluster (caches hardware, grids and kinds per mesh)."""

    def __init__(self, model, inventory, global_batch: int, seq_len: int, options: PlanOptions):
        self.model, self.batch, self.seq, self.options = cm.describe_model(model), global_batch, seq_len, options
        self.cluster = _cluster(inventory)
        self.hardware = {k.name: cm.hardware_for(k, self.cluster.per_host, self.cluster.inter_bandwidth,
                                                 options.efficiency) for k in inventory.kinds_present}
        self.limit = {k.name: MEMORY_FRACTION * k.memory_bytes for k in inventory.kinds_present}
        self.peak = sum(k.peak_bf16_flops for k in self.cluster.kinds)
        self.flops_per_token = self.model.flops_per_token(seq_len)
        self._grids: dict[tuple, Any] = {}
        self._stage_costs: dict[tuple, tuple] = {}

    def grid(self, mesh: Mapping[str, int]):
        key = tuple(mesh.values())
        if key not in self._grids:
            self._grids[key] = device_grid(dict(mesh), [_FakeDevice(i, h) for i, h in enumerate(self.cluster.hosts)])
        return self._grids[key]

    def kind_of(self, device) -> Any:
        return self.cluster.kinds[device.id]

    def batch_kinds(self, mesh) -> list[Any]:
        """Slowest kind at each position along ``data`` x ``fsdp`` (data-major)."""
        grid = self.grid(mesh)
        out = []
        for d in range(mesh[ax.DATA]):
            for f in range(mesh[ax.FSDP]):
                group = grid[d, :, f, :, :].reshape(-1)
                out.append(min((self.kind_of(x) for x in group), key=lambda k: k.peak_bf16_flops))
        return out

    def stage_kind_sets(self, mesh) -> list[tuple[Any, ...]]:
        """The distinct device kinds of each stage's devices (sorted by name, so not by host order): a
        stage spans ``data``, ``fsdp``, ``sequence`` and ``tensor``, which may cross hosts of different kinds."""
        grid = self.grid(mesh)
        out = []
        for s in range(mesh[ax.STAGE]):
            kinds = {k.name: k for k in map(self.kind_of, grid[:, s].reshape(-1))}
            out.append(tuple(kinds[n] for n in sorted(kinds)))
        return out

    def stage_kinds(self, mesh) -> list[Any]:
        """The slowest kind (by peak FLOP/s, then name) of each stage."""
        return [min(kinds, key=lambda k: (k.peak_bf16_flops, k.name)) for kinds in self.stage_kind_sets(mesh)]

    def kinds_in(self, mesh) -> list[Any]:
        seen = {}
        for x in self.grid(mesh).reshape(-1):
            seen.setdefault(self.kind_of(x).name, self.kind_of(x))
        return list(seen.values())

    def links(self, mesh) -> dict[str, str]:
        return cm.link_classes(mesh, self.cluster.per_host)

    def time(self, cost: cm.Cost, kind, mesh) -> cm.StepTime:
        return cm.step_time(cost, self.hardware[kind.name], self.links(mesh))

    def finish(self, layout, counts, rows, devices: list[tuple[str, cm.Cost, cm.StepTime]],
               seconds: float | None = None) -> Plan:
        """Combines per-device-class results ``(label, cost, time)`` into a `Plan`; the slowest
        class paces the step (``seconds`` overrides its time, e.g. with a pipeline bubble)."""
        label, _, st = max(devices, key=lambda d: d[2].total)
        seconds = st.total if seconds is None else seconds
        memory: dict[str, float] = {}
        for name, c, _ in devices:
            kind = name.split("/")[0]
            memory[kind] = max(memory.get(kind, 0.0), c.memory.total)
        fits = all(memory[k] <= self.limit[k] for k in memory)
        tokens = self.batch * self.seq / seconds
        parts = {"compute": st.compute, "exposed_comm": st.exposed_comm, "overlapped_comm": st.overlapped_comm,
                 "optimizer": st.optimizer, "bubble": seconds - st.total}
        return Plan(layout, counts, rows, seconds, tokens, tokens * self.flops_per_token / self.peak,
                    memory, {k: self.limit[k] for k in memory}, parts, label, fits)

    def uniform(self, layout: cm.Layout) -> Plan | None:
        mesh = layout.mesh
        per = layout.batch_split * layout.microbatches
        if self.batch % per:
            return None
        rows = self.batch / per
        if mesh[ax.STAGE] > 1:
            return self._pipeline(layout, rows)
        devices = []
        for kind in self.kinds_in(mesh):
            cost = cm.device_cost(self.model, layout, seq_len=self.seq, rows=rows, backend=self.options.backend)
            devices.append((kind.name, cost, self.time(cost, kind, mesh)))
        return self.finish(layout, None, rows, devices)

    def _pipeline(self, layout: cm.Layout, rows: float) -> Plan | None:
        """Stages run in lockstep (one SPMD program). GPipe/circular: each of the ``R*M + S - 1`` steps
        lasts as long as the slowest stage's chunk (forward and backward) for one microbatch. 1F1B: each of
        its ticks (`one_f_one_b_ticks`, ``2 (M + S - 1)`` with one chunk) lasts as long as the slowest
        stage's backward of a chunk, `ONE_F_ONE_B_TICK` of its forward and backward. The optimizer runs
        once after. None for a split or schedule the run refuses (`plan_layout`: fewer layers than
        repeats on a stage; interleaved 1F1B: M not a multiple of S)."""
        mesh, stages = layout.mesh, layout.stage_layers
        m, r = layout.microbatches, layout.pipeline_repeats
        try:
            plan_layout(sum(stages), mesh[ax.STAGE], r, stages)
            ticks = one_f_one_b_ticks(mesh[ax.STAGE], m, r).ticks if layout.one_f_one_b else 0
        except ValueError:
            return None
        slots = max(stages)
        devices = []
        for s, kinds in enumerate(self.stage_kind_sets(mesh)):
            for kind in kinds:  # every kind a stage holds: its memory limit and its speed
                cost, st = self.stage_cost(layout, kind, rows, stages[s], slots)
                devices.append((f"{kind.name}/stage{s}", cost, st))
        busy = max(st.total - st.optimizer for _, _, st in devices)  # the slowest stage's R*M chunks
        if layout.one_f_one_b:
            busy = ticks * ONE_F_ONE_B_TICK * busy / (r * m)
        else:
            busy /= 1.0 - bubble_fraction(mesh[ax.STAGE], m, r)
        seconds = busy + max(st.optimizer for _, _, st in devices)
        return self.finish(layout, None, rows, devices, seconds)

    def stage_cost(self, layout: cm.Layout, kind, rows: float, layers: int, slots: int):
        """``(cost, time)`` of a stage device holding ``slots`` layers and computing ``layers``
        (memoized: a split's stages share them)."""
        # Not keyed by the whole split: the stored rows a stage receives by ppermute (`cm.device_cost`) are
        # those of the first split priced with these layers and slots (keying by the split made the search
        # ~6x slower; the rows moved are one ppermute per step, small beside the working copy's gather).
        # The cost does not depend on the kind (only its time does): one cost serves every kind of a stage.
        key = (tuple(layout.mesh.items()), layout.rules_name, layout.microbatches, layout.remat,
               layout.pipeline_repeats, layout.one_f_one_b, layout.attention, layout.dtype, rows, layers, slots)
        if key not in self._stage_costs:
            self._stage_costs[key] = (cm.device_cost(self.model, layout, seq_len=self.seq, rows=rows, layers=layers,
                                                     slots=slots, backend=self.options.backend), {})
        cost, times = self._stage_costs[key]
        if kind.name not in times:
            times[kind.name] = self.time(cost, kind, layout.mesh)
        return cost, times[kind.name]

    def uneven(self, layout: cm.Layout, counts: Sequence[int], rows: float) -> Plan:
        """Uneven data parallelism: device ``i`` along data x fsdp runs ``counts[i]`` microbatches."""
        mesh = layout.mesh
        kinds = self.batch_kinds(mesh)
        by_class: dict[tuple[str, int], tuple] = {}
        for kind, count in zip(kinds, counts):
            key = (kind.name, count)
            if key not in by_class:
                cost = cm.device_cost(self.model, layout, seq_len=self.seq, rows=rows, microbatches=count,
                                      backend=self.options.backend, batch_rows=self.batch)
                by_class[key] = (kind.name, cost, self.time(cost, kind, mesh))
        return self.finish(layout, tuple(counts), rows, list(by_class.values()))


# --- Search -----------------------------------------------------------------------------------


def _best_fitting(plans: Iterable[Plan | None]) -> Plan | None:
    """The fastest plan that fits (the first of equals), or None."""
    return min((p for p in plans if p is not None and p.fits), key=lambda p: p.step_time, default=None)


def _affine(seconds_at, near: int) -> tuple[float, float]:
    """``(a, b)`` of ``seconds(n) ~ a + b n`` around ``n = near``, from ``near`` and ``near + 1``.

    Compute grows linearly with microbatches and layers; the optimizer and traffic that overlaps
    compute are constant, so the time is piecewise affine and is fitted where the answer lies."""
    n = max(near, 1)
    at, after = seconds_at(n), seconds_at(n + 1)
    return at - (after - at) * n, after - at


def _uneven_counts(ev: _Evaluator, layout: cm.Layout, total: int, rows: float) -> Plan:
    """Counts per device: each kind's step time is affine in its microbatches (two evaluations per
    kind), so the min-max greedy on the affine times gives the counts; they start from the share
    proportional to speed (largest remainder) rounded down. One exact evaluation prices them."""
    kinds = ev.batch_kinds(layout.mesh)
    share = largest_remainder(total, [k.peak_bf16_flops for k in kinds])
    lines = {}
    for i, kind in enumerate(kinds):
        if kind.name in lines:
            continue

        def seconds(n, kind=kind):
            cost = cm.device_cost(ev.model, layout, seq_len=ev.seq, rows=rows, microbatches=n,
                                  backend=ev.options.backend, batch_rows=ev.batch)
            return ev.time(cost, kind, layout.mesh).total
        lines[kind.name] = _affine(seconds, share[i])
    start = [max(c - 1, 0) for c in share]
    counts = min_max_assign(total, start, lambda i, n: (lines[kinds[i].name][0] + lines[kinds[i].name][1] * n, n))
    return ev.uneven(layout, counts, rows)


def _stage_split(ev: _Evaluator, layout: cm.Layout) -> Plan | None:
    """Layers per stage: each stage's time is affine in its layers (two evaluations per stage kind),
    so the min-max greedy gives the split (at least one layer each), starting from the split
    proportional to the stage kinds' speed rounded down; then moves of 1 or 2 layers from the slowest
    and from the largest stage, while the exact predicted time drops."""
    mesh = layout.mesh
    sets = [tuple(k.name for k in kinds) for kinds in ev.stage_kind_sets(mesh)]
    by_name = {k.name: k for kinds in ev.stage_kind_sets(mesh) for k in kinds}
    per = layout.batch_split * layout.microbatches
    rows = ev.batch / per
    layers = ev.model.num_layers
    share = largest_remainder(layers, [k.peak_bf16_flops for k in ev.stage_kinds(mesh)], minimum=1)
    lines = {}
    for i, names in enumerate(sets):
        if names in lines:
            continue

        def seconds(n, names=names):  # a stage is as fast as its slowest kind
            cost = cm.device_cost(ev.model, layout, seq_len=ev.seq, rows=rows, layers=n, slots=n,
                                  backend=ev.options.backend)
            return max(ev.time(cost, by_name[name], mesh).total for name in names)
        lines[names] = _affine(seconds, share[i])
    start = [max(c - 1, 1) for c in share]
    split = min_max_assign(layers, start, lambda i, n: (lines[sets[i]][0] + lines[sets[i]][1] * n, n))
    best = ev.uniform(dataclasses.replace(layout, stage_layers=tuple(split)))

    def line(i):
        return lines[sets[i]][0] + lines[sets[i]][1] * split[i]

    # Moves of 1 or 2 layers while the exact time drops, from the slowest stage (by the lines) and from
    # the largest, to any stage: what the lines miss (every stage's working copy has the largest stage's
    # slots, rounded up to a multiple of the storage's devices per stage, and the stored rows a stage
    # receives) can favour a move towards an even split that a single layer does not show.
    for _ in range(layers):
        improved = False
        sources = dict.fromkeys((max(range(len(split)), key=line), max(range(len(split)), key=lambda i: split[i])))
        moves = [(i, j, n) for i in sources for n in (1, 2) for j in range(len(split)) if j != i and split[i] > n]
        for i, j, n in moves:
            trial = list(split)
            trial[i] -= n
            trial[j] += n
            candidate = ev.uniform(dataclasses.replace(layout, stage_layers=tuple(trial)))
            if candidate is not None and (best is None or (candidate.fits, -candidate.step_time)
                                          > (best.fits, -best.step_time)):
                split, best, improved = trial, candidate, True
                break
        if not improved:
            break
    return best


def _candidates(ev: _Evaluator) -> Iterator[tuple[cm.Layout, str]]:
    """The search space, the one loop every search walks: each mesh, rules preset, attention and
    layout skeleton (`_layouts`), tagged ``uniform``, ``uneven`` or ``pipeline``."""
    for mesh in _meshes(ev.model, ev.cluster, ev.options):
        for rules in _rules_for(ev.model, mesh, ev.options):
            for attention in ev.options.attentions:
                yield from _layouts(ev, mesh, rules, attention)


def _layouts(ev: _Evaluator, mesh: dict[str, int], rules: str, attention: str) -> Iterator[tuple[cm.Layout, str]]:
    """Layout skeletons for a mesh (remat and split filled in later), tagged uniform/uneven/pipeline."""
    opts, model = ev.options, ev.model
    n_batch = mesh[ax.DATA] * mesh[ax.FSDP]
    if ev.batch % n_batch:
        return
    per_device = ev.batch // n_batch
    stages = mesh[ax.STAGE]
    for m in _microbatch_options(per_device, opts.max_microbatches, at_least=stages if stages > 1 else 1):
        for r in (opts.repeats if stages > 1 else (1,)):
            if stages > 1 and stages * r > model.num_layers:
                continue
            base = cm.Layout(mesh, rules, m, "none", pipeline_repeats=r, attention=attention, dtype=opts.dtype)
            yield base, "pipeline" if stages > 1 else "uniform"
            uneven_ok = (opts.hetero and _uneven_fits(mesh, rules, attention)
                         and len({k.name for k in ev.kinds_in(mesh)}) > 1)
            if uneven_ok:
                yield dataclasses.replace(base, uneven_batch=True), "uneven"


def _uneven_fits(mesh: Mapping[str, int], rules: str, attention: str) -> bool:
    """Whether the uneven step (`train.strategies.UnevenGradients`) runs this layout as the cost model
    prices it: meshes over ``data``, ``fsdp`` and ``tensor`` (tensor inside each data-parallel group, one
    count per group). With ``tensor``, the attention must be one GSPMD partitions (``reference``,
    ``dot_product``: a kernel's own `jax.shard_map` cannot sit inside the step's, `train.checks`). Left
    out: parameters split over ``fsdp`` and ``tensor`` at once (``fsdp``/``fsdp_tp`` rules with both axes
    > 1), which the step runs exactly but whose parameter gathers the partitioner lays out with extra
    traffic the model does not count (tests/test_hetero.py)."""
    if any(mesh[a] > 1 for a in (ax.STAGE, ax.SEQUENCE)):
        return False
    if mesh[ax.TENSOR] > 1 and attention not in ("reference", "dot_product"):
        return False
    return not (mesh[ax.TENSOR] > 1 and mesh[ax.FSDP] > 1 and rules in ("fsdp", "fsdp_tp"))


def _price(ev: _Evaluator, layout: cm.Layout, tag: str) -> Plan | None:
    """The cheapest remat policy that fits (policies are tried cheapest first). A pipeline whose GPipe
    plan does not fit is also priced with 1F1B at the same split (`_one_f_one_b`); the fastest fitting of
    those and of the first fitting GPipe plan wins."""
    last, fitting = None, []
    for remat in ev.options.remats:
        lay = dataclasses.replace(layout, remat=remat)
        if tag == "pipeline":
            plan_ = _stage_split(ev, lay)
        elif tag == "uneven":
            n_batch = lay.batch_split
            total = n_batch * lay.microbatches
            plan_ = _uneven_counts(ev, lay, total, ev.batch / total)
        else:
            plan_ = ev.uniform(lay)
        if plan_ is None:
            continue
        if plan_.fits:
            fitting.append(plan_)
            break
        last = plan_
        one = _one_f_one_b(ev, plan_) if tag == "pipeline" else None
        if one is not None and one.fits:
            fitting.append(one)
    return min(fitting, key=lambda p: p.step_time) if fitting else last


def _one_f_one_b(ev: _Evaluator, gpipe: Plan) -> Plan | None:
    """``gpipe``'s layout under the 1F1B schedule when `PlanOptions.schedules` allows it and GPipe does not
    fit (1F1B's lockstep ticks make it slower, `_Evaluator._pipeline`: it is chosen for its memory only)."""
    if "1f1b" not in ev.options.schedules or gpipe.fits:
        return None
    return ev.uniform(dataclasses.replace(gpipe.layout, one_f_one_b=True))


def plan(model: Any, inventory, global_batch: int, seq_len: int, options: PlanOptions | None = None,
         top: int = 5) -> list[Plan]:
    """The best layouts of one training step, fastest first.

    Args:
      model: The model's `sharding.modeldesc.ModelDescription` (or an object with ``describe()``).
      inventory: A `sharding.devices.Inventory` (hosts of equal size).
      global_batch: B, sequences per step.
      seq_len: T, tokens per sequence.
      options: The search space (`PlanOptions`).
      top: How many plans to return (the best of each mesh and rules, then the rest).

    Returns:
      Plans that fit memory, fastest first (at most ``top``); when none fits, the closest ones
      with ``fits=False``.

    Raises:
      ValueError: On hosts of unequal size or unknown device figures (naming ``--cluster``), or ``top`` < 1.
    """
    if top < 1:
        raise ValueError(f"--top must be at least 1 (got {top}), e.g. --top 8")
    ev = _Evaluator(model, inventory, global_batch, seq_len, options or PlanOptions())
    found: dict[tuple, Plan] = {}
    for layout, tag in _candidates(ev):
        priced = _price(ev, layout, tag)
        if priced is not None:
            found[priced.key()] = priced
    plans = sorted(found.values(), key=lambda p: (not p.fits, p.step_time))
    return _diverse(plans, top)


def _diverse(plans: list[Plan], top: int) -> list[Plan]:
    """The best plan of each distinct (mesh, rules, uneven or not) first, then the rest."""
    seen, first, rest = set(), [], []
    for p in plans:
        key = (format_mesh(p.layout.mesh), p.layout.rules_name, p.counts is not None)
        (rest if key in seen else first).append(p)
        seen.add(key)
    return (first + rest)[:top]


def uniform_baseline(model: Any, inventory, global_batch: int, seq_len: int,
                     options: PlanOptions | None = None) -> Plan | None:
    """The best plan where every device does the same work (no uneven shares, even stages)."""
    options = dataclasses.replace(options or PlanOptions(), hetero=False)
    ev = _Evaluator(model, inventory, global_batch, seq_len, options)

    def even(layout: cm.Layout, tag: str) -> cm.Layout:
        if tag != "pipeline":
            return layout
        stages, _ = plan_layout(ev.model.num_layers, layout.mesh[ax.STAGE])
        return dataclasses.replace(layout, stage_layers=stages.stage_layers)

    return _best_fitting(ev.uniform(even(dataclasses.replace(layout, remat=remat), tag))
                         for layout, tag in _candidates(ev) for remat in options.remats)


def evaluate(model: Any, inventory, global_batch: int, seq_len: int, layout: cm.Layout,
             counts: Sequence[int] | None = None, options: PlanOptions | None = None) -> Plan | None:
    """Prices one given layout (and uneven counts), as the planner does.

    Returns:
      The `Plan`, or None when the batch does not split over the layout.
    """
    ev = _Evaluator(model, inventory, global_batch, seq_len, options or PlanOptions())
    if counts is None:
        return ev.uniform(layout)
    return ev.uneven(layout, counts, global_batch / sum(counts))


def brute_force(model: Any, inventory, global_batch: int, seq_len: int, options: PlanOptions | None = None,
                max_splits: int = 20000) -> Plan | None:
    """The best fitting plan by exhaustive search (for tests): every mesh, rules, attention,
    microbatches and remat, every per-kind count vector for uneven data parallelism, and every
    stage split (compositions of the layers into ``stage`` parts of at least 1, when there are at
    most ``max_splits`` of them; each also under 1F1B where GPipe does not fit, `_one_f_one_b`)."""
    ev = _Evaluator(model, inventory, global_batch, seq_len, options or PlanOptions())

    def every(layout: cm.Layout, tag: str) -> Iterator[Plan | None]:
        if tag == "uniform":
            yield ev.uniform(layout)
        elif tag == "uneven":
            for counts in _kind_counts(ev, layout):
                yield ev.uneven(layout, counts, global_batch / sum(counts))
        else:
            for split in _compositions(ev.model.num_layers, layout.mesh[ax.STAGE], max_splits):
                gpipe = ev.uniform(dataclasses.replace(layout, stage_layers=split))
                yield gpipe
                if gpipe is not None:
                    yield _one_f_one_b(ev, gpipe)

    return _best_fitting(plan_ for layout, tag in _candidates(ev) for remat in ev.options.remats
                         for plan_ in every(dataclasses.replace(layout, remat=remat), tag))


def _kind_counts(ev: _Evaluator, layout: cm.Layout) -> Iterator[list[int]]:
    """Every assignment of one count per kind whose total is the batch's microbatches."""
    kinds = [k.name for k in ev.batch_kinds(layout.mesh)]
    names = sorted(set(kinds))
    per = {n: kinds.count(n) for n in names}
    total = layout.batch_split * layout.microbatches

    def rec(i, left):
        if i == len(names) - 1:
            if left % per[names[i]] == 0:
                yield [left // per[names[i]]]
            return
        for c in range(0, left // per[names[i]] + 1):
            for rest in rec(i + 1, left - c * per[names[i]]):
                yield [c] + rest

    for combo in rec(0, total):
        if sum(combo) == 0:
            continue
        by = dict(zip(names, combo))
        yield [by[k] for k in kinds]


def _compositions(total: int, parts: int, limit: int) -> Iterator[tuple[int, ...]]:
    if math.comb(total - 1, parts - 1) > limit:
        return
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0,) + cuts + (total,)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


# --- Reports ----------------------------------------------------------------------------------


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


_REMAT_COST = {"none": 0, "dots": 1, "full": 2}


def _binding(p: Plan) -> dict[str, float]:
    """The slowest device's time as it adds up: ``max(compute, overlapped traffic)``, then the
    exposed traffic, the optimizer and the pipeline bubble."""
    parts = p.parts
    return {"busy": max(parts["compute"], parts["overlapped_comm"]), "exposed_comm": parts["exposed_comm"],
            "optimizer": parts["optimizer"], "bubble": parts["bubble"]}


def why_lost(p: Plan, best: Plan) -> str:
    """A short reason a plan is slower than the best one: the term of the slowest device's time
    that grew most against the best plan's."""
    if not p.fits:
        over = max(p.memory, key=lambda k: p.memory[k] / p.memory_limit[k])
        return f"does not fit: {_gb(p.memory[over])} GB on {over} > {_gb(p.memory_limit[over])} GB usable"
    if p is best:
        return "best"
    mine, theirs = _binding(p), _binding(best)
    name = max(mine, key=lambda k: mine[k] - theirs[k])
    heavier = _REMAT_COST[p.layout.remat] > _REMAT_COST[best.layout.remat]
    even = p.counts is None and p.layout.stage_layers is None
    if name == "busy" and p.parts["overlapped_comm"] > p.parts["compute"]:
        reason = "weight gathers and gradient reductions outlast compute"
    elif name == "busy" and even and (best.counts is not None or best.layout.stage_layers is not None):
        reason = f"the same work on every device: {p.paced_by} paces the step"
    elif name == "busy" and heavier:
        reason = f"remat {p.layout.remat} recomputes the forward pass to fit memory"
    elif name == "busy":
        reason = f"{p.paced_by} gets more work than its speed warrants"
    else:
        reason = {
            "exposed_comm": "tensor/pipeline traffic on the critical path",
            "optimizer": "larger optimizer shard",
            "bubble": (f"1F1B lockstep ticks and bubble {p.parts['bubble'] / p.step_time:.0%}"
                       if p.layout.one_f_one_b else f"pipeline bubble {p.parts['bubble'] / p.step_time:.0%}"),
        }[name]
    return f"+{(p.step_time / best.step_time - 1):.0%}: {reason}"


def format_table(plans: Sequence[Plan]) -> list[str]:
    """Rows: rank, mesh, rules, microbatches, remat, attention, shares/stages, step time, tokens/s,
    MFU, memory per kind, why it lost."""
    if not plans:
        return ["no layout found"]
    best = plans[0]
    kinds = list(dict.fromkeys(k for p in plans for k in p.memory))
    header = ["#", "mesh", "rules", "M", "remat", "attn", "shares / stages", "step s", "tokens/s", "MFU"]
    header += [f"GB {k}" for k in kinds] + ["why it lost"]
    rows = [header]
    for i, p in enumerate(plans, 1):
        lay = p.layout
        if p.counts is not None:
            split = "uneven " + _compress(p.counts)
        elif lay.mesh[ax.STAGE] > 1:
            split = "stages " + ",".join(map(str, lay.stage_layers)) + (f" x{lay.pipeline_repeats}" if lay.pipeline_repeats > 1 else "")
            split += " 1f1b" if lay.one_f_one_b else ""
        else:
            split = "even"
        rows.append([str(i), format_mesh(lay.mesh), lay.rules_name, str(lay.microbatches), lay.remat, lay.attention,
                     split, f"{p.step_time:.3f}", f"{p.tokens_per_second:,.0f}", f"{p.mfu:.1%}"]
                    + [_gb(p.memory[k]) if k in p.memory else "-" for k in kinds] + [why_lost(p, best)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return lines


def _compress(counts: Sequence[int]) -> str:
    """``3,3,3,3,1,1,1,1`` -> ``3x4,1x4``."""
    out = []
    for value, group in itertools.groupby(counts):
        n = len(list(group))
        out.append(f"{value}x{n}" if n > 1 else str(value))
    return ",".join(out)


def no_plan_reason(model: Any, inventory, global_batch: int, seq_len: int,
                   options: PlanOptions | None = None) -> str:
    """Why `plan` returned no plan, in one line that names a value that works where one is knowable.

    Args:
      model, inventory, global_batch, seq_len, options: As for `plan`.

    Returns:
      The reason: the batch does not divide over the data-parallel devices (``data`` x ``fsdp``) of any
      mesh the search allows (naming the smallest larger ``--batch`` that does), or a generic hint.

    Raises:
      ValueError: As `plan` (hosts of unequal size, unknown device figures).
    """
    options = options or PlanOptions()
    ev = _Evaluator(model, inventory, global_batch, seq_len, options)
    splits = sorted({m[ax.DATA] * m[ax.FSDP] for m in _meshes(ev.model, ev.cluster, options)})
    if splits and not any(True for _ in _candidates(ev)):
        for batch in range(global_batch + 1, global_batch + 2 * max(splits) * max(options.max_microbatches, 1) + 1):
            if any(True for _ in _candidates(_Evaluator(model, inventory, batch, seq_len, options))):
                shown = ", ".join(str(n) for n in splits)
                return (f"--batch {global_batch} does not divide over the data-parallel devices of any layout "
                        f"(data x fsdp is {shown} on this cluster, with enough rows per device for each pipeline's "
                        f"microbatches); try --batch {batch}")
    return f"no layout fits --batch {global_batch} --seq-len {seq_len}; try a smaller --batch or --seq-len"
