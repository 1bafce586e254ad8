"""The command line of ``python -m train.train``: argv -> `train.config.RunConfig`, once.

Every flag is parsed here and nowhere else: the mesh, the rules, the model, the optimizer, the pipeline
and the heterogeneous-cluster flags. Values that are wrong on their own (a malformed ``--mesh``, an
unknown ``--set`` field, a non-positive count) raise a one-line ``ValueError`` naming the flag; checks
that relate flags to each other and to the devices live in `train.checks`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from checkpoints.argparser import Parser
from models import attention_registry
from models.config import DTYPES, LOGITS_IMPLS, PRESETS, REMAT_POLICIES, get_config
from sharding import axes as ax
from sharding.mesh import format_mesh, parse_axis_sizes
from sharding.parallel import CONTEXT_LAYOUTS, Accumulation, Parallelism, UnevenBatch
from sharding.pipeline import (
    GATHERS,
    SCHEDULES,
    PipelinePlan,
    Schedule,
    example_split,
    parse_schedule,
    parse_stage_layers,
    pipeline_rules,
    plan_layout,
)
from sharding.rules import DEFAULT_PRESET, get_rules
from sharding.rules import PRESETS as RULE_PRESETS
from train.config import DEFAULT_RUN_DIR, CheckpointConfig, ClusterConfig, DataConfig, LoopConfig, RunConfig
from train.divergence import parse_max_loss
from train.optimizer import OPTIMIZERS, WSD_DECAY_FRACTION, OptimizerConfig, optimizer_hyper
from train.optimizer import SCHEDULES as LR_SCHEDULES
from train.profile import parse_profile_steps

DEFAULT_MODEL = "small"
"""``--model`` when neither it nor ``--init-from`` is given."""
HETERO_EXAMPLE = "--hetero-batch 3,3,3,3,1,1,1,1"
DEFAULT_REBALANCE = 10
"""``--rebalance-every`` with ``--hetero-batch auto``: steps between recomputing the counts."""

DESCRIPTION = (
    "Trains a decoder-only LM on a named device mesh, its parameters and activations partitioned by XLA's "
    "SPMD partitioner from logical sharding rules, with sharded asynchronous checkpoints that resume onto any "
    "mesh."
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only where it has one and the help does not already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``python -m train.train`` flag."""
    p = Parser(
        prog="python -m train.train",
        description=DESCRIPTION,
        formatter_class=_HelpFormatter,
        epilog="Logical axes: batch, length, embed, mlp, heads, kv_heads, head_dim, vocab, layers, act_embed. "
        "Mesh axes: data, stage, fsdp, context, sequence, tensor.",
    )
    _mesh_flags(p)
    _process_flags(p)
    _model_flags(p)
    _data_flags(p)
    _pipeline_flags(p)
    _hetero_flags(p)
    _optimizer_flags(p)
    _run_flags(p)
    return p


def _mesh_flags(p) -> None:
    g = p.add_argument_group("mesh and sharding")
    g.add_argument(
        "--mesh",
        default="fsdp=-1",
        help="mesh axes and sizes, e.g. data=2,fsdp=-1,tensor=2; "
        "one -1 takes the remaining devices; axes left out have size 1",
    )
    g.add_argument(
        "--rules",
        default=DEFAULT_PRESET,
        choices=sorted(RULE_PRESETS),
        help="logical-to-mesh rules preset (see README: Sharding rules)",
    )
    g.add_argument(
        "--rule",
        action="append",
        default=[],
        metavar="NAME=AXIS[+AXIS]",
        help="override one logical axis, e.g. --rule mlp=tensor+fsdp or --rule vocab=none; repeatable",
    )
    g.add_argument(
        "--mesh-outer",
        default=None,
        metavar="AXIS=N,...",
        help="how much of each axis spans processes (slow links), e.g. data=2; the rest stays inside a "
        "process; default: tensor, then sequence, then fsdp stay inside a process",
    )
    g.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        metavar="N",
        help="simulate N devices on a CPU-only machine (takes effect before JAX starts); "
        "default: the devices JAX finds (XLA_FLAGS included)",
    )
    g.add_argument(
        "--device-memory",
        default=None,
        metavar="BYTES",
        type=parse_bytes,
        help="memory one device may use, e.g. 80GiB or 5e8, checked against the compiled step before "
        "the first one; default: the allocator's limit, the datasheet, or on CPU the host's available "
        "memory shared by the simulated devices",
    )


