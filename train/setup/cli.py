"""The command line of ``python -m train.train``: argv -> `train.setup.config.RunConfig`, once.

Every flag is read here and nowhere else: the parser (`train.setup.parser`) describes them, the layout's
flags become a `sharding.parallel.Parallelism` in `train.setup.layout_flags`, and `from_args` builds the
rest of the run's configuration. Values that are wrong on their own (a malformed ``--mesh``, an unknown
``--set`` field, a non-positive count) raise a one-line ``ValueError`` naming the flag; checks that relate
flags to each other and to the devices live in `train.setup.checks`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from checkpoints import hf
from models.config import LORA_TARGETS, get_config
from sharding.devices import inventory_from_flag, parse_cluster
from sharding.mesh import parse_axis_sizes
from train.runtime.divergence import parse_max_loss
from train.runtime.optimizer import OptimizerConfig, optimizer_hyper
from train.runtime.profile import parse_profile_steps
from train.setup import configfile
from train.setup.config import (
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    LoopConfig,
    RunConfig,
)
from train.setup.layout_flags import LAYOUT_COUNTS, parallelism_from_args
from train.setup.parser import DEFAULT_MODEL, build_parser, check_positive_counts

# argv -> RunConfig ---------------------------------------------------------------------------------


def trackers(args) -> tuple[str, ...]:
    """The experiment trackers asked for (``--wandb``, ``--mlflow``), each checked to be installed.

    Raises:
      ValueError: A tracker whose package is missing, naming the flag and the extra that installs it.
    """
    import importlib.util

    names = tuple(name for name in ("wandb", "mlflow") if getattr(args, name))
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise ValueError(
                f"--{name}: the {name} package is not installed; pip install 'meshwork[{name}]' (or leave out --{name})"
            )
    return names


def parse(argv: Sequence[str] | None = None) -> RunConfig:
    """Parses ``python -m train.train`` flags into a `RunConfig`.

    Raises:
      SystemExit: From argparse, for unknown flags (also in a ``--config`` file) or ``--help``.
      ValueError: A flag whose value is wrong on its own, naming it and a value that works.
    """
    import sys

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(configfile.expand(argv, parser))
    return from_args(args).replace(record=configfile.record_of(argv, args))


def from_args(args: argparse.Namespace) -> RunConfig:
    """The `RunConfig` of a parsed namespace (see `parse`)."""
    _check_counts(args)
    _check_numbers(args)
    execution = {
        k: v
        for k, v in (
            ("dtype", args.dtype),
            ("remat", args.remat),
            ("attention", args.attention),
            ("logits", args.logits),
        )
        if v
    }
    execution.update(_lora_fields(args))
    model, preset, tokenizer, eod = _model_and_tokenizer(args, execution)
    _check_lora_alpha(args, model)
    decay = args.steps if args.decay_steps is None else args.decay_steps
    optimizer = OptimizerConfig(
        lr=args.lr,
        warmup=args.warmup if args.warmup is not None else max(decay // 20, 0),
        decay_steps=decay,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        name=args.optimizer,
        schedule=args.schedule,
        **optimizer_hyper(args.optimizer, args.beta1, args.beta2, args.eps),
    )
    optimizer.validate()
    return RunConfig(
        model=model,
        preset=preset,
        parallelism=parallelism_from_args(args, model.num_layers),
        data=DataConfig(
            args.data,
            tokenizer,
            eod,
            args.heldout,
            args.data_cache,
            args.seq_len,
            args.batch_size,
            args.seed,
            args.text_field,
        ),
        optimizer=optimizer,
        loop=LoopConfig(
            args.steps,
            args.log_every,
            args.eval_every,
            args.eval_batches,
            args.skip_nonfinite,
            not args.no_progress,
            args.dry_run,
            parse_max_loss(args.max_loss),
            parse_profile_steps(args.profile_steps, args.steps),
            trackers(args),
        ),
        checkpoint=CheckpointConfig(
            args.run_dir,
            args.resume,
            args.ckpt_every,
            args.keep,
            args.resume_step,
            args.init_from,
            args.discard_later,
            args.break_lock,
        ),
        cluster=ClusterConfig(
            args.cpu_devices,
            args.coordinator,
            args.num_processes,
            args.process_id,
            args.dist_timeout,
            args.cluster,
            args.simulate_cluster,
            args.plan,
            args.device_memory,
            external_coordinator=args.external_coordinator,
        ),
    )


def _lora_fields(args) -> dict:
    """The adapter fields of ``--lora-rank/--lora-alpha/--lora-targets`` (`models.lora`): all seven
    projections when ``--lora-rank`` comes without targets; none given, none set."""
    fields = {}
    if args.lora_rank is not None:
        fields["lora_rank"] = args.lora_rank
        fields["lora_targets"] = ",".join(LORA_TARGETS) if args.lora_rank else ""
    if args.lora_alpha is not None:
        fields["lora_alpha"] = args.lora_alpha
    if args.lora_targets is not None:
        fields["lora_targets"] = args.lora_targets
    if args.lora_base_dtype is not None:
        fields["lora_base_dtype"] = args.lora_base_dtype
    return fields


def _check_lora_alpha(args, model) -> None:
    """``--lora-alpha`` scales adapters: given for a model without any (no ``--lora-rank``, nor ``lora_rank``
    through ``--set``) it would be silently ignored, so it is refused, as ``--lora-targets`` is.

    Raises:
      ValueError: Naming ``--lora-alpha`` and a command line that is accepted.
    """
    if args.lora_alpha is not None and not model.lora_rank:
        alpha = args.lora_alpha if args.lora_alpha > 0 and args.lora_alpha < float("inf") else 16
        raise ValueError(
            f"--lora-alpha {args.lora_alpha} needs adapters of some rank, e.g. --lora-rank 16 --lora-alpha {alpha:g}"
            " (or leave --lora-alpha out)"
        )


def _model_and_tokenizer(args, execution: dict) -> tuple:
    """``(model, preset, tokenizer, eod_token)``: from ``--model``/``--set``, or from ``--init-from``'s folder
    (its ``config.json`` and, unless ``--tokenizer`` says otherwise, its ``tokenizer.json``; the preset
    recorded as ``hf:PATH``)."""
    if args.init_from is None:
        preset = args.model or DEFAULT_MODEL
        return get_config(preset, args.set, **execution), preset, args.tokenizer, args.eod_token

    model = hf.init_config(args.init_from, args.model, args.set, **execution)
    hf.weight_files(args.init_from)  # a folder of pickled weights only is refused here, before the data is read
    tokenizer = args.tokenizer
    if tokenizer is None and (Path(args.init_from) / hf.TOKENIZER_FILE).is_file():
        tokenizer = str(Path(args.init_from) / hf.TOKENIZER_FILE)
    eod = args.eod_token
    if eod is None and tokenizer is not None:
        eod = hf.eod_token(args.init_from, tokenizer)
    return model, f"hf:{args.init_from}", tokenizer, eod


def _check_counts(args) -> None:
    """The counts in range, each refused naming its flag and an accepted value: its default, or for a flag
    without one (``--cpu-devices``, ``--pipeline-repeats``) the common value."""
    check_positive_counts(
        args, (("seq-len", None), ("batch-size", None), ("steps", None), ("log-every", None), ("cpu-devices", 8))
    )
    check_positive_counts(args, LAYOUT_COUNTS)
    for name in ("ckpt-every", "eval-every", "eval-batches", "skip-nonfinite"):
        value = getattr(args, name.replace("-", "_"))
        if value < 0:
            raise ValueError(f"--{name} {value}: must be >= 0")
    if args.keep < 1:
        raise ValueError(f"--keep {args.keep}: must be at least 1")
    if args.resume_step is not None and (args.resume_step < 0 or not args.resume):
        raise ValueError(
            f"--resume-step {args.resume_step}: needs --resume and a step >= 0, e.g. --resume "
            f"--resume-step {max(args.resume_step, 0)}"
        )
    if args.discard_later and args.resume_step is None:
        raise ValueError("--discard-later: applies with --resume --resume-step N (the steps after N are set aside)")
    if args.mesh_outer:
        parse_axis_sizes(args.mesh_outer, field="mesh_outer", allow_fill=False)
    args_distributed = ClusterConfig(
        coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        dist_timeout=args.dist_timeout,
        external_coordinator=args.external_coordinator,
    )
    args_distributed.distributed().validate()
    if args.cluster:
        inventory_from_flag(args.cluster)
    if args.simulate_cluster:
        parse_cluster(args.simulate_cluster, field="simulate_cluster")


# Largest --seed: the parameters' PRNG key is made from an int32.
MAX_SEED = 2**31 - 1


def _check_numbers(args) -> None:
    """``--heldout``, ``--seed``, the schedule's counts and process numbers in range (value by value; the
    optimizer's reals are `OptimizerConfig.validate`'s, the processes' `DistributedConfig.validate`'s)."""
    if not 0.0 < args.heldout < 1.0:  # NaN fails too; evaluation needs at least one held-out document
        raise ValueError(f"--heldout {args.heldout}: must be a fraction > 0 and < 1, e.g. --heldout 0.01")
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed {args.seed}: must be in 0..{MAX_SEED}, e.g. --seed 0")
    if args.decay_steps is not None and args.decay_steps <= 0:
        raise ValueError(
            f"--decay-steps {args.decay_steps}: must be a positive number of steps, e.g. --decay-steps "
            f"{args.steps} (or leave it out: the schedule then lasts --steps)"
        )
    if args.warmup is not None and args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: must be >= 0, e.g. --warmup {max(args.steps // 20, 1)}")
