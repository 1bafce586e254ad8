"""Does the run fit? Checked twice before the first step.

1. `check_estimate`, before anything is built: the state (float32 parameters and AdamW's two float32
   moments, from the model's description, `models.spec.describe`) split evenly over every device, plus
   the batch's rows, must fit one device. This is a lower bound (no activations, perfect sharding), so
   it refuses only what cannot fit under any layout, quickly (``--set vocab_size=1000000000``).
2. `check_compiled`, after compiling the step: ``compiled.memory_analysis()`` per device, peak =
   arguments + outputs - aliased (donated) + temporaries, against the device's memory.

The device's memory is ``--device-memory`` when given, else `sharding.devices.device_memory` (the
allocator's limit, the datasheet, or on CPU the host's available memory shared by the simulated devices).
"""

from __future__ import annotations

import dataclasses

from sharding import axes as ax
from sharding.devices import device_memory
from train.reports.units import human_bytes

# Bytes of state per parameter: float32 parameter + AdamW's two float32 moments (Loshchilov & Hutter, 2019).
STATE_BYTES_PER_PARAM = 4 * 3
# Bytes per token of a host batch: five int32/float32 fields (tokens, targets, positions, segments, mask).
BATCH_BYTES_PER_TOKEN = 5 * 4


def resolve_budget(run, devices):
    """``run`` with ``cluster.device_memory`` (bytes) and its source filled from ``devices`` (this process's)
    unless ``--device-memory`` gave it; measured once, before anything is allocated."""
    cluster = run.cluster
    if cluster.device_memory is not None:
        return run
    import jax

    local = [d for d in devices if getattr(d, "process_index", 0) == jax.process_index()]  # this process's
    limit, source = device_memory(local)
    return run.replace(cluster=dataclasses.replace(cluster, device_memory=limit, device_memory_source=source))


def check_estimate(run) -> None:
    """Refuses a run whose state and batch cannot fit even spread evenly over every device (see the module).

    Raises:
      ValueError: Naming the figure, the memory and what would fit.
    """
    budget, model, par = run.cluster.device_memory, run.model, run.parallelism
    if budget is None:
        return
    params = model.num_params
    state = params * STATE_BYTES_PER_PARAM / par.num_devices
    batch = run.data.batch_size * run.data.seq_len * BATCH_BYTES_PER_TOKEN / par.data_parallel
    if state + batch <= budget:
        return
    # A dry run on this machine usually plans for other devices: their memory is the budget to check against.
    dry = (
        ""
        if run.cluster.device_memory_source == "--device-memory" or not run.loop.dry_run
        else (
            f", or give the memory of the devices this dry run is for, e.g. --device-memory "
            f"{max(80, -(-int(1.25 * (state + batch)) // 2**30))}GiB"
        )
    )
    if state > budget:
        raise ValueError(
            f"the model cannot fit: {params:,} parameters need {human_bytes(state)} of state (float32 parameters + AdamW "
            f"moments) per device even split over all {par.num_devices} devices, more than the {human_bytes(budget)} of "
            f"{run.cluster.device_memory_source}; use a smaller model (--model, --set vocab_size/embed_dim/"
            f"num_layers) or more devices{dry}"
        )
    raise ValueError(
        f"--batch-size {run.data.batch_size} x --seq-len {run.data.seq_len} needs {human_bytes(batch)} of "
        f"batch per device, more than the {human_bytes(budget)} of {run.cluster.device_memory_source}; "
        f"use a smaller --batch-size{dry}"
    )


def step_peak(compiled) -> int | None:
    """Per-device peak bytes of a compiled step: arguments + outputs - aliased + temporaries (None: unknown)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(
        stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
    )


def check_compiled(run, compiled) -> str:
    """The verdict on the compiled step's peak against the device's memory (one line).

    Raises:
      ValueError: When the peak exceeds the memory, naming both figures and the remedies that apply.
    """
    return check_peak(
        step_peak(compiled),
        run.cluster.device_memory,
        run.cluster.device_memory_source,
        ("the step", "the train step"),
        "compiled memory_analysis: arguments + outputs - aliased + temporaries",
        f"try {remedies(run)}",
    )


def check_peak(
    peak: int | None, budget: int | None, source: str, what: tuple[str, str], basis: str, remedy: str
) -> str:
    """The one fit verdict of every entry point (training's step, evaluation's loss, generation's cache): a
    per-device peak (bytes) against the device's memory (bytes, from ``source``).

    Args:
      what: ``(short, long)`` names of what is measured (``("the step", "the train step")``).
      basis: how ``peak`` was found (compiled memory analysis, an estimate).
      remedy: what lowers it, in flags the command accepts.

    Returns:
      One line: ``fit: ...`` (fits, or not checked and why).

    Raises:
      ValueError: The peak exceeds the memory, naming both figures, ``basis`` and ``remedy``.
    """
    if peak is None or budget is None:
        return f"fit: not checked ({'no memory analysis on this backend' if peak is None else source})"
    if peak <= budget:
        return f"fit: {what[0]}'s peak {human_bytes(peak)} per device fits the {human_bytes(budget)} of {source} ({peak / budget:.0%})"
    raise ValueError(
        f"{what[1]} cannot fit: its peak is {human_bytes(peak)} per device ({basis}), more than the "
        f"{human_bytes(budget)} of {source}; {remedy}"
    )


def remedies(run) -> str:
    """What lowers the step's peak, given the flags in use (never the values already in use)."""
    par, data, model = run.parallelism, run.data, run.model
    found = []
    if model.remat != "full":
        found.append("--remat full")
    n, fsdp = par.num_devices, par.mesh_shape.get(ax.FSDP, 1)
    if fsdp < n:
        found.append(f"more fsdp (e.g. --mesh fsdp={n})")
    rows = run.microbatch_rows
    m = par.pipeline.microbatches if par.pipeline is not None else par.strategy.microbatches  # --microbatches
    if rows % 2 == 0 and rows // 2 >= par.data_parallel:
        found.append(f"--microbatches {m * 2}")
    if data.batch_size // 2 >= par.data_parallel * m:
        found.append(f"a smaller --batch-size (e.g. {data.batch_size // 2})")
    return ", ".join(found) if found else "more devices or a smaller model"