def _process_flags(p) -> None:
    g = p.add_argument_group("several processes (one per host, jax.distributed)")
    g.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="address of process 0's coordinator; with none of these flags, JAX's own cluster "
        "detection (SLURM, Open MPI, Kubernetes) is used where it applies",
    )
    g.add_argument("--num-processes", type=int, default=None, help="number of processes in the job")
    g.add_argument("--process-id", type=int, default=None, help="this process's index, 0..N-1")
    g.add_argument("--dist-timeout", type=int, default=300, help="seconds to wait for all processes to connect")
    g.add_argument(
        "--external-coordinator",
        action="store_true",
        help="the coordination service at --coordinator runs outside the training processes (python -m "
        "train.launch starts it and gives this flag), so process 0 does not start one and losing it is survivable",
    )


def _model_flags(p) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, choices=sorted(PRESETS), help=f"model preset (default: {DEFAULT_MODEL})")
    g.add_argument(
        "--init-from",
        default=None,
        metavar="PATH",
        help="start from a Hugging Face model folder (config.json, *.safetensors): its architecture, "
        "weights and tokenizer.json, a fresh optimizer state; --dtype/--remat/--attention/--logits still "
        "apply; with --resume and a checkpoint in --run-dir, the checkpoint wins",
    )
    g.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a ModelConfig field, e.g. --set num_layers=8; repeatable",
    )
    g.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="compute dtype (parameters stay float32); default: the preset's (float32)",
    )
    g.add_argument(
        "--remat",
        default=None,
        choices=REMAT_POLICIES,
        help="rematerialisation policy per block; default: the preset's (none)",
    )
    splitting = " or ".join(k.name for k in attention_registry.KERNELS if k.traits.splits_length)
    g.add_argument(
        "--attention",
        default=None,
        choices=attention_registry.names(),
        help=f"attention implementation; "
        f"{splitting} split the length over the context and sequence mesh axes (context parallelism; usp: "
        "all-to-all over sequence, ring over context); default: the preset's (reference)",
    )
    g.add_argument(
        "--logits",
        default=None,
        choices=LOGITS_IMPLS,
        help="output projection and loss: gathered (weight gathered, GSPMD), vocab_parallel (Megatron-LM's "
        "vocabulary-parallel cross-entropy over the axes splitting the weight), auto (vocab_parallel where "
        "it moves fewer bytes); default: the preset's (auto)",
    )
    g.add_argument(
        "--context-layout",
        default="auto",
        choices=CONTEXT_LAYOUTS,
        help="how tokens lie along the context and sequence axes: zigzag (device r of the ring holds chunks r "
        "and 2P-1-r of 2P) balances causal ring attention; auto: zigzag for --attention ring or usp with the "
        "length split, else contiguous",
    )
    g.add_argument(
        "--context-shares",
        default=None,
        metavar="auto|S,S,...",
        help="uneven sequence shards for devices of unequal speed (--attention ring, zigzag): each device of the "
        "ring holds real tokens of every sequence in proportion to its share, inside equal-shaped padded blocks "
        "whose padding the kernels skip; auto: shares from the devices' measured speeds (timed as --hetero-batch "
        "auto times them), or one relative share per ring device, e.g. 2,1; default: even shards",
    )


