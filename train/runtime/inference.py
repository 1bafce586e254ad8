"""Shared command-line bits of the entry points that run a model without training (generate, evaluate).

One place for: the device and mesh flags (``--mesh``, ``--rules``, ``--rule``, ``--cpu-devices``),
where the model comes from (``--hf PATH`` or ``--run-dir RUN [--step N]``: `add_source_args`,
`load_model`, `restore_params`), the tokenizer (``--tokenizer``, else the folder's ``tokenizer.json``
or the run's), turning errors into one line, and the state a run starts from when it has no
checkpoint (`fresh_state`: ``--init-from`` or a random init).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoints.meta import RunMeta
from sharding.mesh import format_mesh, make_mesh, parse_axis_sizes, parse_mesh
from sharding.parallel import Parallelism
from sharding.rules import DEFAULT_PRESET, get_rules
from sharding.rules import PRESETS as RULE_PRESETS
from train.data.tokenizer import HFTokenizer, load_tokenizer, tokenizer_of
from train.launcher.distributed import setup_devices
from train.setup.flagnames import render


def add_device_args(parser: argparse.ArgumentParser, default_mesh: str = "fsdp=-1") -> None:
    """``--mesh``, ``--rules``, ``--rule``, ``--cpu-devices``."""
    g = parser.add_argument_group("mesh and sharding")
    g.add_argument(
        "--mesh",
        default=default_mesh,
        help="mesh axes and sizes, e.g. data=2,tensor=4; one -1 takes the "
        "remaining devices (no stage axis: the layer stack runs as a scan)",
    )
    g.add_argument("--rules", default=DEFAULT_PRESET, choices=sorted(RULE_PRESETS), help="logical-to-mesh rules preset")
    g.add_argument(
        "--rule",
        action="append",
        default=[],
        metavar="NAME=AXIS[+AXIS]",
        help="override one logical axis, e.g. --rule vocab=none; repeatable",
    )
    g.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        metavar="N",
        help="simulate N devices on a CPU-only machine (applied before JAX starts)",
    )


def add_source_args(parser: argparse.ArgumentParser) -> None:
    """Where the model comes from: ``--hf PATH`` or ``--run-dir RUN [--step N]``."""
    g = parser.add_argument_group("model")
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--hf",
        metavar="PATH",
        help="a Hugging Face model folder (config.json, *.safetensors; LlamaForCausalLM, "
        "MistralForCausalLM or Qwen2ForCausalLM)",
    )
    source.add_argument("--run-dir", metavar="RUN", help="a meshwork run folder (its checkpoints/)")
    g.add_argument(
        "--step",
        type=int,
        default=None,
        metavar="N",
        help="with --run-dir, this checkpoint step (default: the newest that reads completely)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="FILE",
        help="a tokenizer.json; default: the model folder's tokenizer.json, or the run's",
    )
    g.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype (parameters stay float32)"
    )


def setup(args, task: str) -> Any:
    """Applies ``--cpu-devices``, builds the mesh and rules; returns the run's `Parallelism`.

    Args:
      args: The command's namespace (`add_device_args`'s flags).
      task: What the command does, as a stage axis's refusal names it (``generation``, ``export``).

    Raises:
      ValueError: a ``--mesh`` that does not fit the devices, a stage axis, or bad rules.
    """
    setup_devices(args.cpu_devices)  # a count out of bounds refused (`train.launcher.distributed.check_cpu_devices`)
    import jax

    from train.setup.checks import check_simulated_devices  # slow: jax

    check_simulated_devices(parse_axis_sizes(args.mesh), jax.devices(), args.cpu_devices)
    shape = parse_mesh(args.mesh, jax.device_count())
    if shape.get("stage", 1) > 1:  # the stage's devices go to fsdp: the same devices
        flat = {**shape, "stage": 1, "fsdp": shape.get("fsdp", 1) * shape["stage"]}
        raise ValueError(f"--mesh {args.mesh}: {task} runs without pipeline stages; e.g. --mesh {format_mesh(flat)}")
    return Parallelism.of(make_mesh(shape), get_rules(args.rules, args.rule))


@dataclasses.dataclass
class LoadedModel:
    """A model ready to run: config, graphdef, parameters on the mesh, tokenizer and special tokens."""

    config: Any
    graphdef: Any
    params: dict[str, Any]
    tokenizer: Any
    eod_id: int | None
    bos_id: int | None


def read_run(run_dir: str | Path, step: int | None = None):
    """``(manager, step, meta)``: a run folder's checkpoint ``step`` (default: the newest that reads completely).

    Raises:
      ValueError: No ``checkpoints/`` folder or no checkpoint in it; a missing or damaged ``step``.
    """
    from checkpoints.manager import CheckpointManager  # slow: orbax

    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        what = "a file, not a folder" if Path(run_dir).is_file() else "no checkpoints/ folder"
        raise ValueError(f"--run-dir {run_dir}: {what}; give a folder written by train.train or train.hf import")
    manager = CheckpointManager(folder, async_save=False, read_only=True)  # a live run's save in progress stays
    try:
        chosen = manager.resume_choice(step, "step").step
        if chosen is None:
            raise ValueError(f"--run-dir {run_dir}: no checkpoint in {folder}")
        return manager, chosen, RunMeta.from_json(manager.read_meta(chosen))
    except BaseException:
        manager.close()
        raise


def restore_params(run_dir: str | Path, step: int | None, par, **changes):
    """A run's parameters restored onto ``par``'s mesh in the canonical ``[layers, ...]`` layout.

    Restores onto the `train.runtime.state.StateLayout` of ``par`` without a pipeline
    (`checkpoints.manager.restore_state`: every device reads only its slice; a pipeline checkpoint is re-laid
    on device).

    Args:
      run_dir: The run folder.
      step: The checkpoint step (None: the newest complete).
      par: A `Parallelism` bound to a mesh, without a stage axis.
      **changes: Execution fields of the model (``dtype`` ...).

    Returns:
      ``(config, params, meta, step)``: the `ModelConfig`, the params tree, the `checkpoints.meta.RunMeta`.

    Raises:
      ValueError: As `read_run`; a step whose array data does not read
        (`checkpoints.verify.CheckpointDamaged`, naming the array, its data file and a step that reads).
    """
    from checkpoints.manager import restore_state  # slow: orbax
    from checkpoints.verify import restore_falling_back  # slow: orbax
    from train.runtime.state import StateLayout  # slow: jax

    manager, step, meta = read_run(run_dir, step)
    try:
        config = meta.model_config(**changes)
        layout = StateLayout(config, par)
        # damaged array data: one line naming the array and file, and a step that reads (nothing renamed)
        (state, _), _ = restore_falling_back(
            manager.directory, step, lambda s: restore_state(manager, layout, s), print, explicit=True, field="step"
        )
    finally:
        manager.close()
    return config, state["params"], meta, step


def load_model(args, par) -> LoadedModel:
    """Reads ``--hf`` onto ``par``'s mesh (`checkpoints.hf.load_params`) with its tokenizer, or ``--run-dir``
    (`load_run`).

    The end-of-document token is ``config.json``'s ``eos_token_id`` (else the tokenizer's);
    ``bos_token_id`` is kept as ``bos_id``; whether prompts start with it is the tokenizer's choice
    (`train.data.tokenizer.HFTokenizer.encode_prompts`), as in transformers.

    Raises:
      ValueError: as `checkpoints.hf`; a missing tokenizer; a tokenizer larger than the vocabulary.
    """
    from checkpoints import hf  # slow: ml_dtypes
    from train.runtime.state import StateLayout  # slow: jax

    if args.hf is None:
        return load_run(args, par)
    if args.step is not None:
        raise ValueError(f"--step {args.step}: goes with --run-dir, not --hf")
    folder = Path(args.hf)
    hf_config = hf.read_hf_config(folder)
    config = hf.config_from_hf(hf_config, str(folder / hf.CONFIG_FILE), dtype=args.dtype)
    layout = StateLayout(config, par)
    eos, bos = hf.token_id(hf_config.get("eos_token_id")), hf.token_id(hf_config.get("bos_token_id"))
    if args.tokenizer in ("bytes", ""):  # as training spells it: UTF-8 bytes (a prepared folder may say so)
        tokenizer, tokenizer_file = load_tokenizer(args.tokenizer), "bytes"
    else:
        tokenizer_file = Path(args.tokenizer) if args.tokenizer else folder / hf.TOKENIZER_FILE
        if not tokenizer_file.is_file():
            where = (
                f"--tokenizer {args.tokenizer}: no such file" if args.tokenizer else f"{folder}: no {hf.TOKENIZER_FILE}"
            )
            raise ValueError(f"{where}; pass --tokenizer FILE (a tokenizer.json) or --tokenizer bytes")
        tokenizer = HFTokenizer(tokenizer_file, hf.eod_token(folder, tokenizer_file))
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"--tokenizer {tokenizer_file}: {tokenizer.vocab_size} tokens, more than the model's "
            f"vocab_size {config.vocab_size}; give the model's own tokenizer.json"
        )
    params = hf.load_params(folder, config, layout.param_targets())
    return LoadedModel(config, layout.graphdef, params, tokenizer, eos if eos is not None else tokenizer.eod_id, bos)


def load_run(args, par) -> LoadedModel:
    """A run folder's checkpoint (``--run-dir``, ``--step``) on ``par``'s mesh with the run's tokenizer
    (``--tokenizer`` to replace it); no beginning-of-sequence token.

    Raises:
      ValueError: As `restore_params`; a tokenizer larger than the vocabulary.
    """
    from models.transformer import abstract_model  # slow: jax

    config, params, meta, _ = restore_params(args.run_dir, args.step, par, dtype=args.dtype)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else tokenizer_of(meta.tokenizer)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"--tokenizer {tokenizer.name}: {tokenizer.vocab_size} tokens, more than the model's "
            f"vocab_size {config.vocab_size}; give the run's own tokenizer"
        )
    return LoadedModel(config, abstract_model(config)[0], params, tokenizer, tokenizer.eod_id, None)


def fresh_state(config, layout, directory, log) -> dict:
    """The state of a run with no checkpoint to resume: ``--init-from``'s weights, else a random init.

    ``--init-from PATH``: the folder's tensors are read straight onto the run's mesh and rules in the
    canonical ``[layers, ...]`` layout (`checkpoints.hf.load_params`), then given a fresh optimizer
    state and re-laid for a pipeline (`train.runtime.state.StateLayout.state_from_params`).

    Args:
      config: The `train.setup.config.RunConfig`; its model came from the folder's ``config.json``.
      layout: The run's `train.runtime.state.StateLayout`.
      directory: The checkpoint folder (for the log line).
      log: Prints a line (process 0).

    Raises:
      ValueError: As `checkpoints.hf.load_params` (a missing or misshapen tensor, no safetensors).
    """
    import time

    from checkpoints import hf  # slow: ml_dtypes

    folder = config.checkpoint.init_from
    if folder is None:
        if config.checkpoint.resume:
            log(f"no checkpoint in {directory}; starting from step 0")
        return layout.init_state(config.data.seed)
    t0 = time.perf_counter()
    state = layout.state_from_params(hf.load_params(folder, config.model, layout.param_targets()), config.data.seed)
    note = f" (no checkpoint in {directory})" if config.checkpoint.resume else ""
    log(
        f"initialized from {folder}{note}: weights onto mesh {format_mesh(layout.par.mesh_shape)} in "
        f"{time.perf_counter() - t0:.1f} s, fresh optimizer state"
    )
    return state


def run_main(run: Callable[[Any], int], args) -> int:
    """Runs ``run(args)``; bad input and missing files end as ``error: ...`` (exit 2), not a traceback."""
    try:
        return run(args)
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        print(f"error: {render(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
