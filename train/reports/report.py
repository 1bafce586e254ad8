"""Human-readable reports: the start-up summary, the ``--dry-run`` analysis and the closing lines."""

from __future__ import annotations

import math
import sys
import time

import jax
import numpy as np

from models import attention_registry
from models.moe import layer_placement
from sharding import axes as ax
from sharding import hlo
from sharding.dispatch import LOCAL, ExpertDispatch
from sharding.expert_placement import ExpertPlacement
from sharding.hlo import branch_collectives
from sharding.mesh import crossing_axes, format_mesh
from sharding.parallel import spec_axes, spec_entry
from sharding.pipeline import head_parallelism, plan_layout
from sharding.pipeline.layout import Schedule
from sharding.pipeline.storage import feature_devices, layout_from_meta
from sharding.vocab import choose_for_batch, output_traffic, tokens_per_device, vocab_split
from sharding.zero import not_split_lines, split_line
from train.reports.fit import check_compiled, step_peak
from train.reports.predicted import cost_model_lines, cpu_only_bytes
from train.reports.units import human_bytes, human_count
from train.setup import strategy_setup
from train.setup.flagnames import render


def startup_lines(
    config, preset: str, mesh, rules, report, num_params_built: int, placement: ExpertPlacement | None = None
) -> list[str]:
    """The summary printed before training or a dry run; ``placement`` is the mixture of experts' layer's
    (`expert_placement_of`; None: local, no expert parallelism), whose phrase names its collectives."""
    lines = [
        f"model {preset}: {num_params_built:,} parameters ({human_count(num_params_built)}; "
        f"formula {config.num_params:,}), dtype {config.dtype}, remat {config.remat}, attention {config.attention}",
        f"mesh {format_mesh(dict(mesh.shape))} over {mesh.devices.size} {jax.devices()[0].platform} devices"
        f" in {jax.process_count()} process(es)",
        f"rules {rules.name}: " + ", ".join(f"{k}->{'+'.join(v) or 'none'}" for k, v in rules.table),
    ]
    if config.is_moe:
        split = dict(mesh.shape).get(ax.EXPERT, 1)
        active = config.describe().num_active_params
        lines.append(
            f"mixture of experts: {config.num_moe_layers} of {config.num_layers} layers, {config.num_experts} experts "
            f"(top-{config.experts_per_token}), {config.num_experts // split} per device over expert={split}; "
            f"{active:,} active parameters per token ({human_count(active)}); dispatch: "
            + (LOCAL if placement is None else placement).describe(config.capacity_factor)
        )
    crossing = crossing_axes(mesh)
    if crossing:
        lines.append("axes crossing processes: " + ", ".join(f"{a} (over {n})" for a, n in crossing.items()))
    lines.append(report.format_replicated())
    return lines