def _data_flags(p) -> None:
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        default="stdlib",
        help="a folder made by 'python -m train.data prepare', or a raw source prepared on first use into "
        "--data-cache: 'stdlib' (this Python's standard library sources), a text file, a folder, a .jsonl file "
        "with a 'text' field (or chat 'messages') or a .parquet file with a 'text' column; or a mixture "
        "NAME=SOURCE:WEIGHT,... weighted by training tokens, e.g. web=runs/web:0.7,code=runs/code:0.3",
    )
    g.add_argument(
        "--text-field",
        default="text",
        help="JSONL field or Parquet column holding the text of a raw --data source",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="FILE",
        help="a tokenizer.json (Hugging Face tokenizers); default: UTF-8 bytes",
    )
    g.add_argument("--eod-token", default=None, help="end-of-document token of --tokenizer (default: autodetect)")
    g.add_argument("--heldout", type=float, default=0.01, help="fraction of documents held out for evaluation")
    g.add_argument(
        "--data-cache",
        default=None,
        help="folder where a raw --data is prepared into shards on first use (default: $MESHWORK_CACHE or "
        "~/.cache/meshwork)",
    )
    g.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    g.add_argument("--batch-size", type=int, default=16, help="global batch size in sequences")
    g.add_argument(
        "--microbatches",
        type=int,
        default=1,
        metavar="M",
        help="microbatches per step; what they are depends on the gradient strategy: without a stage "
        "axis or --hetero-batch, gradient-accumulation steps (the batch in M strided microbatches); with "
        "--mesh stage=N (N > 1), the pipeline's microbatches (at least N); with --hetero-batch auto or "
        "kinds, the microbatches each device runs on average (M x data x fsdp in all)",
    )


def _pipeline_flags(p) -> None:
    g = p.add_argument_group("pipeline parallelism (with --mesh stage=N, N > 1)")
    g.add_argument(
        "--pipeline-schedule",
        default="gpipe",
        choices=SCHEDULES,
        help="gpipe: each stage holds one run of layers; circular: each holds --pipeline-repeats "
        "non-adjacent chunks, shrinking the bubble (S-1)/(R*M+S-1); 1f1b: gpipe's layers, but each stage "
        "alternates one forward and one backward after warm-up, keeping S microbatches' activations "
        "instead of M (loss on the last stage, inside the pipeline); 1f1b-fused: 1f1b with a forward and a "
        "backward in every tick, about M+2(S-1) ticks of a forward+backward instead of 2(M+S-1) of a "
        "backward, keeping up to 2S-1 microbatches' activations on the first stage; zb: zero bubble "
        "(ZB-H1), 1f1b-fused's ticks with the backward split into the input gradient and a weight "
        "gradient (the weight products alone, from what the input gradient kept) deferred into the idle "
        "ticks; 1f1b-fused's ring plus S sets of each layer's product inputs and output cotangents",
    )
    g.add_argument(
        "--pipeline-gather",
        default="once",
        choices=GATHERS,
        help="once: each stage all-gathers its layers (in the compute dtype) before the step's loop and sums "
        "their gradients whole, holding both through the step; microbatch: one layer at a time, gathered "
        "where a microbatch runs it and its gradient reduce-scattered there (the layers stored with their "
        "features split over fsdp), so the step holds one layer instead of the stage's, for a gather per "
        "microbatch pass (fsdp; any schedule); under 1f1b, 1f1b-fused and zb the output head's weights too, "
        "gathered on the last stage at each microbatch's head step instead of held whole through the loop, and "
        "the embedding, run on the first stage per microbatch instead of on the whole batch before the loop "
        "(no stage inputs of all M microbatches held)",
    )
    g.add_argument(
        "--pipeline-repeats",
        type=int,
        default=None,
        metavar="R",
        help="chunks per stage for --pipeline-schedule circular (default 2; gpipe: 1) or 1f1b and 1f1b-fused "
        "(default 1; more is interleaved 1F1B, with --microbatches a multiple of the stages; zb: 1)",
    )
    g.add_argument(
        "--stage-layers",
        default=None,
        metavar="auto|N,N,...",
        help="layers per stage, e.g. 10,10,6,6 for 32 layers on stage=4 (must sum to the model's layers); "
        "circular also takes one count per chunk (S*R); auto: time each stage's devices at start-up and give "
        "faster stages more layers (gpipe); default: even, the first stages taking the rest",
    )


