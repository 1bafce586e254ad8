"""Human-readable reports: the start-up summary, the ``--dry-run`` analysis and the closing lines."""

from __future__ import annotations

import math
import sys
import time

import jax
import numpy as np

from sharding import hlo
from sharding.mesh import crossing_axes, format_mesh


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def human_count(n: float) -> str:
    """``6738415616`` -> ``'6.74B'``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def startup_lines(config, preset: str, mesh, rules, report, num_params_built: int) -> list[str]:
    """The summary printed before training or a dry run."""
    lines = [
        f"model {preset}: {num_params_built:,} parameters ({human_count(num_params_built)}; "
        f"formula {config.num_params:,}), dtype {config.dtype}, remat {config.remat}, attention {config.attention}",
        f"mesh {format_mesh(dict(mesh.shape))} over {mesh.devices.size} {jax.devices()[0].platform} devices"
        f" in {jax.process_count()} process(es)",
        f"rules {rules.name}: " + ", ".join(f"{k}->{'+'.join(v) or 'none'}" for k, v in rules.table),
    ]
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
    peak = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
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


def state_bytes(abstract_state) -> int:
    """Bytes of all the arrays of a tree (global shapes)."""
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract_state)))


def device_state_bytes(abstract_state) -> int:
    """Bytes one device holds of a tree of `jax.ShapeDtypeStruct` with shardings: each array's shard shape
    (`jax.sharding.Sharding.shard_shape`, the largest shard where a split is uneven)."""
    return int(sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(abstract_state)))


# Pipeline ---------------------------------------------------------------------------


def stage_memory(trainer) -> dict:
    """Per-device parameter bytes of a pipelined trainer, split by stage.

    Every device holds the same arrays (one SPMD program): the non-layer
    parameters' shards and ``slots`` layer slots of ``slot_bytes`` each. Of
    those, stage ``s`` fills ``stage_layers[s]`` (its share) and leaves the
    rest empty (its padding).

    Returns:
      ``{"slot_bytes", "other_bytes", "stages": [(layers, share_bytes, padding_bytes), ...],
      "device_bytes"}``: bytes per device of one slot (all layer parameters
      of one layer), of the non-layer parameters, per stage, and in all
      (``other + slots * slot_bytes``, the same on every device). Parameters
      only: AdamW's two moments add twice as much again, laid out alike.
    """
    layout = trainer.layout
    slot_bytes = other = 0
    leaves = jax.tree_util.tree_leaves_with_path(trainer.state_params)
    shardings = jax.tree.leaves(trainer.param_shardings)
    for (path, leaf), sharding in zip(leaves, shardings, strict=True):
        local = sharding.shard_shape(leaf.shape)
        itemsize = np.dtype(leaf.dtype).itemsize
        if str(getattr(path[0], "key", "")) == "layers":
            slot_bytes += math.prod(local[2:]) * itemsize  # [1, slots, ...] on each device
        else:
            other += math.prod(local) * itemsize
    stages = [(n, n * slot_bytes, pad * slot_bytes) for n, pad in zip(layout.stage_layers, layout.padding)]
    return {"slot_bytes": slot_bytes, "other_bytes": other, "stages": stages,
            "device_bytes": other + layout.slots * slot_bytes}


def weight_gather_line(trainer) -> str:
    """Where the pipeline gathers the layer weights and reduces their gradients, with the gathered bytes."""
    layout = trainer.par.pipeline.layout
    itemsize = jax.numpy.dtype(trainer.config.dtype).itemsize
    per_layer = sum(x.size // x.shape[0] * itemsize for x in jax.tree.leaves(trainer.abstract_params["layers"]))
    return (f"  weights: each device all-gathers its stage's {layout.slots} slots over data/fsdp once per step, "
            f"before the pipeline loop, in {trainer.config.dtype} ({layout.slots} x {human_bytes(per_layer)} = "
            f"{human_bytes(layout.slots * per_layer)} per device, / tensor where the rules split over it); "
            f"layer gradients are summed on each device over the microbatches and reduce-scattered once, after "
            f"the backward loop")


def schedule_memory_line(plan) -> str:
    """How many microbatches' layer inputs each stage keeps for its backward pass, and what 1F1B costs in time."""
    from sharding.pipeline import one_f_one_b_ticks

    layout = plan.layout
    s, k = layout.stages, layout.chunk_slots
    if not plan.one_f_one_b:
        return (f"  saved for the backward pass: every slot's input of all {plan.steps} steps ({plan.steps} x {k} "
                f"microbatch activations per device; --pipeline-schedule 1f1b keeps {s} x {k})")
    ticks = one_f_one_b_ticks(s, plan.microbatches, layout.repeats)
    chunk = "microbatches" if layout.repeats == 1 else "chunk inputs"
    return (f"  saved for the backward pass: a ring of {ticks.slots} {chunk} x {k} slot inputs per device (the "
            f"other schedules keep {plan.steps} x {k}); one loop of {ticks.ticks} ticks, each a chunk's forward, "
            f"backward or idle per stage; the loss runs on stage {s - 1} inside it; in lockstep a tick lasts a "
            f"backward, so the pass takes about {ticks.ticks} chunk backward-times against {plan.steps} chunk "
            f"forward+backward-times for GPipe or circular")


