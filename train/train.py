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

from models.config import ATTENTION_IMPLS, DTYPES, PRESETS, REMAT_POLICIES, config_differences, get_config
from sharding.mesh import format_mesh, parse_axis_sizes, parse_mesh
from sharding.rules import DEFAULT_PRESET, PRESETS as RULE_PRESETS, get_rules
from train.optimizer import OptimizerConfig

DEFAULT_RUN_DIR = "runs/default"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.train",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
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
    g.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                   help="simulate N devices on a CPU-only machine (takes effect before JAX starts); "
                   "default: the devices JAX finds (XLA_FLAGS included)")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="small", choices=sorted(PRESETS), help="model preset")
    g.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelConfig field, e.g. --set num_layers=8; repeatable")
    g.add_argument("--dtype", default=None, choices=DTYPES, help="compute dtype (parameters stay float32); "
                   "default: the preset's (float32)")
    g.add_argument("--remat", default=None, choices=REMAT_POLICIES, help="rematerialisation policy per block")
    g.add_argument("--attention", default=None, choices=ATTENTION_IMPLS, help="attention implementation")
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
    g.add_argument("--microbatches", type=int, default=1, help="gradient-accumulation steps per batch")
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=150, help="train until this step")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup", type=int, default=None, help="linear warmup steps (default: 5%% of the schedule)")
    g.add_argument("--decay-steps", type=int, default=None, help="length of the cosine schedule (default: --steps)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decoupled weight decay (matrices only)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip gradients to this global norm")
    g.add_argument("--seed", type=int, default=0, help="seed for parameters, data order and held-out split")
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
    _positive(args, "seq-len", "batch-size", "microbatches", "steps", "log-every", "eval-batches", "cpu-devices")
    for name in ("ckpt-every", "eval-every"):
        if getattr(args, name.replace("-", "_")) < 0:
            raise ValueError(f"--{name} must be >= 0")
    parse_axis_sizes(args.mesh)
    get_rules(args.rules, args.rule)
    model_config(args)
    optimizer_config(args).validate()


def model_config(args):
    changes = {k: v for k, v in (("dtype", args.dtype), ("remat", args.remat), ("attention", args.attention)) if v}
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