def _hetero_flags(p) -> None:
    g = p.add_argument_group("heterogeneous clusters (README: Heterogeneous clusters)")
    g.add_argument(
        "--cluster",
        default=None,
        metavar="SPEC|FILE",
        help="the cluster, for --plan auto: KIND:COUNT per host, e.g. h100:8,a100:8[@400Gbps], or a "
        "JSON/YAML inventory file; default: detected from the devices",
    )
    g.add_argument(
        "--simulate-cluster",
        default=None,
        metavar="SPEC",
        help="pretend the (CPU) devices are this cluster, e.g. h100:4,a100:4 on 8 devices: their kinds "
        "set --hetero-batch kinds' shares and --plan auto's cluster",
    )
    g.add_argument(
        "--hetero-batch",
        default="off",
        metavar="auto|kinds|off|KIND=N,...|COUNTS",
        help="uneven data parallelism: microbatches per data-parallel group along data x fsdp (each "
        "shared by the group's tensor devices), proportional to "
        "device speed (auto: measured at start-up; kinds: the device kinds' datasheet peaks), given per "
        "device kind (e.g. h100=25,a100=7: each group the count of its slowest device's kind) or per group "
        "(e.g. 3,3,3,3,1,1,1,1; microbatch = --batch-size / their sum); data/fsdp/tensor meshes",
    )
    g.add_argument(
        "--hetero-max-share",
        type=int,
        default=None,
        metavar="N",
        help="uneven data parallelism: the most microbatches one device may be given without recompiling "
        "the step (its padded buffer); default twice the mean per device, at least the largest count",
    )
    g.add_argument(
        "--rebalance-every",
        type=int,
        default=None,
        metavar="N",
        help="uneven data parallelism: every N steps, recompute the counts from each device's timed "
        f"microbatch loop (smoothed, with hysteresis); default {DEFAULT_REBALANCE} with --hetero-batch "
        "auto, off otherwise",
    )
    g.add_argument(
        "--plan",
        default=None,
        choices=("auto",),
        help="choose --mesh, --rules, --microbatches, --remat, --hetero-batch and the pipeline's flags "
        "(--stage-layers, --pipeline-schedule, --pipeline-repeats, --pipeline-gather) with the planner "
        "(python -m train.plan) for --cluster/--simulate-cluster; giving one of them too is refused",
    )


def _optimizer_flags(p) -> None:
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=150, help="train until this step")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument(
        "--optimizer",
        default="adamw",
        choices=OPTIMIZERS,
        help="adamw; lion (its --lr is usually 3-10x smaller than AdamW's); sgd "
        "(momentum --beta1); adafactor (factored second moment; --lr relative to each parameter's RMS); all "
        "optax's, after clipping to --grad-clip, with --weight-decay on matrices",
    )
    g.add_argument(
        "--schedule",
        default="cosine",
        choices=LR_SCHEDULES,
        help="after the linear warmup: cosine or linear decay to 10%% of --lr at --decay-steps, or wsd "
        f"(warmup-stable-decay: --lr until the last {WSD_DECAY_FRACTION * 100:.0f}%% of the steps, then linear)",
    )
    g.add_argument(
        "--beta1",
        type=float,
        default=None,
        help="first-moment decay of adamw and lion, momentum of sgd, in [0, 1) (default: 0.9)",
    )
    g.add_argument(
        "--beta2",
        type=float,
        default=None,
        help="second-moment decay of adamw (default 0.95) and lion (default 0.99), in [0, 1)",
    )
    g.add_argument("--eps", type=float, default=None, help="adamw's epsilon, > 0 (default: 1e-8; adafactor's 1e-30)")
    g.add_argument("--warmup", type=int, default=None, help="linear warmup steps (default: 5%% of the schedule)")
    g.add_argument("--decay-steps", type=int, default=None, help="length of the cosine schedule (default: --steps)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay (matrices only)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip gradients to this global norm")
    g.add_argument("--seed", type=int, default=0, help="seed for parameters, data order and held-out split")
    g.add_argument(
        "--skip-nonfinite",
        type=int,
        default=0,
        metavar="N",
        help="skip (and log) up to N steps whose loss is NaN or infinite; past that the run stops, "
        "keeping its last good checkpoint",
    )
    g.add_argument(
        "--max-loss",
        default="auto",
        metavar="auto|off|X",
        help="stop the run, as a non-finite loss does, when a step's training loss exceeds X (nats per "
        "token); the checkpoint saved from the parameters that produced it is set aside (renamed "
        "STEP.diverged-TIME), so the last one kept is from before the divergence; auto: the larger of 2x "
        "this run's first recorded loss and 1.5 x ln(vocabulary size), the loss of a uniform guess; off: "
        "never (default: auto)",
    )


