"""Every check of a run's configuration before any device work, in one place: `validate`.

`train.setup.cli.parse` refuses values that are wrong on their own; `validate` checks the flags against each
other, the devices, the tokenizer and the run folder. Each check raises a one-line ``ValueError`` that
names the flag, its value and one that works.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from checkpoints.meta import RunMeta
from checkpoints.names import META
from checkpoints.verify import saved_steps
from models import attention_registry
from models.attention import check_context_parallel
from models.config import ModelConfig
from models.spec import expert_geometry
from sharding import axes as ax
from sharding.errors import ConfigError, Field
from sharding.mesh import format_mesh
from sharding.modeldesc import ExpertGeometry
from sharding.parallel import Parallelism, UnevenBatch
from sharding.vocab import choose_for_batch
from train.data import check_data_cache, check_source
from train.setup import strategy_setup
from train.setup.config import RunConfig
from train.setup.flagnames import render
from train.setup.folders import check_writable

# Model dimensions the presets split; a mesh axis that cannot split them is a configuration error.
_SPLIT_DIMS = (("embed_dim", "embed"), ("mlp_dim", "mlp"), ("num_heads", "heads"), ("vocab_size", "vocab"))


def validate(run: RunConfig, num_devices: int, tokenizer=None) -> None:
    """Checks ``run`` (its mesh resolved for ``num_devices``) before any device work.

    Args:
      run: The resolved `RunConfig` (`train.setup.config.resolve_mesh`).
      num_devices: The devices JAX sees (all processes).
      tokenizer: The run's tokenizer, checked against the model's vocabulary (None: skipped).

    Raises:
      ValueError: The first failed check, naming the flag, its value and one that works.
    """
    par, model = run.parallelism, run.model
    if par.num_devices != num_devices:
        raise ValueError(f"--mesh needs {par.num_devices} devices, JAX sees {num_devices}")
    if not run.loop.dry_run:
        check_run_dir(run.checkpoint.run_dir, run.checkpoint.resume)
        check_resumed_model(run, tokenizer)  # another model is named as such, not refused for its layout
    check_batch(run)
    check_strategy(run)
    check_model_sharding(model, par)
    check_experts(model, par)
    check_adapters(model, par)

    check_context_parallel(model, par, run.data.seq_len)
    check_logits(run)
    if tokenizer is not None and tokenizer.vocab_size > model.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model.vocab_size}; "
            f"pass --set vocab_size={-(-tokenizer.vocab_size // 128) * 128}"
        )
    check_data(run, tokenizer, read=not run.loop.dry_run)


def optimizer_sharding_note(par: Parallelism) -> str | None:
    """A note when ``--optimizer-sharding data`` has nothing to split over: the ``-1`` axis of ``--mesh`` resolved
    ``data`` to one device (one process of an elastic job after a restart on fewer processes,
    `train.launcher.replan`). The run goes on with the state whole on its one ``data`` rank, as ``replicated``
    keeps it; a ``data`` axis given as 1 is refused before this (`train.setup.layout_flags.check_optimizer_sharding`).

    Args:
      par: The run's `Parallelism`, its mesh resolved.

    Returns:
      The note's line, or None when the state is split (or not asked to be).
    """
    if par.optimizer_sharding != ax.DATA or par.mesh_shape[ax.DATA] > 1:
        return None
    mesh = format_mesh(par.mesh_shape).replace("single device", "data=1")
    return (
        f"note: --mesh resolves to {mesh}, whose data axis is one device, so "
        "--optimizer-sharding data keeps the optimizer state whole (as replicated)"
    )


def check_simulated_devices(mesh_sizes, devices, cpu_devices: int | None) -> None:
    """A ``--mesh`` of fixed sizes that needs more devices than the CPU devices JAX sees, without
    ``--cpu-devices``: the remedy is simulating them (a smaller mesh, what `sharding.mesh.parse_mesh` would
    suggest, is rarely what was meant: e.g. a resume onto another mesh typed without ``--cpu-devices``).

    Args:
      mesh_sizes: Axis -> size, ``-1`` for the axis that takes the remaining devices (not yet resolved).
      devices: The devices JAX sees (all processes).
      cpu_devices: ``--cpu-devices`` (None: not given).

    Raises:
      ValueError: Naming ``--mesh`` and the ``--cpu-devices N`` that makes it fit.
    """
    sizes = list(mesh_sizes.values())
    needed = math.prod(sizes)
    if cpu_devices is not None or -1 in sizes or needed <= len(devices) or devices[0].platform != "cpu":
        return
    raise ValueError(
        f"--mesh {format_mesh(mesh_sizes)} needs {needed} devices, JAX sees {len(devices)} CPU device(s); "
        f"simulate them, e.g. --cpu-devices {needed}"
    )


def device_platform(device) -> str:
    """The platform a device compiles for, as `models.attention_registry.AttentionKernel.platforms` names it:
    ``cuda`` (NVIDIA), ``rocm`` (AMD), or JAX's platform name (``cpu``, ``tpu``)."""
    if device.platform != "gpu":
        return device.platform
    return "rocm" if "rocm" in str(getattr(device.client, "platform_version", "")).lower() else "cuda"