def check_batch(args, mesh_shape: dict[str, int]) -> None:
    """Batch and length divisibility against the mesh (before any device work)."""
    dp = mesh_shape["data"] * mesh_shape["fsdp"]
    if args.batch_size % args.microbatches:
        raise ValueError(
            f"--batch-size {args.batch_size} is not divisible by --microbatches {args.microbatches}; "
            f"e.g. --batch-size {args.microbatches * max(args.batch_size // args.microbatches, 1)}"
        )
    per_micro = args.batch_size // args.microbatches
    if per_micro % dp:
        good = dp * args.microbatches * max(1, round(args.batch_size / (dp * args.microbatches)))
        raise ValueError(
            f"--batch-size {args.batch_size} / --microbatches {args.microbatches} = {per_micro} sequences per "
            f"microbatch, not divisible by the data-parallel size data x fsdp = {dp} of --mesh {args.mesh}; "
            f"e.g. --batch-size {good}"
        )
    if args.seq_len % mesh_shape["sequence"]:
        raise ValueError(
            f"--seq-len {args.seq_len} is not divisible by the sequence axis ({mesh_shape['sequence']}) of --mesh"
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        validate_args(args)
        return run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    setup_devices(args.cpu_devices)
    import jax

    from checkpoints.manager import CheckpointManager
    from sharding.devices import peak_flops
    from sharding.mesh import make_mesh
    from train import report
    from train.data import corpus_files, load_dataset
    from train.loop import LoopOptions, MetricsWriter, StopFlag, train_loop
    from train.step import Trainer
    from train.tokenizer import load_tokenizer

    is_main = jax.process_index() == 0
    log = _logger(is_main)
    config = model_config(args)
    mesh_shape = parse_mesh(args.mesh, jax.device_count())
    check_batch(args, mesh_shape)
    rules = get_rules(args.rules, args.rule)
    tokenizer = load_tokenizer(args.tokenizer, args.eod_token)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {config.vocab_size}; "
            f"pass --set vocab_size={-(-tokenizer.vocab_size // 128) * 128}"
        )
    if not args.dry_run:
        corpus_files(args.data)  # a missing or empty corpus fails before any device work

    mesh = make_mesh(mesh_shape)
    trainer = Trainer(config, optimizer_config(args), mesh, rules, args.microbatches)
    built = sum(x.size for x in jax.tree.leaves(trainer.abstract_params))
    for line in report.startup_lines(config, args.model, mesh, rules, trainer.report, built):
        log(line)
    if args.dry_run:
        return dry_run(args, trainer, log)

    run_dir = Path(args.run_dir)
    ckpt = CheckpointManager(run_dir / "checkpoints", keep=args.keep)
    latest = ckpt.latest_step()
    if latest is not None and not args.resume:
        raise ValueError(
            f"--run-dir {run_dir} already holds checkpoints (latest step {latest}); pass --resume to continue "
            f"that run, or choose another --run-dir (nothing was overwritten)"
        )
    dataset = load_dataset(
        args.data, tokenizer, args.seq_len, args.batch_size, args.seed, args.heldout, args.data_cache, log
    )
    if latest is not None:
        state, samples = restore(ckpt, trainer, config, tokenizer, latest, log)
    else:
        if args.resume:
            log(f"no checkpoint in {run_dir / 'checkpoints'}; starting from step 0")
        state, samples = trainer.init_state(args.seed), 0

    meta = run_meta(args, config, mesh_shape, rules, tokenizer)

    def save(state, step, samples):
        ckpt.save(step, state, {**meta, "step": step, "data": {**meta["data"], "samples": int(samples)}})

    peak = _peak_flops(jax.devices(), peak_flops)
    options = LoopOptions(
        steps=args.steps, global_batch=args.batch_size, seq_len=args.seq_len, log_every=args.log_every,
        eval_every=args.eval_every, eval_batches=args.eval_batches, ckpt_every=args.ckpt_every,
        flops_per_token=config.flops_per_token(args.seq_len), peak_flops=peak, progress=not args.no_progress,
    )
    writer = MetricsWriter(run_dir, enabled=is_main)
    try:
        with StopFlag() as stop:
            state, summary = train_loop(
                trainer=trainer, state=state, dataset=dataset, options=options, samples=samples,
                save=save, writer=writer, log=log, stop=stop,
            )
        t0 = time.perf_counter()
        ckpt.wait()
        log(f"checkpoint of step {summary['step']} complete in {ckpt.directory} "
            f"(waited {time.perf_counter() - t0:.1f} s)")
    finally:
        ckpt.close()
        writer.close()
    if summary["eval"]:
        first, last = summary["eval"][0][1], summary["eval"][-1][1]
        log(f"held-out loss {first:.4f} -> {last:.4f} over steps {summary['eval'][0][0]}-{summary['eval'][-1][0]}")
    return 0


def restore(ckpt, trainer, config, tokenizer, step: int, log):
    """Restores ``step`` onto the trainer's mesh after checking it fits this run."""
    meta = ckpt.read_meta(step)
    diff = config_differences(meta.get("model", {}), config)
    if diff:
        fields = ", ".join(f"{k} (saved {a!r}, now {b!r})" for k, (a, b) in diff.items())
        raise ValueError(f"the checkpoint at step {step} was saved with a different model: {fields}; "
                         "resume with the same --model/--set, or use another --run-dir")
    saved_tok = meta.get("tokenizer", {})
    if saved_tok and saved_tok.get("fingerprint") != tokenizer.fingerprint:
        raise ValueError(f"the checkpoint at step {step} was trained with tokenizer {saved_tok.get('name')!r} "
                         f"({saved_tok.get('fingerprint')}); this run uses {tokenizer.name!r} ({tokenizer.fingerprint})")
    t0 = time.perf_counter()
    state, meta = ckpt.restore(trainer.abstract_state(), step)
    log(f"resumed step {step} (saved on mesh {format_mesh(meta['mesh'])}) onto mesh "
        f"{format_mesh(dict(trainer.mesh.shape))} in {time.perf_counter() - t0:.1f} s")
    return state, int(meta["data"]["samples"])


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
    return 0


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


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
