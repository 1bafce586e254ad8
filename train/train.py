"""meshwork's trainer: ``python -m train.train [flags]``.

Trains a decoder-only LM on a named device mesh, its parameters and
activations partitioned by XLA's SPMD partitioner from logical sharding
rules, with sharded asynchronous checkpoints that resume onto any mesh.

Examples::

    python -m train.train --cpu-devices 8                      # small model on stdlib, fsdp=8
    python -m train.train --cpu-devices 8 --mesh data=2,fsdp=2,tensor=2 --rules fsdp_tp
    python -m train.train --model 7b --mesh fsdp=8 --cpu-devices 8 --dry-run
    python -m train.train --run-dir runs/a --resume              # continue a run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from models.config import (ATTENTION_IMPLS, DTYPES, LOGITS_IMPLS, PRESETS, REMAT_POLICIES, config_differences,
                           get_config)
from sharding.mesh import format_mesh, parse_axis_sizes, parse_mesh
from sharding.pipeline import parse_stage_layers
from sharding.rules import DEFAULT_PRESET, PRESETS as RULE_PRESETS, get_rules
from train.loop import NonFiniteLossError
from train import hetero
from train.optimizer import OptimizerConfig

DEFAULT_RUN_DIR = "runs/default"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only where it has one and the help does not already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.train",
        description=__doc__.split("\n\n")[1],
        formatter_class=_HelpFormatter,
        epilog="Logical axes: batch, length, embed, mlp, heads, kv_heads, head_dim, vocab, layers, act_embed. "
        "Mesh axes: data, stage, fsdp, sequence, tensor.",
    )
    g = p.add_argument_group("mesh and sharding")
    g.add_argument("--mesh", default="fsdp=-1", help="mesh axes and sizes, e.g. data=2,fsdp=-1,tensor=2; "
                   "one -1 takes the remaining devices; axes left out have size 1")
    g.add_argument("--rules", default=DEFAULT_PRESET, choices=sorted(RULE_PRESETS),
                   help="logical-to-mesh rules preset (see README: Sharding rules)")
    g.add_argument("--rule", action="append", default=[], metavar="NAME=AXIS[+AXIS]",
                   help="override one logical axis, e.g. --rule mlp=tensor+fsdp or --rule vocab=none; repeatable")
    g.add_argument("--mesh-outer", default=None, metavar="AXIS=N,...",
                   help="how much of each axis spans processes (slow links), e.g. data=2; the rest stays inside a "
                   "process; default: tensor, then sequence, then fsdp stay inside a process")
    g.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                   help="simulate N devices on a CPU-only machine (takes effect before JAX starts); "
                   "default: the devices JAX finds (XLA_FLAGS included)")
    g = p.add_argument_group("several processes (one per host, jax.distributed)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordinator; with none of these flags, JAX's own cluster "
                   "detection (SLURM, Open MPI, Kubernetes) is used where it applies")
    g.add_argument("--num-processes", type=int, default=None, help="number of processes in the job")
    g.add_argument("--process-id", type=int, default=None, help="this process's index, 0..N-1")
    g.add_argument("--dist-timeout", type=int, default=300, help="seconds to wait for all processes to connect")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="small", choices=sorted(PRESETS), help="model preset")
    g.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelConfig field, e.g. --set num_layers=8; repeatable")
    g.add_argument("--dtype", default=None, choices=DTYPES, help="compute dtype (parameters stay float32); "
                   "default: the preset's (float32)")
    g.add_argument("--remat", default=None, choices=REMAT_POLICIES, help="rematerialisation policy per block; "
                   "default: the preset's (none)")
    g.add_argument("--attention", default=None, choices=ATTENTION_IMPLS, help="attention implementation; ring or "
                   "ulysses split the length over the sequence mesh axis (context parallelism); default: the preset's (reference)")
    g.add_argument("--logits", default=None, choices=LOGITS_IMPLS,
                   help="output projection and loss: gathered (weight gathered, GSPMD), vocab_parallel (Megatron-LM's "
                   "vocabulary-parallel cross-entropy over the axes splitting the weight), auto (vocab_parallel where "
                   "it moves fewer bytes); default: the preset's (auto)")
    g.add_argument("--context-layout", default="auto", choices=("auto", "contiguous", "zigzag"),
                   help="how tokens lie along the sequence axis: zigzag (device r holds chunks r and 2P-1-r of 2P) "
                   "balances causal ring attention; auto: zigzag for --attention ring with a sequence axis, else "
                   "contiguous")
    g = p.add_argument_group("data")
    g.add_argument("--data", default="stdlib", help="'stdlib' (this Python's standard library sources), "
                   "a text file, a folder of text files, or a .jsonl file with a 'text' field")
    g.add_argument("--tokenizer", default=None, metavar="FILE", help="a tokenizer.json (Hugging Face tokenizers); "
                   "default: UTF-8 bytes")
    g.add_argument("--eod-token", default=None, help="end-of-document token of --tokenizer (default: autodetect)")
    g.add_argument("--heldout", type=float, default=0.01, help="fraction of documents held out for evaluation")
    g.add_argument("--data-cache", default=None, help="folder for tokenized corpora "
                   "(default: $MESHWORK_CACHE or ~/.cache/meshwork)")
    g.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    g.add_argument("--batch-size", type=int, default=16, help="global batch size in sequences")
    g.add_argument("--microbatches", type=int, default=1, help="gradient-accumulation steps per batch; with "
                   "--mesh stage=N (N > 1), the pipeline's microbatches instead (at least N; no accumulation loop)")
    g = p.add_argument_group("pipeline parallelism (with --mesh stage=N, N > 1)")
    g.add_argument("--pipeline-schedule", default="gpipe", choices=("gpipe", "circular"),
                   help="gpipe: each stage holds one run of layers; circular: each holds --pipeline-repeats "
                   "non-adjacent chunks, shrinking the bubble (S-1)/(R*M+S-1)")
    g.add_argument("--pipeline-repeats", type=int, default=None, metavar="R",
                   help="chunks per stage for --pipeline-schedule circular (default 2; gpipe: 1)")
    g.add_argument("--stage-layers", default=None, metavar="N,N,...",
                   help="layers per stage, e.g. 10,10,6,6 for 32 layers on stage=4 (must sum to the model's layers); "
                   "circular also takes one count per chunk (S*R); default: even, the first stages taking the rest")
    hetero.add_flags(p)
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=150, help="train until this step")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup", type=int, default=None, help="linear warmup steps (default: 5%% of the schedule)")
    g.add_argument("--decay-steps", type=int, default=None, help="length of the cosine schedule (default: --steps)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decoupled weight decay (matrices only)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip gradients to this global norm")
    g.add_argument("--seed", type=int, default=0, help="seed for parameters, data order and held-out split")
    g.add_argument("--skip-nonfinite", type=int, default=0, metavar="N",
                   help="skip (and log) up to N steps whose loss is NaN or infinite; past that the run stops, "
                   "keeping its last good checkpoint")
    g = p.add_argument_group("run folder, checkpoints, logging")
    g.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help="folder for checkpoints and metrics")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --run-dir "
                   "(onto the current mesh and rules); starts fresh if there is none")
    g.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints (0: only at the end)")
    g.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    g.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations (0: first/last)")
    g.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation")
    g.add_argument("--log-every", type=int, default=10, help="steps between log lines")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--dry-run", action="store_true", help="compile one step, print the sharding, memory and "
                   "collectives report, and exit without training")
    return p


def _positive(args, *names) -> None:
    for name in names:
        value = getattr(args, name.replace("-", "_"))
        if value is not None and value <= 0:
            raise ValueError(f"--{name} {value}: must be a positive integer")


def validate_args(args) -> None:
    """Checks that need no devices; raises ValueError naming the flag."""
    _positive(args, "seq-len", "batch-size", "microbatches", "steps", "log-every", "eval-batches", "cpu-devices",
              "pipeline-repeats")
    parse_stage_layers(args.stage_layers)
    hetero.validate_flags(args)
    for name in ("ckpt-every", "eval-every"):
        if getattr(args, name.replace("-", "_")) < 0:
            raise ValueError(f"--{name} must be >= 0")
    if args.skip_nonfinite < 0:
        raise ValueError(f"--skip-nonfinite {args.skip_nonfinite}: must be >= 0")
    parse_axis_sizes(args.mesh)
    if args.mesh_outer:
        parse_axis_sizes(args.mesh_outer, flag="--mesh-outer", allow_fill=False)
    distributed_config(args).validate()
    get_rules(args.rules, args.rule)
    model_config(args)
    optimizer_config(args).validate()


def distributed_config(args):
    from train.distributed import DistributedConfig

    return DistributedConfig(args.coordinator, args.num_processes, args.process_id, args.dist_timeout)


def check_run_dir(args) -> None:
    """The run folder is writable and holds no other run's checkpoints unless ``--resume``.

    Raises:
      ValueError: naming ``--run-dir`` and what to do.
    """
    run_dir = Path(args.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--run-dir {run_dir}: cannot write there ({e.strerror}); choose a writable folder") from None
    ckpt_dir = run_dir / "checkpoints"
    saved = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) if ckpt_dir.is_dir() else []
    if saved and not args.resume:
        raise ValueError(
            f"--run-dir {run_dir} already holds checkpoints (latest step {saved[-1]}); pass --resume to continue "
            f"that run, or choose another --run-dir (nothing was overwritten)"
        )


# Model dimensions the presets split; a mesh axis that cannot split them is a configuration error.
_SPLIT_DIMS = (("embed_dim", "embed"), ("mlp_dim", "mlp"), ("num_heads", "heads"), ("vocab_size", "vocab"))


def check_model_sharding(config, rules, mesh_shape: dict[str, int]) -> None:
    """Each main model dimension must be divisible by the mesh axes its rule names.

    ``num_kv_heads`` is exempt: with grouped-query attention, fewer KV heads
    than ``tensor`` devices is common, and those weights are replicated (and
    reported) instead.

    Raises:
      ValueError: naming the field, its value, the mesh axes and values that work.
    """
    for field, logical in _SPLIT_DIMS:
        size = getattr(config, field)
        axes = [a for a in rules.mesh_axes(logical) if mesh_shape.get(a, 1) > 1]
        parts = 1
        for axis in axes:
            parts *= mesh_shape[axis]
        if parts > 1 and size % parts:
            divisors = [d for d in range(1, parts * 2 + 1) if size % d == 0 and d > 1][:4]
            over = "x".join(f"{a}={mesh_shape[a]}" for a in axes)
            sizes = (f"use mesh sizes whose product divides {size} (e.g. {', '.join(map(str, divisors))}), "
                     if divisors else "")
            raise ValueError(
                f"{field}={size} cannot be split over {over} (rule {logical}->{'+'.join(axes)}); {sizes}"
                f"--set {field}={-(-size // parts) * parts} (a multiple of {parts}), or --rule {logical}=none"
            )


def model_config(args):
    changes = {k: v for k, v in (("dtype", args.dtype), ("remat", args.remat), ("attention", args.attention),
                                 ("logits", args.logits)) if v}
    return get_config(args.model, args.set, **changes)


def optimizer_config(args) -> OptimizerConfig:
    decay = args.decay_steps or args.steps
    warmup = args.warmup if args.warmup is not None else max(decay // 20, 0)
    return OptimizerConfig(
        lr=args.lr, warmup=warmup, decay_steps=decay, weight_decay=args.weight_decay, grad_clip=args.grad_clip
    )


def setup_devices(cpu_devices: int | None) -> None:
    """Applies ``--cpu-devices`` before JAX starts its backend.

    Raises:
      RuntimeError: when the backend already started with another count.
    """
    if cpu_devices is None:
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have != cpu_devices:
            raise RuntimeError(
                f"--cpu-devices {cpu_devices}: JAX already started with {have} CPU devices in this process"
            ) from None


def context_layout(args, config, rules, mesh_shape: dict[str, int]) -> str:
    """Resolves ``--context-layout`` and checks the sizes context parallelism needs (before device work).

    Raises:
      ValueError: zigzag with an attention that assumes natural order, a ``--seq-len`` zigzag cannot cut
        into 2P chunks, or heads ``--attention ulysses`` cannot split; naming the flags.
    """
    from models.attention import check_context_parallel, resolve_context_layout
    from sharding.parallel import Parallelism

    layout = resolve_context_layout(args.context_layout, config.attention, Parallelism(mesh_shape, rules).length_shards)
    check_context_parallel(config, Parallelism(mesh_shape, rules, context_layout=layout), args.seq_len)
    return layout


def check_logits(args, config, rules, mesh_shape: dict[str, int]) -> str:
    """Resolves ``--logits`` for this mesh (before device work); returns a line for the start-up report.

    Raises:
      ValueError: ``--logits vocab_parallel`` where it cannot apply, with the reason and what would make it apply.
    """
    from sharding.vocab import choose_for_batch, output_traffic, tokens_per_device, vocab_split

    rows = args.batch_size // args.microbatches
    try:
        split = choose_for_batch(config.logits, rules, mesh_shape, config.vocab_size, config.embed_dim,
                                 (rows, args.seq_len))
    except ValueError as e:
        raise ValueError(f"{e} (it needs the output weight's embed dimension split over axes that also split the "
                         f"batch: an fsdp axis > 1 with --rules fsdp or fsdp_tp, e.g. --mesh fsdp=4,tensor=2)") from None
    candidate, _ = vocab_split(rules, mesh_shape, config.vocab_size, config.embed_dim, rows)
    if candidate is None or config.tie_embeddings:
        return f"logits: {'vocab_parallel' if split else 'gathered'} (--logits {config.logits})"
    tokens = tokens_per_device(rules, mesh_shape, (rows, args.seq_len))
    gathered, parallel = output_traffic(candidate, config.vocab_size, config.embed_dim, tokens)
    return (f"logits: {'vocab_parallel' if split else 'gathered'} (--logits {config.logits}; per device and "
            f"microbatch the loss moves {gathered / 2**20:.1f} MiB gathered, {parallel / 2**20:.1f} MiB "
            f"vocab_parallel)")


def check_batch(args, mesh_shape: dict[str, int]) -> None:
    """Batch and length divisibility against the mesh (before any device work)."""
    dp = mesh_shape["data"] * mesh_shape["fsdp"]
    if args.batch_size % args.microbatches:
        raise ValueError(
            f"--batch-size {args.batch_size} is not divisible by --microbatches {args.microbatches}; "
            f"e.g. --batch-size {_good_batch(args.batch_size, args.microbatches * dp)}"
        )
    per_micro = args.batch_size // args.microbatches
    if per_micro % dp:
        good = _good_batch(args.batch_size, args.microbatches * dp)
        raise ValueError(
            f"--batch-size {args.batch_size} / --microbatches {args.microbatches} = {per_micro} sequences per "
            f"microbatch, not divisible by the data-parallel size data x fsdp = {dp} of --mesh {args.mesh}; "
            f"e.g. --batch-size {good}"
        )
    if args.seq_len % mesh_shape["sequence"]:
        raise ValueError(
            f"--seq-len {args.seq_len} is not divisible by the sequence axis ({mesh_shape['sequence']}) of --mesh; "
            f"e.g. --seq-len {_good_batch(args.seq_len, mesh_shape['sequence'])}"
        )


def _good_batch(value: int, multiple: int) -> int:
    """The multiple of ``multiple`` nearest ``value`` (at least ``multiple``)."""
    return multiple * max(1, round(value / multiple))


def check_pipeline(args, config, mesh_shape: dict[str, int]):
    """The pipeline plan of ``--mesh stage=N`` and the pipeline flags, checked before any compilation.

    Returns:
      ``(plan, note)``: a `sharding.pipeline.PipelinePlan` (None without a
      stage axis) and a line saying how the layers were split when
      ``--stage-layers`` was left out and the split is uneven (else None).

    Raises:
      ValueError: pipeline flags without a stage axis; ``--pipeline-repeats``
        that does not fit the schedule; fewer layers than stages (or
        chunks); a bad ``--stage-layers``; fewer microbatches than stages;
        an ``--attention`` kernel that runs under its own shard_map. Each
        names the flag, its value and one that works.
    """
    from sharding.pipeline import PipelinePlan, check_microbatches, plan_layout

    stages = mesh_shape["stage"]
    circular = args.pipeline_schedule == "circular"
    if stages == 1:
        given = [flag for flag, on in (("--stage-layers", args.stage_layers), ("--pipeline-schedule circular", circular),
                                       ("--pipeline-repeats", args.pipeline_repeats)) if on]
        if given:
            raise ValueError(f"{given[0]} needs a pipeline: add a stage axis to --mesh, e.g. --mesh stage=2,fsdp=-1")
        return None, None
    repeats = args.pipeline_repeats or (2 if circular else 1)
    if not circular and repeats != 1:
        raise ValueError(f"--pipeline-repeats {repeats} needs --pipeline-schedule circular (gpipe has 1 repeat)")
    if circular and repeats < 2:
        raise ValueError("--pipeline-schedule circular needs --pipeline-repeats of 2 or more, e.g. --pipeline-repeats 2 "
                         "(1 repeat is --pipeline-schedule gpipe)")
    layout, note = plan_layout(config.num_layers, stages, repeats, parse_stage_layers(args.stage_layers))
    check_microbatches(args.microbatches, stages, args.batch_size, mesh_shape["data"] * mesh_shape["fsdp"])
    if config.attention not in ("reference", "dot_product"):
        raise ValueError(f"--attention {config.attention} runs its kernel under its own shard_map, which cannot sit "
                         f"inside the pipeline's yet; with --mesh stage={stages} use --attention reference")
    return PipelinePlan(layout, args.microbatches), note


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        validate_args(args)
        return run(args)
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except CheckpointFailure as e:
        print(f"error: {e}", file=sys.stderr)
        global _HARD_EXIT
        _HARD_EXIT = True
        return 2
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    """Checks the flags against the machine, then trains (or dry-runs); returns the exit code."""
    if not args.dry_run:
        check_run_dir(args)
    setup_devices(args.cpu_devices)
    from train.distributed import initialize

    processes = initialize(distributed_config(args))
    import jax

    from checkpoints.manager import CheckpointManager
    from sharding.mesh import make_mesh
    from train import report
    from train.data import corpus_files
    from train.tokenizer import load_tokenizer

    log = _logger(jax.process_index() == 0)
    config = hetero.apply_plan(args, model_config(args), jax.devices(), log)
    mesh_shape = parse_mesh(args.mesh, jax.device_count())
    check_batch(args, mesh_shape)
    hetero.check_flags(args, mesh_shape)
    pipeline, pipeline_note = check_pipeline(args, config, mesh_shape)
    rules = get_rules(args.rules, args.rule)
    check_model_sharding(config, rules, mesh_shape)
    layout = context_layout(args, config, rules, mesh_shape)
    logits_line = check_logits(args, config, rules, mesh_shape)
    if config.attention in ("ring", "ulysses"):
        from sharding.parallel import Parallelism

        if Parallelism(mesh_shape, rules).length_shards == 1:
            log(f"note: --attention {config.attention} with the length whole on every device (no sequence axis > 1 "
                f"in --mesh {args.mesh}) is plain flash attention: no context parallelism")
    outer = parse_axis_sizes(args.mesh_outer, flag="--mesh-outer", allow_fill=False) if args.mesh_outer else None
    if outer is not None and jax.process_count() == 1:
        log("note: one process, so --mesh-outer has no effect")
        outer = None
    tokenizer = load_tokenizer(args.tokenizer, args.eod_token)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {config.vocab_size}; "
            f"pass --set vocab_size={-(-tokenizer.vocab_size // 128) * 128}"
        )
    ckpt = latest = None
    if not args.dry_run:
        corpus_files(args.data)  # a missing or empty corpus fails before any device work
        ckpt = CheckpointManager(Path(args.run_dir) / "checkpoints", keep=args.keep)
        latest = ckpt.latest_step()
        if latest is not None:
            check_resumable(ckpt.read_meta(latest), config, tokenizer, latest)

    mesh = make_mesh(mesh_shape, outer=outer)
    log(f"{processes}; {jax.local_device_count()} local devices")
    from train.step import Trainer

    trainer = Trainer(config, optimizer_config(args), mesh, rules, args.microbatches, context_layout=layout,
                      pipeline=pipeline)
    trainer = hetero.wrap_trainer(args, trainer, log)
    built = sum(x.size for x in jax.tree.leaves(trainer.abstract_params))
    for line in report.startup_lines(config, args.model, mesh, rules, trainer.report, built):
        log(line)
    log(logits_line)
    for line in report.pipeline_lines(trainer, pipeline_note):
        log(line)
    if args.dry_run:
        return dry_run(args, trainer, log)
    try:
        code = train(args, trainer, ckpt, latest, tokenizer, mesh_shape, log)
    except BaseException:
        try:
            ckpt.close()
        except Exception as e:  # keep the first error; this one is a consequence
            print(f"note: closing the checkpoints also failed: {e}", file=sys.stderr)
        raise
    try:
        ckpt.close()
    except Exception as e:
        raise CheckpointFailure(f"finishing the checkpoints in {ckpt.directory} failed: {e}") from e
    return code


def train(args, trainer, ckpt, latest, tokenizer, mesh_shape, log) -> int:
    """Restores or initializes the state and runs the loop to ``--steps``."""
    import jax

    from sharding.devices import peak_flops
    from train.data import load_dataset
    from train.loop import LoopOptions, MetricsWriter, StopFlag, train_loop

    config, run_dir = trainer.config, Path(args.run_dir)
    with StopFlag() as stop:
        dataset = load_dataset(
            args.data, tokenizer, args.seq_len, args.batch_size, args.seed, args.heldout, args.data_cache, log,
            permutation=_context_permutation(args, trainer, mesh_shape),
        )
        if latest is not None:
            t0 = time.perf_counter()
            state, meta = trainer.restore(ckpt, latest)  # re-lays the layer stacks if saved in another layout
            samples = int(meta["data"]["samples"])
            log(f"resumed step {latest} (saved on mesh {format_mesh(meta['mesh'])}) onto mesh "
                f"{format_mesh(mesh_shape)} in {time.perf_counter() - t0:.1f} s")
            if meta.get("pipeline") != trainer.layout_meta():
                log(f"re-laid the layer stacks from stage layout {_layout_text(meta.get('pipeline'))} to "
                    f"{_layout_text(trainer.layout_meta())}")
        else:
            if args.resume:
                log(f"no checkpoint in {ckpt.directory}; starting from step 0")
            state, samples = trainer.init_state(args.seed), 0
        options = LoopOptions(
            steps=args.steps, global_batch=args.batch_size, seq_len=args.seq_len, log_every=args.log_every,
            eval_every=args.eval_every, eval_batches=args.eval_batches, ckpt_every=args.ckpt_every,
            flops_per_token=config.flops_per_token(args.seq_len), peak_flops=_peak_flops(jax.devices(), peak_flops),
            progress=not args.no_progress, skip_nonfinite=args.skip_nonfinite,
        )
        writer = MetricsWriter(run_dir, enabled=jax.process_index() == 0)
        checkpoints = _Checkpoints(ckpt, {**run_meta(args, config, mesh_shape, trainer.rules, tokenizer),
                                          "pipeline": trainer.layout_meta()})
        try:
            state, summary = train_loop(
                trainer=trainer, state=state, dataset=dataset, options=options, samples=samples,
                checkpoints=checkpoints, writer=writer, log=log, stop=stop,
            )
        finally:
            writer.close()
    t0 = time.perf_counter()
    try:
        ckpt.wait()
        ckpt.check_for_errors()
    except Exception as e:
        raise CheckpointFailure(f"the checkpoint of step {summary['step']} could not be written: {e}") from e
    where = ckpt.directory / str(summary["step"])
    if summary["step"] == summary["start_step"]:
        log(f"the latest checkpoint is still step {summary['step']} in {where}")
    elif summary["stopped_by"]:
        log(f"stopped by {summary['stopped_by']}: the checkpoint of step {summary['step']} is complete in {where} "
            f"(saved in {time.perf_counter() - t0:.1f} s); continue with --resume")
    else:
        log(f"checkpoint of step {summary['step']} complete in {where} (waited {time.perf_counter() - t0:.1f} s)")
    if summary["eval"]:
        first, last = summary["eval"][0][1], summary["eval"][-1][1]
        log(f"held-out loss {first:.4f} -> {last:.4f} over steps {summary['eval'][0][0]}-{summary['eval'][-1][0]}")
    return 0


class _Checkpoints:
    """What the loop needs from checkpoints: start a save, surface a failed one."""

    def __init__(self, manager, meta: dict):
        self.manager, self.meta = manager, meta

    def save(self, state, step: int, samples: int) -> None:
        data = {**self.meta["data"], "samples": int(samples)}
        try:
            self.manager.save(step, state, {**self.meta, "step": step, "data": data})
        except Exception as e:  # any failure to start a save ends the run with it
            raise CheckpointFailure(f"saving the checkpoint of step {step} in {self.manager.directory} failed: {e}") from e

    def check(self) -> None:
        try:
            self.manager.check_for_errors()
        except Exception as e:  # the background save's own error, raised here at once
            raise CheckpointFailure(f"a checkpoint save failed, so training stopped: {e}") from e


class CheckpointFailure(RuntimeError):
    """A checkpoint could not be written; Orbax's background threads may be stuck, so the CLI exits hard."""