def check_attention_platform(attention: str, devices) -> None:
    """The attention kernel runs on the devices' platform (its record's ``platforms``; cuDNN's on NVIDIA GPUs).

    Raises:
      ValueError: Naming ``--attention``, the platform the devices are, and a kernel that runs there.
    """
    record = attention_registry.kernel(attention)
    found = sorted({device_platform(d) for d in devices})
    if record.platforms and set(found) - set(record.platforms):
        raise ValueError(
            f"--attention {attention} runs on {' or '.join(record.platforms)} devices only, and these are "
            f"{', '.join(found)}; use --attention flash"
        )


def check_run_dir(run_dir: str, resume: bool, can_resume: bool = True) -> None:
    """The run folder is writable and holds no other run's checkpoints unless ``--resume``.

    Args:
      run_dir: ``--run-dir``.
      resume: ``--resume`` was given.
      can_resume: The command has a ``--resume`` to suggest (``python -m train.hf import`` has none).

    Raises:
      ValueError: Naming ``--run-dir`` and what to do.
    """
    folder = Path(run_dir)
    check_writable(folder, "--run-dir")
    ckpt_dir = folder / "checkpoints"
    saved = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) if ckpt_dir.is_dir() else []
    if saved and not resume:
        remedy = "pass --resume to continue that run, or choose" if can_resume else "choose"
        raise ValueError(
            f"--run-dir {folder} already holds checkpoints (latest step {saved[-1]}); {remedy} another --run-dir "
            f"(nothing was overwritten)"
        )


def check_resumed_model(run: RunConfig, tokenizer) -> None:
    """With ``--resume``, the run's model against the checkpoint it continues, before the checks of the layout:
    a ``--model`` other than the run's is refused as a different model (`checkpoints.meta.RunMeta.check_compatible`,
    naming the model to resume with), not for a mesh or strategy that only the other model refuses.

    The step is ``--resume-step`` or the newest saved; its metadata is read as JSON without opening the
    checkpoint. A step whose metadata does not read is left to the resume itself, which chooses the newest step
    that verifies and names the damaged ones (`checkpoints.manager.open_resumable`), then checks that one again.

    Raises:
      sharding.errors.ConfigError: As `checkpoints.meta.RunMeta.check_compatible`.
    """
    if not run.checkpoint.resume:
        return
    directory = Path(run.checkpoint.run_dir) / "checkpoints"
    steps = saved_steps(directory)
    step = run.checkpoint.resume_step if run.checkpoint.resume_step is not None else (steps[-1] if steps else None)
    if step is None:
        return
    try:
        saved = json.loads((directory / str(step) / META / "metadata").read_text())
    except (OSError, ValueError):
        return
    if isinstance(saved, dict):
        RunMeta.from_json(saved).check_compatible(run.model, tokenizer, step)


def check_data(run: RunConfig, tokenizer, read: bool = True) -> None:
    """``--eod-token`` applies; with ``read``, the corpus is there and is text and the token cache is writable.

    Raises:
      ValueError: Naming ``--data``, ``--data-cache`` or ``--eod-token`` and what to do.
      FileNotFoundError: A ``--data`` path that does not exist.
    """
    data = run.data
    if data.eod_token is not None and getattr(tokenizer, "name", None) == "bytes":
        raise ValueError(
            f"--eod-token {data.eod_token}: applies to a --tokenizer FILE only; the bytes tokenizer "
            f"ends documents with its own token 256, so drop --eod-token"
        )
    if not read:
        return
    check_source(
        data.spec, tokenizer, data.text_field
    )  # a missing, empty, binary or mismatched corpus fails before device work
    check_data_cache(data.cache_dir)