def _run_flags(p) -> None:
    g = p.add_argument_group("run folder, checkpoints, logging")
    g.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="read flags from a TOML file (keys: flag names without the dashes, e.g. seq-len = 128; true "
        "for a switch; a list for a repeatable flag); flags on the command line override it; without it, "
        "--resume reads the run folder's config.json (docs/training.md: Config files)",
    )
    g.add_argument(
        "--run-dir",
        default=DEFAULT_RUN_DIR,
        help="folder for checkpoints and metrics (and config.json, the command line and every flag's value)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --run-dir "
        "(onto the current mesh and rules); starts fresh if there is none",
    )
    g.add_argument(
        "--resume-step",
        type=int,
        default=None,
        metavar="N",
        help="with --resume, continue from this step instead of the newest complete one",
    )
    g.add_argument(
        "--discard-later",
        action="store_true",
        help="with --resume-step N, set the steps after N aside (renamed STEP.discarded-TIME, nothing "
        "deleted) instead of refusing to resume below them",
    )
    g.add_argument(
        "--break-lock",
        action="store_true",
        help="take over --run-dir's lock when its owner runs on another host (which cannot be checked "
        "from here); only once that run has ended",
    )
    g.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints (0: only at the end)")
    g.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    g.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations (0: first/last)")
    g.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation")
    g.add_argument("--log-every", type=int, default=10, help="steps between log lines")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--profile-steps",
        default=None,
        metavar="A:B",
        help="write a jax.profiler trace of steps A to B (or A alone) to RUN_DIR/profile, for TensorBoard "
        "(tensorboard --logdir RUN_DIR/profile) or Perfetto (its .trace.json.gz); default: no trace",
    )
    g.add_argument(
        "--wandb",
        action="store_true",
        help="also log the metrics to Weights & Biases, a run per session named after --run-dir (needs pip "
        "install 'meshwork[wandb]'; project, entity and mode from wandb's variables: WANDB_PROJECT, "
        "WANDB_MODE=offline, ...)",
    )
    g.add_argument(
        "--mlflow",
        action="store_true",
        help="also log the metrics to MLflow, a run per session named after --run-dir (needs pip install "
        "'meshwork[mlflow]'; server and experiment from MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME, "
        "default store RUN_DIR/mlflow.db)",
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="compile one step, print the sharding, memory and collectives report, and exit without training",
    )


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

    from train import configfile

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
    model, preset, tokenizer, eod = _model_and_tokenizer(args, execution)
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