def check_resumable(meta: dict, config, tokenizer, step: int) -> None:
    """Refuses a checkpoint saved with another model, tokenizer or vocabulary.

    Raises:
      ValueError: naming the differing fields, their saved and current values.
    """
    diff = config_differences(meta.get("model", {}), config)
    if diff:
        fields = ", ".join(f"{k} (saved {a!r}, now {b!r})" for k, (a, b) in diff.items())
        sets = " ".join(f"--set {k}={a}" for k, (a, _) in diff.items())
        raise ValueError(f"the checkpoint at step {step} was saved with a different model: {fields}; resume with "
                         f"--model {meta.get('preset', '?')} {sets}, or use another --run-dir")
    saved = meta.get("tokenizer", {})
    if saved.get("vocab_size") not in (None, tokenizer.vocab_size):
        raise ValueError(f"the checkpoint at step {step} was trained on a vocabulary of {saved['vocab_size']} tokens "
                         f"({saved.get('name')}); this run's tokenizer has {tokenizer.vocab_size} ({tokenizer.name}); "
                         f"pass --tokenizer {saved.get('name')}")
    if saved.get("fingerprint") not in (None, tokenizer.fingerprint):
        raise ValueError(f"the checkpoint at step {step} was trained with tokenizer {saved.get('name')!r} "
                         f"({saved.get('fingerprint')}); this run uses {tokenizer.name!r} ({tokenizer.fingerprint}); "
                         f"pass --tokenizer {saved.get('name')}")