def _mesh_flag(par: Parallelism) -> str:
    return format_mesh(par.mesh_shape)


def _good_batch(value: int, multiple: int) -> int:
    """The multiple of ``multiple`` nearest ``value`` (at least ``multiple``)."""
    return multiple * max(1, round(value / multiple))


def check_batch(run: RunConfig) -> None:
    """Batch and length divisibility against the mesh and the strategy's microbatches.

    Raises:
      ValueError: A ``--batch-size`` the strategy cannot split (`train.setup.strategy_setup.check_run_batch`: e.g. one
        that ``--microbatches`` or data x fsdp does not divide), or a ``--seq-len`` the ``context`` x
        ``sequence`` axes do not divide.
    """
    par, seq_len = run.parallelism, run.data.seq_len
    strategy_setup.check_run_batch(run)
    shards = par.length_shards
    if seq_len % shards:
        raise ValueError(
            f"--seq-len {seq_len} is not divisible by the context x sequence axes ({shards}) of --mesh; "
            f"e.g. --seq-len {_good_batch(seq_len, shards)}"
        )


def check_strategy(run: RunConfig) -> None:
    """The strategy against the model, mesh and rules (`train.setup.strategy_setup.check_run`): uneven counts against
    the attention, the mesh and rules.

    Raises:
      ValueError: Fewer pipeline microbatches than stages; an attention kernel inside the uneven step with
        tensor; uneven counts on a mesh or rules they do not support, or that do not divide the batch.
    """
    strategy_setup.check_run(run)


def check_adapters(config: ModelConfig, par: Parallelism) -> None:
    """Low-rank adapters (`models.lora`) against the strategy: the uneven step differentiates inside a
    manual map whose inputs are the trained parameters, so the frozen base has no place there.

    Raises:
      ConfigError: ``lora_rank`` with uneven batches (``hetero_batch``), suggesting even ones.
    """
    if config.lora_rank and isinstance(par.strategy, UnevenBatch):
        raise ConfigError(
            Field("lora_rank", config.lora_rank),
            " trains adapters with even batches only; drop ",
            Field("hetero_batch"),
            " (every device runs the same microbatches), or train without adapters",
        )


def check_model_sharding(config: ModelConfig, par: Parallelism) -> None:
    """Each main model dimension must be divisible by the mesh axes its rule names.

    ``num_kv_heads`` is exempt: with grouped-query attention, fewer KV heads than ``tensor`` devices is
    common, and those weights are replicated (and reported) instead.

    Raises:
      ValueError: Naming the field, its value, the mesh axes and values that work.
    """
    mesh_shape = par.mesh_shape
    for field, logical in _SPLIT_DIMS:
        size = getattr(config, field)
        axes = [a for a in par.rules.mesh_axes(logical) if mesh_shape.get(a, 1) > 1]
        parts = math.prod(mesh_shape[a] for a in axes)
        if parts > 1 and size % parts:
            divisors = [d for d in range(1, parts * 2 + 1) if size % d == 0 and d > 1][:4]
            over = "x".join(f"{a}={mesh_shape[a]}" for a in axes)
            sizes = (
                f"use mesh sizes whose product divides {size} (e.g. {', '.join(map(str, divisors))}), "
                if divisors
                else ""
            )
            raise ValueError(
                f"{field}={size} cannot be split over {over} (rule {logical}->{'+'.join(axes)}); {sizes}"
                f"--set {field}={-(-size // parts) * parts} (a multiple of {parts}), or --rule {logical}=none"
            )


def check_experts(config: ModelConfig, par: Parallelism) -> None:
    """The ``expert`` mesh axis against the model and the strategy (`models.moe`).

    Pipeline stages run one stack of like blocks, so a mixture of experts in a pipeline has a mixture of
    experts in every layer; and they run it exactly as the unpipelined model with gradient accumulation over
    the same microbatches only when no routed copy is dropped: a capacity counts the copies of one device's
    rows, which a stage's devices split differently.

    Raises:
      ValueError: ``expert`` > 1 with a dense model; an ``expert`` size that does not divide
        ``num_experts``; pipeline stages with dense layers in a mixture of experts, or with a capacity.
    """
    if config.is_moe and par.pipeline is not None:
        if config.first_dense_layers or config.moe_every != 1:
            raise ValueError(
                f"--mesh {_mesh_flag(par)}: pipeline stages run a mixture of experts whose every layer is one "
                f"(first_dense_layers={config.first_dense_layers}, moe_every={config.moe_every} here); "
                f"e.g. --set first_dense_layers=0 --set moe_every=1, or drop stage from --mesh"
            )
        if config.capacity_factor:
            raise ValueError(
                f"--set capacity_factor={config.capacity_factor:g}: with pipeline stages a capacity would drop "
                f"other copies than the unpipelined model (it counts one device's rows, which the stages split "
                f"differently); e.g. --set capacity_factor=0 (dropless), or drop stage from --mesh"
            )
    check_expert_axis(expert_geometry(config), par.mesh_shape, _mesh_flag(par))