def _model_and_tokenizer(args, execution: dict) -> tuple:
    """``(model, preset, tokenizer, eod_token)``: from ``--model``/``--set``, or from ``--init-from``'s folder
    (its ``config.json`` and, unless ``--tokenizer`` says otherwise, its ``tokenizer.json``; the preset
    recorded as ``hf:PATH``)."""
    if args.init_from is None:
        preset = args.model or DEFAULT_MODEL
        return get_config(preset, args.set, **execution), preset, args.tokenizer, args.eod_token
    from checkpoints import hf

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
    for name in (
        "seq-len",
        "batch-size",
        "microbatches",
        "steps",
        "log-every",
        "eval-batches",
        "cpu-devices",
        "pipeline-repeats",
    ):
        value = getattr(args, name.replace("-", "_"))
        if value is not None and value <= 0:
            raise ValueError(f"--{name} {value}: must be a positive integer")
    for name in ("ckpt-every", "eval-every", "skip-nonfinite"):
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
        parse_axis_sizes(args.mesh_outer, flag="--mesh-outer", allow_fill=False)
    args_distributed = ClusterConfig(
        coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        dist_timeout=args.dist_timeout,
        external_coordinator=args.external_coordinator,
    )
    args_distributed.distributed().validate()
    if args.cluster:
        from sharding.devices import inventory_from_flag

        inventory_from_flag(args.cluster)
    if args.simulate_cluster:
        from sharding.devices import parse_cluster

        parse_cluster(args.simulate_cluster)


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


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str, flag: str = "--device-memory", example: str = "80GiB") -> int:
    """``--device-memory`` (or ``flag``): ``80GiB``, ``16GB``, ``5e8`` -> bytes (argparse reports a ValueError as a
    usage error).

    Raises:
      ValueError: Not a positive finite number with one of the units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    import re

    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    try:
        value = float(match.group(1)) * _UNITS[unit] if match else float("nan")
    except (ValueError, KeyError):
        value = float("nan")
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes > 0, e.g. {flag} {example}")
    return int(value)


def parallelism_from_args(args, num_layers: int) -> Parallelism:
    """The `Parallelism` of the mesh, rules, pipeline and ``--hetero-batch`` flags (mesh not yet resolved).

    Raises:
      ValueError: A malformed ``--mesh``/``--mesh-outer``/``--rule``/``--stage-layers``/``--hetero-batch``,
        pipeline flags without a stage axis, or flags of two strategies at once; naming the flags.
    """
    sizes = parse_axis_sizes(args.mesh if args.mesh.strip() else "fsdp=-1")
    outer = parse_axis_sizes(args.mesh_outer, flag="--mesh-outer", allow_fill=False) if args.mesh_outer else None
    rules = get_rules(args.rules, args.rule)
    strategy = _strategy(args, sizes, num_layers)
    if strategy.pipeline is not None:
        rules = pipeline_rules(rules)
    shares = parse_context_shares(getattr(args, "context_shares", None), args.seq_len)
    return Parallelism(sizes, rules, strategy, args.context_layout, outer, context_shares=shares)


CONTEXT_SHARES_EXAMPLE = "--context-shares 2,1"


def parse_context_shares(value: str | None, seq_len: int) -> tuple[int, ...] | str | None:
    """``--context-shares auto|S,S,...`` -> ``"auto"``, the real tokens of a sequence per ring device (relative
    shares turned into even token counts summing to ``seq_len``, `sharding.balance.tokens_for_speeds`), or
    None (not given).

    Raises:
      ValueError: Not ``auto`` nor positive numbers, or a ``--seq-len`` that is odd; naming the flag and a
        value that works.
    """
    from sharding.balance import tokens_for_speeds

    if value is None or value.strip() == "":
        return None
    if value.strip() == "auto":
        return "auto"
    try:
        weights = [float(x) for x in value.split(",")]
    except ValueError:
        weights = []
    if len(weights) < 2 or not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(
            f"--context-shares {value}: expected auto or positive relative shares, one per device of the ring "
            f"(at least 2), e.g. {CONTEXT_SHARES_EXAMPLE}"
        )
    if seq_len % 2:
        raise ValueError(
            f"--context-shares needs an even --seq-len (two zigzag chunks a device); e.g. --seq-len {seq_len + 1}"
        )
    return tokens_for_speeds(seq_len, weights)


# the flags whose values --plan auto chooses (train.plan.apply_plan replaces them): given with it, they would be
# dropped without a word
PLANNED_FLAGS = (
    "mesh",
    "rules",
    "microbatches",
    "remat",
    "stage_layers",
    "pipeline_schedule",
    "pipeline_repeats",
    "pipeline_gather",
)


def _check_planned(args) -> None:
    """``--plan auto`` with a flag it chooses itself (``--mesh data=8``) is refused, naming the flag.

    Raises:
      ValueError: Naming the first such flag and its value, and both ways out.
    """
    if not args.plan:
        return
    parser = build_parser()
    for dest in PLANNED_FLAGS:
        value = getattr(args, dest)
        if value != parser.get_default(dest):
            flag = "--" + dest.replace("_", "-")
            raise ValueError(
                f"--plan auto chooses {flag} itself; drop {flag} {value}, or drop --plan auto to run with it"
            )


def _strategy(args, sizes: dict[str, int], num_layers: int):
    _check_planned(args)
    stages = sizes[ax.STAGE]
    if stages == -1:
        more = "" if args.microbatches >= 2 else " --microbatches 2"  # a pipeline needs a microbatch per stage
        raise ValueError(f"--mesh stage=-1: give the pipeline's stage count, e.g. --mesh stage=2,fsdp=-1{more}")
    if num_layers < stages:
        # the whole mesh: fewer stages alone would leave devices out, which the device count check refuses
        good = max(d for d in range(1, num_layers + 1) if stages % d == 0)
        fsdp = sizes.get(ax.FSDP, 1)
        fixed = {**sizes, ax.STAGE: good, ax.FSDP: fsdp if fsdp == -1 else fsdp * (stages // good)}
        raise ValueError(
            f"--mesh {format_mesh(sizes)}: the model has {num_layers} layers, fewer than the {stages} stages; use "
            f"--mesh {format_mesh(fixed)} (or more layers, --set num_layers={stages})"
        )
    uneven = _rebalance(parse_hetero_batch(args.hetero_batch, args.microbatches), args.rebalance_every)
    if args.hetero_max_share is not None:
        if uneven is None or args.hetero_max_share < 1:
            raise ValueError(
                f"--hetero-max-share {args.hetero_max_share} needs --hetero-batch and a value >= 1, "
                f"e.g. --hetero-batch auto --hetero-max-share 4"
            )
        uneven = dataclasses.replace(uneven, capacity=args.hetero_max_share)
    if args.plan and uneven is not None and uneven.speeds == "given":
        raise ValueError(f"--plan auto chooses --hetero-batch itself; drop --hetero-batch {args.hetero_batch}")
    if stages == 1:
        schedule = args.pipeline_schedule != "gpipe"
        given = [
            flag
            for flag, on in (
                ("--stage-layers", args.stage_layers),
                (f"--pipeline-schedule {args.pipeline_schedule}", schedule),
                ("--pipeline-repeats", args.pipeline_repeats),
                (f"--pipeline-gather {args.pipeline_gather}", args.pipeline_gather != "once"),
            )
            if on
        ]
        if given:
            raise ValueError(f"{given[0]} needs a pipeline: add a stage axis to --mesh, e.g. --mesh stage=2,fsdp=-1")
        return uneven if uneven is not None else Accumulation(args.microbatches)
    if uneven is not None:
        raise ValueError(
            f"--hetero-batch supports meshes over data, fsdp and tensor only; --mesh splits "
            f"stage={stages}. Use e.g. --mesh data=-1 --rules dp, or --hetero-batch off"
        )
    return pipeline_plan(args, stages, num_layers)


def pipeline_plan(args, stages: int, num_layers: int) -> PipelinePlan:
    """The `PipelinePlan` of ``--pipeline-schedule``, ``--pipeline-repeats`` and ``--stage-layers``.

    Raises:
      ValueError: ``--pipeline-repeats`` that does not fit the schedule, or as
        `sharding.pipeline.plan_layout`; naming the flag, its value and one that works.
    """
    schedule = parse_schedule(args.pipeline_schedule)
    circular = schedule is Schedule.CIRCULAR
    one_f_one_b = schedule.one_f_one_b
    repeats = args.pipeline_repeats or (2 if circular else 1)
    if one_f_one_b and repeats < 1:
        raise ValueError(f"--pipeline-repeats {repeats}: must be at least 1 (1f1b; more is interleaved 1F1B)")
    if not circular and not one_f_one_b and repeats != 1:
        raise ValueError(
            f"--pipeline-repeats {repeats} needs --pipeline-schedule circular, 1f1b or 1f1b-fused (interleaved); "
            "gpipe has 1 repeat; e.g. --pipeline-schedule 1f1b"
        )
    if args.pipeline_schedule == "zb" and repeats != 1:
        raise ValueError(
            f"--pipeline-repeats {repeats}: --pipeline-schedule zb runs one chunk per stage (ZB-H1); use "
            "--pipeline-repeats 1, or --pipeline-schedule 1f1b-fused for interleaved chunks"
        )
    if circular and repeats < 2:
        raise ValueError(
            "--pipeline-schedule circular needs --pipeline-repeats of 2 or more, e.g. --pipeline-repeats 2 "
            "(1 repeat is --pipeline-schedule gpipe)"
        )
    if circular and stages <= num_layers < 2 * stages:
        # plan_layout would suggest the repeats that fit, 1, which circular refuses just above
        raise ValueError(
            f"--pipeline-schedule circular: {stages} stages x {repeats} repeats = {stages * repeats} chunks, more "
            f"than the {num_layers} layers, and circular needs 2 or more per stage; use --pipeline-schedule gpipe"
        )
    measure = args.stage_layers is not None and args.stage_layers.strip() == "auto"
    if measure and args.pipeline_schedule != "gpipe":
        # auto prices GPipe's step: every stage's layers plus its 1/S share of the head (1F1B runs the head on
        # the last stage, circular splits chunks), so another schedule would get a split made for GPipe.
        raise ValueError(
            f"--stage-layers auto times the stages for --pipeline-schedule gpipe; with "
            f"{args.pipeline_schedule} give the layers by hand, e.g. --stage-layers "
            f"{example_split(num_layers, stages)}, or use --pipeline-schedule gpipe"
        )
    layout, _ = plan_layout(
        num_layers, stages, repeats, None if measure else parse_stage_layers(args.stage_layers, num_layers, stages)
    )
    return PipelinePlan(
        layout,
        args.microbatches,
        schedule=schedule,
        measure_stages=measure,
        gather=args.pipeline_gather,
    )


def _rebalance(uneven: UnevenBatch | None, every: int | None) -> UnevenBatch | None:
    """``--rebalance-every`` onto the uneven strategy (default on with measured speeds)."""
    if every is None:
        on = uneven is not None and uneven.speeds == "measured"
        return dataclasses.replace(uneven, rebalance_every=DEFAULT_REBALANCE) if on else uneven
    if every < 1 or uneven is None:
        raise ValueError(
            f"--rebalance-every {every}: needs --hetero-batch and N >= 1 steps, e.g. --hetero-batch "
            f"auto --rebalance-every {DEFAULT_REBALANCE}"
        )
    return dataclasses.replace(uneven, rebalance_every=every)


KIND_COUNTS_EXAMPLE = "--hetero-batch h100=25,a100=7"


def parse_kind_counts(value: str) -> tuple[tuple[str, int], ...]:
    """``KIND=COUNT,...`` (``--hetero-batch h100=25,a100=7``) -> ``((kind name, count), ...)``, a known kind by
    its table name (`sharding.devices.get_kind`: ``h100`` -> ``h100_sxm``), another (a cluster file's) as
    written; kinds missing from the mesh are named at start-up.

    Raises:
      ValueError: An empty kind, a kind named twice, a count that is not an integer >= 0, or all 0; naming
        the flag.
    """
    from sharding.devices import get_kind

    out: dict[str, int] = {}
    for item in value.split(","):
        name, _, count = item.partition("=")
        try:
            kind = get_kind(name.strip()).name
        except ValueError:  # a kind of a cluster file's own: checked against the mesh's kinds at start-up
            kind = name.strip()
        if not kind:
            raise ValueError(f"--hetero-batch {value}: a kind name before each '=' ({KIND_COUNTS_EXAMPLE})")
        try:
            n = int(count)
        except ValueError:
            n = -1
        if n < 0 or kind in out:
            raise ValueError(
                f"--hetero-batch {value}: each kind once with a count >= 0, KIND=COUNT ({KIND_COUNTS_EXAMPLE})"
            )
        out[kind] = n
    if not any(out.values()):
        raise ValueError(f"--hetero-batch {value}: counts must not all be 0 ({KIND_COUNTS_EXAMPLE})")
    return tuple(out.items())


def parse_hetero_batch(value: str, microbatches: int = 1) -> UnevenBatch | None:
    """``--hetero-batch off|auto|kinds|KIND=COUNT,...|COUNTS`` -> `UnevenBatch` (None for ``off``).

    ``auto`` measures the devices at start-up (`train.calibrate`), ``kinds`` takes speeds from the devices'
    kinds (datasheet peaks; ``--simulate-cluster`` on CPU); both ``microbatches`` per device on average.
    ``KIND=COUNT,...`` gives each data-parallel group the count of its slowest device's kind
    (`parse_kind_counts`, resolved at start-up).

    Raises:
      ValueError: Counts that are not integers, negative, or all zero; naming the flag.
    """
    text = value.strip().lower()
    if text == "off":
        return None
    if text in ("auto", "kinds"):
        return UnevenBatch(None, "measured" if text == "auto" else "kinds", microbatches)
    if "=" in text:
        return UnevenBatch(None, "given", microbatches, kind_counts=parse_kind_counts(value))
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(
            f"--hetero-batch {value!r}: expected auto, kinds, off or comma-separated integers ({HETERO_EXAMPLE})"
        ) from None
    if any(c < 0 for c in counts) or sum(counts) == 0:
        raise ValueError(f"--hetero-batch {value}: counts must be >= 0 and not all 0 ({HETERO_EXAMPLE})")
    return UnevenBatch(counts, "given", microbatches)