def run_meta(args, config, mesh_shape, rules, tokenizer) -> dict:
    import jax

    return {
        "model": config.to_dict(),
        "preset": args.model,
        "mesh": dict(mesh_shape),
        "rules": {"name": rules.name, "table": rules.as_dict()},
        "data": {"spec": args.data, "seq_len": args.seq_len, "global_batch": args.batch_size, "seed": args.seed,
                 "heldout": args.heldout},
        "tokenizer": {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint,
                      "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id},
        "jax_version": jax.__version__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def dry_run(args, trainer, log) -> int:
    """Compiles one step from abstract shapes and prints the sharding, memory and collectives."""
    from train import report

    for line in report.parameter_table(trainer.report, trainer.mesh):
        log(line)
    t0 = time.perf_counter()
    compiled = trainer.compile_train_step(args.batch_size, args.seq_len)
    log(f"compiled one train step (batch {args.batch_size} x {args.seq_len}) in {time.perf_counter() - t0:.1f} s")
    for line in report.memory_lines(compiled, report.state_bytes(trainer.abstract_state()), trainer.mesh.devices.size):
        log(line)
    for line in report.collective_lines(compiled):
        log(line)
    for line in report.branch_lines(compiled, trainer):
        log(line)
    return 0


def _context_permutation(args, trainer, mesh_shape):
    """The token order of ``trainer.context_layout`` along ``--seq-len`` (None: natural)."""
    from train.data import context_permutation

    return context_permutation(args.seq_len, trainer.par.length_shards, trainer.context_layout)


def _layout_text(meta) -> str:
    from sharding.pipeline import StageLayout

    layout = StageLayout.from_meta(meta)
    return "[layers, ...] (no pipeline)" if layout is None else layout.describe()


def _peak_flops(devices, peak_flops) -> float | None:
    peaks = [peak_flops(d) for d in devices]
    return None if any(p is None for p in peaks) else float(sum(peaks))


def _logger(is_main: bool):
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


_HARD_EXIT = False  # set after a failed checkpoint save, whose Orbax threads would block a normal exit


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    code = main()
    if _HARD_EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
