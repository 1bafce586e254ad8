"""The parser of ``python -m train.train``: every flag, its default and its help, in groups.

`build_parser` is the one description of the flags: `train.setup.cli` reads a command line through it,
`train.launch` and ``python -m train.plan --layout`` reuse it, and ``docs/flags.md`` is generated from it.
"""

from __future__ import annotations

import argparse
import math

from checkpoints.argparser import Parser
from models import attention_registry
from models.config import DTYPES, LOGITS_IMPLS, PRESETS, REMAT_POLICIES
from sharding.axes import MESH_AXES
from sharding.parallel import CONTEXT_LAYOUTS, OPTIMIZER_SHARDINGS, REPLICATED
from sharding.pipeline import (
    GATHERS,
    SCHEDULES,
)
from sharding.rules import DEFAULT_PRESET
from sharding.rules import PRESETS as RULE_PRESETS
from train.runtime.optimizer import OPTIMIZERS, WSD_DECAY_FRACTION
from train.runtime.optimizer import SCHEDULES as LR_SCHEDULES
from train.setup.config import (
    DEFAULT_REBALANCE,
    DEFAULT_RUN_DIR,
)
from train.setup.flagnames import add_lora_base_dtype

DEFAULT_MODEL = "small"
"""``--model`` when neither it nor ``--init-from`` is given."""

DESCRIPTION = (
    "Trains a decoder-only LM on a named device mesh, its parameters and activations partitioned by XLA's "
    "SPMD partitioner from logical sharding rules, with sharded asynchronous checkpoints that resume onto any "
    "mesh."
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``python -m train.train`` flag."""
    p = Parser(
        prog="python -m train.train",
        description=DESCRIPTION,
        epilog="Logical axes: batch, length, embed, mlp, heads, kv_heads, head_dim, vocab, layers, act_embed, act_length. "
        "Mesh axes: data, stage, fsdp, context, sequence, tensor.",
    )
    _mesh_flags(p)
    _process_flags(p)
    _model_flags(p)
    _data_flags(p)
    _pipeline_flags(p)
    _hetero_flags(p)
    _optimizer_flags(p)
    _lora_flags(p)
    _run_flags(p)
    return p


def _mesh_flags(p) -> None:
    g = p.add_argument_group("mesh and sharding")
    g.add_argument(
        "--mesh",
        default="fsdp=-1",
        help=f"mesh axes ({', '.join(MESH_AXES)}) and sizes, e.g. data=2,fsdp=-1,tensor=2; "
        "one -1 takes the remaining devices; axes left out have size 1 (docs/sharding.md)",
    )
    g.add_argument(
        "--rules",
        default=DEFAULT_PRESET,
        choices=sorted(RULE_PRESETS),
        help="logical-to-mesh rules preset (docs/sharding.md: Sharding rules)",
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
        "--optimizer-sharding",
        default=REPLICATED,
        choices=OPTIMIZER_SHARDINGS,
        help="where the float32 parameters the optimizer updates and its moments live: replicated on every data "
        "rank, or data, a distributed optimizer (ZeRO stage 1): split over the data axis, gradients "
        "reduce-scattered and the new parameters all-gathered each step (in the compute dtype: bfloat16 halves "
        "the gather), for about the same traffic as the all-reduce; it cuts the state's memory by the data size; "
        "needs a data axis in --mesh (see docs/sharding.md)",
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
        help="rematerialisation policy per block, inside pipeline stages too (none keeps each layer's residuals, "
        "dots the products' outputs, full only its input); default: the preset's (none)",
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


def _lora_flags(p) -> None:
    g = p.add_argument_group("low-rank adapters (docs/post-training.md)")
    g.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        metavar="R",
        help="train low-rank adapters of rank R on --lora-targets and freeze every other weight (Hu et al. "
        "2021); default: none (full fine-tuning)",
    )
    g.add_argument(
        "--lora-alpha",
        type=float,
        default=None,
        metavar="A",
        help="the adapters' scale numerator: a target computes with W + (A / R) * A_lora @ B_lora; default 16",
    )
    g.add_argument(
        "--lora-targets",
        default=None,
        metavar="q,k,v,o,gate,up,down",
        help="the projections that get adapters (gate,up,down include a mixture of experts' experts); "
        "default with --lora-rank: all seven",
    )
    add_lora_base_dtype(g)


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
        help="microbatches per step; what they are depends on the layout: without a stage "
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
    g = p.add_argument_group("heterogeneous clusters (docs/heterogeneous.md)")
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
    g.add_argument(
        "--eval-batches", type=int, default=4, help="held-out batches per evaluation (0: no held-out evaluation)"
    )
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


def check_positive_counts(args: argparse.Namespace, flags) -> None:
    """Each count flag in ``flags`` (``(name, example)`` pairs, ``name`` as typed without ``--``; ``example`` a
    value, a function of ``args`` that gives one, or None for the flag's default) None or > 0.

    One check for every command that reads these flags (``train.train`` and ``python -m train.plan
    --layout``), run before the values reach a layout, so the refusal names the flag rather than a field.

    Raises:
      ValueError: ``--NAME VALUE: must be a positive integer, e.g. --NAME EXAMPLE``.
    """
    for name, example in flags:
        value = getattr(args, name.replace("-", "_"))
        if value is not None and value <= 0:
            example = example(args) if callable(example) else example
            example = example or build_parser().get_default(name.replace("-", "_"))
            raise ValueError(f"--{name} {value}: must be a positive integer, e.g. --{name} {example}")