def check_expert_axis(experts: ExpertGeometry | None, mesh_shape: Mapping[str, int], mesh_text: str) -> None:
    """The ``expert`` mesh axis against a model's mixture of experts, as ``train.train`` (`check_experts`) and
    ``train.plan --layout`` (`train.plan.given_layout`) both refuse it: it splits the routed experts, so a
    dense model has nothing for it to split, and its size must divide ``num_experts``.

    Args:
      experts: The model's routing (`models.spec.expert_geometry`); None for a dense model.
      mesh_shape: The resolved mesh, axis -> size.
      mesh_text: ``--mesh`` as the message shows it.

    Raises:
      ValueError: One line naming ``--mesh``: ``expert`` > 1 on a dense model (with a mixture-of-experts
        model to use, or the mesh with those devices on ``data``), or an ``expert`` size that does not divide
        ``num_experts`` (with the mesh whose largest ``expert`` size divides both, the rest on ``fsdp``).
    """
    expert = mesh_shape.get(ax.EXPERT, 1)
    if expert == 1:
        return
    if experts is None:
        # the devices left over go to data: the same devices, each rank a replica of the dense model
        fixed = {**mesh_shape, ax.EXPERT: 1, ax.DATA: mesh_shape.get(ax.DATA, 1) * expert}
        raise ValueError(
            f"--mesh {mesh_text}: expert={expert} needs a mixture-of-experts model (--model moe-test, or "
            f"--set num_experts={expert}); or move its devices to data, e.g. --mesh {format_mesh(fixed)}"
        )
    if experts.num_experts % expert:
        good = max(d for d in range(1, expert + 1) if experts.num_experts % d == 0 and expert % d == 0)
        # the devices left over go to fsdp: the same devices, and the same product for the batch and embed rules
        fixed = {**mesh_shape, ax.EXPERT: good, ax.FSDP: mesh_shape.get(ax.FSDP, 1) * (expert // good)}
        raise ValueError(
            f"--mesh {mesh_text}: expert={expert} does not divide num_experts={experts.num_experts}; "
            f"e.g. --mesh {format_mesh(fixed)}"
        )


def check_logits(run: RunConfig) -> None:
    """``--logits vocab_parallel`` must apply on this mesh.

    Raises:
      ValueError: With the reason and what would make it apply.
    """
    par, model = run.parallelism, run.model
    try:
        choose_for_batch(
            model.logits,
            par.rules,
            par.mesh_shape,
            model.vocab_size,
            model.embed_dim,
            (run.microbatch_rows, run.data.seq_len),
        )
    except ValueError as e:
        if "does not apply" not in str(e):  # a rule collision or an unknown value: its own message says it all
            raise
        raise ValueError(f"{render(e)}{_vocab_parallel_remedy(par)}") from None


def _vocab_parallel_remedy(par: Parallelism) -> str:
    """What would make ``--logits vocab_parallel`` apply, without repeating the flags already in use."""
    if par.mesh_shape.get(ax.STAGE, 1) > 1:  # no mesh with stages has it: an fsdp axis would not help
        return " (or drop stage from --mesh)"
    remedies = []
    if par.rules.name.split("+")[0] not in ("fsdp", "fsdp_tp", "fsdp_tp_sp"):
        remedies.append("--rules fsdp_tp")
    n = par.num_devices
    example = {ax.FSDP: n // 2, ax.TENSOR: 2} if n >= 4 and n % 2 == 0 else {ax.FSDP: n}
    if par.mesh_shape.get(ax.FSDP, 1) <= 1 and n > 1:
        remedies.append(f"--mesh {format_mesh(example)}")
    needs = (
        "it needs the output weight's embed dimension split over axes that also split the batch: an fsdp axis "
        "> 1 with --rules fsdp or fsdp_tp"
    )
    return f" ({needs}; e.g. {' '.join(remedies)})" if remedies else f" ({needs})"