def pipeline_lines(trainer, note: str | None = None) -> list[str]:
    """The pipeline plan: schedule, bubble fraction, layers, slots and padded bytes per stage."""
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
    lines.append(
        f"pipeline: {schedule} over stage={s}, {m} microbatches of {trainer.config.num_layers} layers; bubble "
        f"(S-1)/(R*M+S-1) = {s - 1}/{r * m + s - 1} = {plan.bubble_fraction:.1%} of {plan.steps} steps"
    )
    lines.append(schedule_memory_line(plan))
    memory = stage_memory(trainer)
    rows = [("stage", "layers", "canonical layers", "slots used/held", "layer params/device", "padding/device",
             "layer applications (fwd)")]
    applications = plan.layer_applications()
    for stage, (n, share, pad) in enumerate(memory["stages"]):
        ranges = " ".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in layout.stage_ranges(stage))
        per_chunk = "" if r == 1 else " (" + "+".join(str(row[stage]) for row in layout.chunks) + ")"
        rows.append((str(stage), f"{n}{per_chunk}", ranges, f"{n}/{layout.slots}", human_bytes(share),
                     human_bytes(pad), str(applications[stage])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    padded = sum(layout.padding)
    lines.append(
        f"  every device holds {layout.slots} slots of {human_bytes(memory['slot_bytes'])} (one layer's parameters) "
        f"+ {human_bytes(memory['other_bytes'])} of other parameters = {human_bytes(memory['device_bytes'])}; "
        f"x3 with the AdamW moments"
    )
    if padded:
        lines.append(
            f"  {padded} empty slot(s) pad the stages with fewer layers to {layout.slots}: parameters, optimizer "
            f"state and saved activations are allocated for them; "
            + ("they are not computed (skipped by a conditional)" if plan.skip_empty else
               "they ARE computed here (fallback: a collective inside a slot could wait on other stages)")
        )
    lines.append(weight_gather_line(trainer))
    head = ("embedding replicated over stage; final norm, output projection and loss run on the last stage "
            "inside the pipeline, one microbatch at a time" if plan.one_f_one_b else
            "embedding, final norm and output projection are replicated over stage")
    lines.append(f"  layer parameters laid out [stage, slot, ...], sharded over stage (rule layers->stage); {head}")
    return lines


def branch_lines(compiled, trainer) -> list[str]:
    """Collectives inside the pipeline's skipped-slot branches of a compiled step (they must stay in one stage)."""
    from sharding.hlo import branch_collectives

    if trainer.par.pipeline is None:
        return []
    found = branch_collectives(compiled.as_text(), trainer.mesh)
    if not trainer.par.pipeline.skip_empty:
        return ["pipeline: every slot is computed (no conditional branches)"]
    unsafe = [c for c in found if not c.safe]
    kinds = ", ".join(f"{op} x{n}" for op, n in sorted(_count(c.op for c in found).items())) or "none"
    status = "all among devices of one stage" if not unsafe else f"{len(unsafe)} COULD WAIT ON OTHER STAGES"
    return [f"collectives inside skipped-slot branches: {kinds}; {status} (the counts above include them on every "
            f"trip, also where a stage skips the slot)"]


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
    from sharding.vocab import choose_for_batch, output_traffic, tokens_per_device, vocab_split

    par, model = run.parallelism, run.model
    rows, shape = run.microbatch_rows, (run.microbatch_rows, run.data.seq_len)
    split = choose_for_batch(model.logits, par.rules, par.mesh_shape, model.vocab_size, model.embed_dim, shape)
    candidate, _ = vocab_split(par.rules, par.mesh_shape, model.vocab_size, model.embed_dim, rows)
    if candidate is None or model.tie_embeddings:
        return f"logits: {'vocab_parallel' if split else 'gathered'} (--logits {model.logits})"
    tokens = tokens_per_device(par.rules, par.mesh_shape, shape)
    gathered, parallel = output_traffic(candidate, model.vocab_size, model.embed_dim, tokens)
    return (f"logits: {'vocab_parallel' if split else 'gathered'} (--logits {model.logits}; per device and "
            f"microbatch the loss moves {gathered / 2**20:.1f} MiB gathered, {parallel / 2**20:.1f} MiB "
            f"vocab_parallel)")


def _split_note(trainer) -> str | None:
    """How the layers were split when the split is the default one and uneven."""
    from sharding.pipeline import plan_layout

    plan = trainer.par.pipeline
    if plan is None:
        return None
    layout, note = plan_layout(trainer.config.num_layers, plan.layout.stages, plan.layout.repeats)
    return note if layout == plan.layout else None


def startup(run, trainer, speeds=None, notes=()) -> list[str]:
    """Every line printed before training or a dry run."""
    from sharding.mesh import format_mesh
    from sharding.parallel import UnevenBatch
    from train.strategies import describe_uneven

    lines = []
    par, model = trainer.par, run.model
    if model.attention in ("ring", "ulysses") and par.length_shards == 1:
        lines.append(f"note: --attention {model.attention} with the length whole on every device (no sequence axis "
                     f"> 1 in --mesh {format_mesh(par.mesh_shape)}) is plain flash attention: no context parallelism")
    if isinstance(par.strategy, UnevenBatch):
        lines.append(describe_uneven(par.strategy.counts, run.data.batch_size // par.strategy.total, speeds,
                                     trainer.strategy.capacity))
    built = sum(x.size for x in jax.tree.leaves(trainer.abstract_params))
    lines += startup_lines(model, run.preset, trainer.mesh, trainer.rules, trainer.report, built)
    lines.append(logits_line(run))
    lines += [f"note: {note}" for note in notes]
    lines += pipeline_lines(trainer, _split_note(trainer))
    return lines


def dry_run(run, trainer, log, watch=None) -> int:
    """Compiles one step from abstract shapes and prints the sharding, memory and collectives and whether
    the step fits the device's memory (`train.fit`); returns 0, or 2 when it does not fit (closing the
    process watch, if any, when done)."""
    batch, seq_len = run.data.batch_size, run.data.seq_len
    for line in parameter_table(trainer.report, trainer.mesh):
        log(line)
    t0 = time.perf_counter()
    compiled = trainer.compile_train_step(batch, seq_len)
    log(f"compiled one train step (batch {batch} x {seq_len}) in {time.perf_counter() - t0:.1f} s")
    for line in memory_lines(compiled, trainer.abstract_state(), trainer.mesh.devices.size):
        log(line)
    for line in collective_lines(compiled) + branch_lines(compiled, trainer):
        log(line)
    if watch is not None:
        watch.close()
    from train.fit import check_compiled

    try:
        log(check_compiled(run, compiled))
    except ValueError as e:
        log(f"fit: DOES NOT FIT: {e}")
        return 2
    return 0


def layout_text(meta) -> str:
    """A checkpoint's stage layout in words (``[layers, ...] (no pipeline)`` for the canonical one)."""
    from sharding.pipeline import StageLayout

    layout = StageLayout.from_meta(meta)
    return "[layers, ...] (no pipeline)" if layout is None else layout.describe()


def resume_lines(run, trainer, meta, step: int, seconds: float) -> list[str]:
    """What a resume restored: the step and meshes, a re-laid stage layout, a changed learning-rate schedule,
    an ``--init-from`` left unread."""
    lines = [f"resumed step {step} (saved on mesh {format_mesh(meta.mesh)}) onto mesh "
             f"{format_mesh(trainer.par.mesh_shape)} in {seconds:.1f} s"]
    if meta.pipeline != trainer.layout_meta():
        lines.append(f"re-laid the layer stacks from stage layout {layout_text(meta.pipeline)} to "
                     f"{layout_text(trainer.layout_meta())}")
    change = meta.schedule_change(run.schedule, step)
    if change:
        lines.append(change)
    if run.checkpoint.init_from:
        lines.append(f"note: resuming the checkpoint of step {step}, so --init-from {run.checkpoint.init_from} "
                     "is not read (the checkpoint wins)")
    return lines


def summary_lines(summary: dict, directory, waited: float) -> list[str]:
    """The closing lines: where the last checkpoint is, why the run stopped, the held-out losses."""
    where = directory / str(summary["step"])
    if summary["step"] == summary["start_step"]:
        lines = [f"the latest checkpoint is still step {summary['step']} in {where}"]
    elif summary["stopped_by"]:
        lines = [f"stopped by {summary['stopped_by']}: the checkpoint of step {summary['step']} is complete in {where} "
                 f"(saved in {waited:.1f} s); continue with --resume"]
    else:
        lines = [f"checkpoint of step {summary['step']} complete in {where} (waited {waited:.1f} s)"]
    if summary["eval"]:
        first, last = summary["eval"][0][1], summary["eval"][-1][1]
        lines.append(f"held-out loss {first:.4f} -> {last:.4f} over steps {summary['eval'][0][0]}-"
                     f"{summary['eval'][-1][0]}")
    return lines