def parameter_table(report, mesh) -> list[str]:
    """Per parameter: shape, logical names, partition spec, per-device shard shape."""
    rows = [("parameter", "shape", "logical axes", "sharding", "per device")]
    for path, shape, _, names, spec, _ in report.rows:
        local = list(shape)
        for dim, entry in enumerate(spec):
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                local[dim] //= mesh.shape[axis]
        rows.append((path, str(tuple(shape)), ",".join(n or "-" for n in names), str(tuple(spec)), str(tuple(local))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def memory_lines(compiled, abstract_state, num_devices: int) -> list[str]:
    """Per-device bytes from ``compiled.memory_analysis()``, and the state's bytes on one device as its
    shardings lay it out (the largest shard of each array) beside the ideal share (all / devices)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return ["memory analysis: not available on this backend"]
    fields = (
        ("arguments (state + batch)", "argument_size_in_bytes"),
        ("outputs", "output_size_in_bytes"),
        ("aliased (donated state)", "alias_size_in_bytes"),
        ("temporaries", "temp_size_in_bytes"),
        ("generated code", "generated_code_size_in_bytes"),
    )
    lines = ["per-device memory (compiled.memory_analysis()):"]
    for label, attr in fields:
        lines.append(f"  {label:<28} {human_bytes(getattr(stats, attr, 0) or 0)}")
    peak = (
        stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
    )
    lines.append(f"  {'peak estimate':<28} {human_bytes(peak)}")
    total, held = state_bytes(abstract_state), device_state_bytes(abstract_state)
    lines.append(
        f"  state (params + optimizer) in all: {human_bytes(total)}; per device as sharded: {human_bytes(held)} "
        f"(ideal /{num_devices} devices: {human_bytes(total / num_devices)}"
        + (f"; {held / (total / num_devices):.1f}x, replicated arrays)" if held > 1.01 * total / num_devices else ")")
    )
    return lines


def collective_lines(compiled) -> list[str]:
    """Collectives of the compiled step: count and bytes per step, per device."""
    found = hlo.collectives(compiled.as_text())
    if not found:
        return ["collectives in the compiled step: none"]
    lines = ["collectives in the compiled step (per device, loop trips counted):"]
    for op, (count, nbytes) in hlo.summarize(found).items():
        lines.append(f"  {op:<20} {count:>6} per step  {human_bytes(nbytes):>12} per step")
    return lines


def compute_lines(compiled) -> list[str]:
    """FLOPs per device of the compiled step: matrix products with loop trips counted, those outside
    conditional branches apart from those inside (`sharding.hlo.dot_flops_split`; the branches' figure
    counts every branch on every trip, an upper bound: a pipeline stage skips its empty slots and bubble
    steps, and a 1F1B tick runs a forward or a backward, not both), and XLA's ``cost_analysis()`` (each
    loop body once)."""
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis

    def flop(n: float) -> str:
        return f"{n / 1e12:.2f} TFLOP" if n >= 1e11 else f"{n / 1e9:.3f} GFLOP"

    outside, inside = hlo.dot_flops_split(compiled.as_text())
    lines = [
        f"compute per device per step: {flop(outside)} in matrix products outside conditionals (loop trips "
        f"counted); cost_analysis {flop(float(analysis.get('flops', 0.0)))} (loop bodies once)"
    ]
    if inside:
        lines.append(
            f"  conditional branches: at most {flop(inside)} more (every branch counted on every trip; "
            f"which run is decided at run time)"
        )
    return lines


def state_bytes(abstract_state) -> int:
    """Bytes of all the arrays of a tree (global shapes)."""
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract_state)))


def device_state_bytes(abstract_state) -> int:
    """Bytes one device holds of a tree of `jax.ShapeDtypeStruct` with shardings: each array's shard shape
    (`jax.sharding.Sharding.shard_shape`, the largest shard where a split is uneven)."""
    return int(
        sum(
            math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(abstract_state)
        )
    )


# Pipeline ---------------------------------------------------------------------------


def stage_memory(trainer) -> dict:
    """Per-device parameter bytes of a pipelined trainer (unpadded storage, `sharding.pipeline.storage`).

    Every device holds the same arrays (one SPMD program): the non-layer parameters' shards and
    ``per_device`` rows of the layer stack (``rows`` in all: the model's layers and fewer than one empty
    row per device), whatever its stage's layer count. Parameters only: AdamW's two moments add twice as
    much again, laid out alike.

    Returns:
      ``{"row_bytes", "per_device", "empty_rows", "other_bytes", "device_bytes", "ideal_bytes"}``: bytes per
      device of one stored row (all layer parameters of one layer, as split on the device), rows per device,
      empty rows in all, bytes of the non-layer parameters per device, in all per device (``other +
      per_device * row_bytes``), and the ideal: all parameters over all devices.
    """
    state = trainer.state_layout
    storage = state.storage
    row_bytes = other = 0
    leaves = jax.tree_util.tree_leaves_with_path(state.state_params)
    shardings = jax.tree.leaves(state.param_shardings)
    for (path, leaf), sharding in zip(leaves, shardings, strict=True):
        local = sharding.shard_shape(leaf.shape)
        itemsize = np.dtype(leaf.dtype).itemsize
        if str(getattr(path[0], "key", "")) == "layers":
            row_bytes += math.prod(local[1:]) * itemsize  # [per_device, ...] on each device
        else:
            other += math.prod(local) * itemsize
    ideal = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state.abstract_params))
    return {
        "row_bytes": row_bytes,
        "per_device": storage.per_device,
        "empty_rows": storage.rows - storage.num_layers,
        "other_bytes": other,
        "device_bytes": other + storage.per_device * row_bytes,
        "ideal_bytes": ideal / trainer.mesh.devices.size,
    }


def weight_gather_line(trainer) -> str:
    """Where the pipeline gathers the layer weights and reduces their gradients, with the gathered bytes."""
    layout, storage = trainer.par.pipeline.layout, trainer.state_layout.storage
    itemsize = jax.numpy.dtype(trainer.config.dtype).itemsize
    layers = jax.tree.leaves(trainer.state_layout.abstract_params["layers"])
    per_layer = sum(x.size // x.shape[0] * itemsize for x in layers)
    most = max(layout.stage_layers)
    moved = storage.placement.received
    over = f"receives {moved} row(s) of its stage stored on another stage's devices (ppermute), then " if moved else ""
    if trainer.par.pipeline.gather == "microbatch":
        again = (
            "in the input-gradient and again in the weight-gradient pass"
            if trainer.par.pipeline.schedule is Schedule.ZERO_BUBBLE
            else "backward"
        )
        names = jax.tree.leaves(trainer.state_layout.param_names["layers"], is_leaf=lambda x: isinstance(x, tuple))
        if feature_devices(names, trainer.par.rules, trainer.par.mesh_shape) == 1:
            return (
                f"  weights (--pipeline-gather microbatch): each device {over}takes one layer at a time from the "
                f"rows it stores, where a chunk pass runs it, forward and again {again}: no layer parameter is "
                f"split over a batch axis of this mesh, so there is nothing to all-gather "
                f"({human_bytes(per_layer)} per layer, / tensor where the rules split over it; --pipeline-gather "
                f"once copies {most} x {human_bytes(per_layer)} into a working copy and holds their float32 "
                f"gradient sums through the step instead)"
            )
        # rows over stage alone, each row's features split over the stage's devices (`storage_axes`)
        return (
            f"  weights (--pipeline-gather microbatch): each device {over}all-gathers one layer at a time over "
            f"the batch axes its features are split over, in {trainer.config.dtype}, where a chunk pass runs it, "
            f"forward and again {again} ({human_bytes(per_layer)} per device at a time, / tensor where the rules "
            f"split over it); each layer's gradient is reduce-scattered into float32 sums of the device's share "
            f"of its rows as the layer finishes (--pipeline-gather once holds {most} x {human_bytes(per_layer)} "
            f"and their float32 gradient sums through the step instead)"
        )
    if storage.groups == 1:  # each stage's rows whole on each of its devices: nothing to all-gather
        return (
            f"  weights (--pipeline-gather once): each device {over}copies its stage's rows, which it holds whole "
            f"(no batch axis of this mesh splits them, so there is nothing to all-gather), once per step, before "
            f"the pipeline loop, in {trainer.config.dtype}, into a [{layout.repeats}, {layout.chunk_slots}, ...] "
            f"working copy (empty slots only there; at most {most} x {human_bytes(per_layer)} = "
            f"{human_bytes(most * per_layer)} per device, / tensor where the rules split over it); layer gradients "
            f"are summed on each device over the microbatches and added into the rows once, after the backward loop"
        )
    return (
        f"  weights (--pipeline-gather once): each device {over}all-gathers its stage's rows over the storage's "
        f"batch axes once per "
        f"step, before the pipeline loop, in {trainer.config.dtype}, into a [{layout.repeats}, "
        f"{layout.chunk_slots}, ...] working copy (empty slots only there; at most {most} x "
        f"{human_bytes(per_layer)} = {human_bytes(most * per_layer)} per device, / tensor where the rules split "
        f"over it); layer gradients are summed on each device over the microbatches and reduce-scattered back "
        f"into the rows once, after the backward loop"
    )


def schedule_memory_line(plan) -> str:
    """How many microbatches' layer inputs each stage keeps for its backward pass, and what 1F1B costs in time."""
    layout = plan.layout
    s, k = layout.stages, layout.chunk_slots
    if not plan.one_f_one_b:
        return (
            f"  saved for the backward pass: every slot's input of all {plan.steps} steps ({plan.steps} x {k} "
            f"microbatch activations per device; --pipeline-schedule 1f1b keeps {s} x {k})"
        )
    ticks = plan.tick_table()
    chunk = "microbatches" if layout.repeats == 1 else "chunk inputs"
    if plan.schedule is Schedule.ZERO_BUBBLE:
        return (
            f"  saved for the backward pass: a ring of {ticks.slots} microbatches x {k} slot inputs per device "
            f"(the other schedules keep {plan.steps} x {k}) and a ring of {ticks.saved_slots} x {k} slots of what "
            f"each input gradient keeps for its weight gradient (each product's input and output cotangent); one "
            f"loop of {ticks.ticks} ticks, each a forward, an input gradient and a weight gradient per stage (any "
            f"may idle), the input gradient recomputing its layers; the loss runs on stage {s - 1} inside it"
        )
    if plan.schedule is Schedule.FUSED:
        return (
            f"  saved for the backward pass: a ring of {ticks.slots} {chunk} x {k} slot inputs per device (the "
            f"other schedules keep {plan.steps} x {k}); one loop of {ticks.ticks} ticks, each a chunk's forward "
            f"and a chunk's backward per stage (either may idle); the loss runs on stage {s - 1} inside it; a "
            f"tick lasts a forward plus a backward, so the pass takes about {ticks.ticks} chunk "
            f"forward+backward-times against {plan.steps} for GPipe or circular"
        )
    return (
        f"  saved for the backward pass: a ring of {ticks.slots} {chunk} x {k} slot inputs per device (the "
        f"other schedules keep {plan.steps} x {k}); one loop of {ticks.ticks} ticks, each a chunk's forward, "
        f"backward or idle per stage; the loss runs on stage {s - 1} inside it; in lockstep a tick lasts a "
        f"backward, so the pass takes about {ticks.ticks} chunk backward-times against {plan.steps} chunk "
        f"forward+backward-times for GPipe or circular"
    )


def pipeline_lines(trainer, note: str | None = None) -> list[str]:
    """The pipeline plan: schedule, bubble fraction, layers per stage, the unpadded storage's bytes per device."""
    plan = trainer.par.pipeline
    if plan is None:
        return []
    layout = plan.layout
    s, r, m = layout.stages, layout.repeats, plan.microbatches
    lines = []
    if note:
        lines.append(f"note: {note}")
    schedule = "GPipe" if r == 1 else f"circular, {r} repeats (chunks per stage)"
    if plan.one_f_one_b:
        schedule = "1F1B (PipeDream-Flush)" + ("" if r == 1 else f", interleaved, {r} chunks per stage")
        schedule += ", fused ticks (a forward and a backward per tick)" if plan.schedule is Schedule.FUSED else ""
        if plan.schedule is Schedule.ZERO_BUBBLE:
            schedule = "zero bubble (ZB-H1: fused 1F1B ticks, the weight gradient deferred)"
    lines.append(
        f"pipeline: {schedule} over stage={s}, {m} microbatches through {trainer.config.num_layers} layers; bubble "
        f"(S-1)/(R*M+S-1) = {s - 1}/{r * m + s - 1} = {plan.bubble_fraction:.1%} of {plan.steps} steps"
    )
    lines.append(schedule_memory_line(plan))
    memory = stage_memory(trainer)
    rows = [("stage", "layers", "canonical layers", "slots in the working copy", "layer applications (fwd)")]
    applications = plan.layer_applications()
    for stage, n in enumerate(layout.stage_layers):
        ranges = " ".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in layout.stage_ranges(stage))
        per_chunk = "" if r == 1 else " (" + "+".join(str(row[stage]) for row in layout.chunks) + ")"
        rows.append((str(stage), f"{n}{per_chunk}", ranges, f"{n}/{layout.slots}", str(applications[stage])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    storage = trainer.state_layout.storage
    lines.append(
        f"  layer parameters stored unpadded: {storage.rows} rows ({memory['empty_rows']} empty) split over "
        f"stage x {storage.groups} devices; every device holds {memory['per_device']} rows of "
        f"{human_bytes(memory['row_bytes'])} + {human_bytes(memory['other_bytes'])} of other parameters = "
        f"{human_bytes(memory['device_bytes'])} ({memory['device_bytes'] / memory['ideal_bytes']:.2f}x the "
        f"ideal {human_bytes(memory['ideal_bytes'])}, all parameters / devices)"
        + ("; x3 with the AdamW moments" if trainer.optimizer.name == "adamw" else "")
    )
    if sum(layout.padding):
        lines.append(
            f"  the stages with fewer layers than {layout.slots} hold no padding; their working copies' empty slots are "
            + (
                "not computed (skipped by a conditional)"
                if plan.skip_empty
                else "computed here (fallback: a collective inside a slot could wait on other stages)"
            )
        )
    lines.append(weight_gather_line(trainer))
    gathered = "gathered once per step with fsdp; the embedding lookup runs on every stage, on the whole batch"
    if plan.streams_head:
        gathered = (
            "the embedding gathered over fsdp on the first stage at each microbatch's first forward, where it "
            "looks up that microbatch's tokens (no stage inputs of the whole batch held), its gradient "
            "reduce-scattered there at the microbatch's backward, the final norm and output projection gathered over fsdp on the last stage at "
            "each microbatch's head step, their gradients reduce-scattered there (--pipeline-gather microbatch)"
        )
    lines.append(
        "  embedding, final norm and output projection parameters: stored split over stage as well (where a "
        f"dimension allows), {gathered}"
    )
    return lines


def head_line(trainer, batch: int) -> str:
    """Where the pipeline's head (final norm, output projection, loss) runs: on each stage's share of the
    rows (`sharding.pipeline.head_parallelism`), or on every stage when the rows do not divide."""
    par = trainer.par
    if par.pipeline.one_f_one_b:
        return (
            "  final norm, output projection and loss: on the last stage inside the pipeline, one microbatch at "
            "a time (1f1b: the whole batch's logits are never built)"
        )
    axes = spec_axes(spec_entry(head_parallelism(par).spec((ax.BATCH,), (batch,)), 0))
    stages = par.mesh_shape[ax.STAGE]
    if ax.STAGE in axes:
        rows = batch // math.prod(par.mesh_shape[a] for a in axes)
        return (
            f"  final norm, output projection and loss: rows split over {'+'.join(axes)}, {rows} of the batch's "
            f"{batch} per device (1/{stages} of each stage computing them all)"
        )
    split = " x ".join((*par.rules.batch_axes(par.mesh_shape), ax.STAGE))  # the rows' axes, the rules' batch's
    return (
        f"  final norm, output projection and loss: computed by every stage (batch {batch} not divisible by "
        f"{split} = {par.data_parallel * stages})"
    )


def branch_lines(compiled, trainer) -> list[str]:
    """Collectives inside the pipeline's skipped-slot branches of a compiled step (they must stay in one stage)."""
    if trainer.par.pipeline is None:
        return []
    found = branch_collectives(compiled.as_text(), trainer.mesh)
    if not trainer.par.pipeline.skip_empty:
        return ["pipeline: every slot is computed (no conditional branches)"]
    unsafe = [c for c in found if not c.safe]
    kinds = ", ".join(f"{op} x{n}" for op, n in sorted(_count(c.op for c in found).items())) or "none"
    status = "all among devices of one stage" if not unsafe else f"{len(unsafe)} COULD WAIT ON OTHER STAGES"
    return [
        f"collectives inside skipped-slot branches: {kinds}; {status} (the counts above include them on every "
        f"trip, also where a stage skips the slot)"
    ]


def _count(items) -> dict:
    counts: dict = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


# The command line's reports ------------------------------------------------------------------


def logger(is_main: bool):
    """A ``log(line)`` that prints on process 0 only (above the progress bar when there is one)."""

    def log(line: str) -> None:
        if not is_main:
            return
        try:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stdout)
        except ImportError:
            print(line)
        sys.stdout.flush()

    return log


def logits_line(run) -> str:
    """How the output projection and loss run (``--logits``), with the bytes each layout moves."""
    par, model = run.parallelism, run.model
    rows, shape = run.microbatch_rows, (run.microbatch_rows, run.data.seq_len)
    split = choose_for_batch(model.logits, par.rules, par.mesh_shape, model.vocab_size, model.embed_dim, shape)
    candidate, _ = vocab_split(par.rules, par.mesh_shape, model.vocab_size, model.embed_dim, rows)
    if candidate is None or model.tie_embeddings:
        return f"logits: {'vocab_parallel' if split else 'gathered'} (--logits {model.logits})"
    tokens = tokens_per_device(par.rules, par.mesh_shape, shape)
    gathered, parallel = output_traffic(candidate, model.vocab_size, model.embed_dim, tokens)
    return (
        f"logits: {'vocab_parallel' if split else 'gathered'} (--logits {model.logits}; per device and "
        f"microbatch the loss moves {gathered / 2**20:.1f} MiB gathered, {parallel / 2**20:.1f} MiB "
        f"vocab_parallel)"
    )


def split_note(trainer) -> str | None:
    """How the layers were split when the split is the default one and uneven."""
    plan = trainer.par.pipeline
    if plan is None:
        return None
    layout, note = plan_layout(trainer.config.num_layers, plan.layout.stages, plan.layout.repeats)
    return render(note) if note is not None and layout == plan.layout else None


def expert_dispatch_of(run, par) -> ExpertDispatch:
    """The mixture of experts' dispatch (`sharding.dispatch`) as the model runs it on one microbatch:
    `sharding.dispatch.LOCAL` inside pipeline stages (each stage device runs every expert, as the cost model
    prices it); else `models.moe.layer_dispatch`, which takes the ring where the axes that split the experts
    keep the tokens whole (rules that leave ``expert`` out of the batch's, a batch it does not divide): the
    placement of `sharding.expert_placement.expert_placement`, which the cost model prices too.
    `sharding.dispatch.LOCAL` for a dense model."""
    placement = expert_placement_of(run, par)
    return LOCAL if placement is None else placement.dispatch


def expert_placement_of(run, par) -> ExpertPlacement | None:
    """The mixture of experts' layer placement on one microbatch (`models.moe.layer_placement`), whose
    dispatch is `expert_dispatch_of`'s; None where the layer runs locally (a dense model, pipeline stages, one
    device)."""
    if not run.model.is_moe or par.pipeline is not None:
        return None
    return layer_placement(run.model, par, (run.microbatch_rows, par.positions(run.data.seq_len)))


def startup(run, trainer, speeds=None, notes=()) -> list[str]:
    """Every line printed before training or a dry run."""
    lines = []
    par, model = trainer.par, run.model
    if attention_registry.kernel(model.attention).traits.splits_length and par.length_shards == 1:
        lines.append(
            f"note: --attention {model.attention} with the length whole on every device (no sequence axis "
            f"> 1 in --mesh {format_mesh(par.mesh_shape)}) is plain flash attention: no context parallelism"
        )
    lines += strategy_setup.summary_lines(run, par, speeds)
    built = sum(x.size for x in jax.tree.leaves(trainer.state_layout.abstract_params))
    report = trainer.state_layout.report
    lines += startup_lines(model, run.preset, trainer.mesh, trainer.rules, report, built, expert_placement_of(run, par))
    if par.optimizer_sharding == ax.DATA:  # the state's split over data, then the arrays it leaves whole, by name
        arrays = [(path, shape, spec) for path, shape, _, _, spec, _ in report.rows]
        lines += [split_line(arrays, par.mesh_shape), *not_split_lines(arrays, par.mesh_shape)]
    lines.append(logits_line(run))
    lines += [f"note: {note}" for note in notes]
    if par.pipeline is not None:
        lines += pipeline_lines(trainer, split_note(trainer)) + [head_line(trainer, run.data.batch_size)]
    return lines


def dry_run(run, trainer, log, watch=None) -> int:
    """Compiles one step from abstract shapes and prints the sharding, memory and collectives and whether
    the step fits the device's memory (`train.reports.fit`); returns 0, or 2 when it does not fit (closing the
    process watch, if any, when done)."""
    batch, seq_len = run.data.batch_size, run.data.seq_len
    for line in parameter_table(trainer.state_layout.report, trainer.mesh):
        log(line)
    t0 = time.perf_counter()
    positions = trainer.par.positions(seq_len)  # uneven context shares pad each device's block, as the loop
    compiled = trainer.compile_train_step(batch, positions)
    seconds, earlier = time.perf_counter() - t0, trainer.startup_compile_seconds
    when = (
        f"{seconds:.1f} s"
        if earlier is None
        else f"{earlier:.1f} s (at start-up, above; {seconds:.1f} s here from the cache)"
    )
    log(f"compiled one train step (batch {batch} x {positions}) in {when}")
    for line in memory_lines(compiled, trainer.state_layout.abstract_state(), trainer.mesh.devices.size):
        log(line)
    for line in compute_lines(compiled) + collective_lines(compiled) + branch_lines(compiled, trainer):
        log(line)

    for line in cost_model_lines(trainer, compiled, batch, seq_len):
        log(line)
    if watch is not None:
        watch.close()

    try:
        log(check_compiled(run, compiled))
    except ValueError as e:
        peak, own, budget = step_peak(compiled), cpu_only_bytes(trainer, batch, seq_len), run.cluster.device_memory
        if own and peak - own <= budget:  # the verdict for the devices this dry run is for, not for this CPU
            log(
                f"fit: fits a GPU by the cost model: the peak compiled here, {human_bytes(peak)} per device, less the "
                f"{human_bytes(own)} XLA:CPU allocates for itself (a mixture of experts' grouped products lowered "
                f"densely, float32 copies of bfloat16 activations) is {human_bytes(peak - own)}, within the "
                f"{human_bytes(budget)} of {run.cluster.device_memory_source}; as compiled for this CPU: {e}"
            )
            return 0
        log(f"fit: DOES NOT FIT: {e}")
        return 2
    return 0


def layout_text(meta) -> str:
    """A checkpoint's stage layout in words (``[layers, ...] (no pipeline)`` for the canonical one)."""
    layout = layout_from_meta(meta)
    return "[layers, ...] (no pipeline)" if layout is None else layout.describe()


def resume_lines(run, trainer, meta, step: int, seconds: float) -> list[str]:
    """What a resume restored: the step and meshes, a re-laid stage layout or optimizer sharding, a changed learning-rate schedule
    or batch shape, an ``--init-from`` left unread."""
    lines = [
        f"resumed step {step} (saved on mesh {format_mesh(meta.mesh)}) onto mesh "
        f"{format_mesh(trainer.par.mesh_shape)} in {seconds:.1f} s"
    ]
    if meta.pipeline != trainer.state_layout.layout_meta():
        lines.append(
            f"re-laid the layer stacks from stage layout {layout_text(meta.pipeline)} to "
            f"{layout_text(trainer.state_layout.layout_meta())}"
        )
    if meta.optimizer_sharding != trainer.par.optimizer_sharding:
        lines.append(
            f"re-laid the parameters and optimizer state from --optimizer-sharding {meta.optimizer_sharding} to "
            f"--optimizer-sharding {trainer.par.optimizer_sharding}"
        )
    for change in (
        meta.schedule_change(run.schedule, step),
        meta.batch_change(run.data.seq_len, run.data.batch_size, step),
    ):
        if change:
            lines.append(render(change))
    if meta.base is not None:
        lines.append(
            f"the checkpoint holds the adapters; their frozen base was read from {run.checkpoint.init_from or meta.base['folder']} "
            f"(its weights' sha256 {meta.base['sha256'][:16]}... as recorded)"
        )
    elif run.checkpoint.init_from:
        lines.append(
            f"note: resuming the checkpoint of step {step}, so --init-from {run.checkpoint.init_from} "
            "is not read (the checkpoint wins)"
        )
    return lines


def summary_lines(summary: dict, directory, waited: float) -> list[str]:
    """The closing lines: where the last checkpoint is, why the run stopped, the held-out losses."""
    where = directory / str(summary["step"])
    if summary["step"] == summary["start_step"]:
        lines = [f"the latest checkpoint is still step {summary['step']} in {where}"]
    elif summary["stopped_by"]:
        lines = [
            f"stopped by {summary['stopped_by']}: the checkpoint of step {summary['step']} is complete in {where} "
            f"(saved in {waited:.1f} s); continue with --resume"
        ]
    else:
        lines = [f"checkpoint of step {summary['step']} complete in {where} (waited {waited:.1f} s)"]
    evals = summary["eval"]
    if len(evals) == 1:  # one evaluation (e.g. stopped before the next --eval-every): no "a -> a over steps 0-0"
        lines.append(
            f"held-out loss {evals[0][1]:.4f} at step {evals[0][0]} (evaluated once; --eval-every sets how often)"
        )
    elif evals:
        lines.append(f"held-out loss {evals[0][1]:.4f} -> {evals[-1][1]:.4f} over steps {evals[0][0]}-{evals[-1][0]}")
    return lines
