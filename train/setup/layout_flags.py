"""The layout's flags into a `sharding.parallel.Parallelism`: the mesh, the rules, the strategy value, the
pipeline and the context layout.

The one home of the layout's flags: `LAYOUT_FLAGS` and its named parts (the pipeline's, the uneven
strategy's, the context layout's, the cluster's), from which the command line's other lists derive (the
flags ``--plan auto`` chooses, the flags ``python -m train.plan --layout`` prices, the group a resume
takes from the run record as a whole). `strategy_from_args` is the one place that builds the strategy
value and the pipeline from them.
"""

from __future__ import annotations

import dataclasses
import math

from sharding import axes as ax
from sharding.balance import tokens_for_speeds
from sharding.devices import get_kind
from sharding.mesh import format_mesh, parse_axis_sizes
from sharding.parallel import Accumulation, Parallelism, Strategy, UnevenBatch
from sharding.pipeline import (
    PipelinePlan,
    Schedule,
    example_split,
    parse_schedule,
    parse_stage_layers,
    pipeline_rules,
    plan_layout,
)
from sharding.rules import get_rules
from train.setup.config import DEFAULT_REBALANCE
from train.setup.parser import build_parser

HETERO_EXAMPLE = "--hetero-batch 3,3,3,3,1,1,1,1"

# The layout's flags (argparse destinations), in parts; every list of them the command line uses derives from these.
MESH_FLAGS = ("mesh", "rules", "rule", "mesh_outer")
"""The mesh, the rules over it, and the mesh's split into hosts."""
PIPELINE_FLAGS = ("stage_layers", "pipeline_schedule", "pipeline_repeats", "pipeline_gather")
"""A pipeline's plan over the ``stage`` axis (`pipeline_plan`)."""


def default_repeats(args) -> int:
    """``--pipeline-repeats`` when it is not given: 2 chunks per stage for ``--pipeline-schedule circular``
    (which needs 2 or more), 1 for every other schedule."""
    return 2 if parse_schedule(args.pipeline_schedule) is Schedule.CIRCULAR else 1


LAYOUT_COUNTS = (("microbatches", None), ("pipeline-repeats", default_repeats))
"""The layout's count flags, each with the example a refusal gives (None: the flag's default; a function
of the arguments: the value that fits them), for `train.setup.parser.check_positive_counts`."""
UNEVEN_FLAGS = ("hetero_batch", "hetero_max_share", "rebalance_every")
"""The uneven strategy's counts per data-parallel group (`uneven_from_args`)."""
CONTEXT_FLAGS = ("context_layout", "context_shares")
"""The order and shares of the length over the context-parallel ring."""
CLUSTER_FLAGS = ("cluster", "simulate_cluster")
"""Which devices the layout is for: ``--plan auto`` and ``--hetero-batch kinds`` read their kinds from them."""
OPTIMIZER_SHARDING_FLAGS = ("optimizer_sharding",)
"""Where the optimizer's float32 state lives (`sharding.zero`)."""
EXECUTION_FLAGS = ("remat", "attention", "dtype", "logits")
"""How the model runs on the layout (not part of a `Parallelism`, but priced with it)."""

LAYOUT_FLAGS = (*MESH_FLAGS, "microbatches", *PIPELINE_FLAGS, *UNEVEN_FLAGS, *CONTEXT_FLAGS, *OPTIMIZER_SHARDING_FLAGS)
"""Every flag `parallelism_from_args` reads into the run's `Parallelism`."""
RECORDED_LAYOUT_FLAGS = (
    *MESH_FLAGS,
    "plan",
    "microbatches",
    *PIPELINE_FLAGS,
    *UNEVEN_FLAGS,
    *CONTEXT_FLAGS,
    *CLUSTER_FLAGS,
    *OPTIMIZER_SHARDING_FLAGS,
)
"""The layout as a whole in the run record (`train.setup.configfile`): a command line that names one of them
re-lays the run (resume onto another mesh), and the record's are not taken (its stage split or counts would not
fit the new mesh). ``--plan`` and the cluster flags belong to it: ``--plan auto`` and ``--hetero-batch kinds``
read the kinds from them."""
PRICED_FLAGS = frozenset((*LAYOUT_FLAGS, *EXECUTION_FLAGS))
"""The flags ``python -m train.plan --layout`` takes: the layout and its execution."""
PLANNED_FLAGS = ("mesh", "rules", "microbatches", "remat", *PIPELINE_FLAGS, *OPTIMIZER_SHARDING_FLAGS)
"""The flags whose values ``--plan auto`` chooses (`train.setup.auto_plan.apply_plan` replaces them): given with it, they
would be dropped without a word, so they are refused (`_check_planned`)."""


def parallelism_from_args(args, num_layers: int) -> Parallelism:
    """The `Parallelism` of the mesh, rules, pipeline and ``--hetero-batch`` flags (mesh not yet resolved).

    Raises:
      ValueError: A malformed ``--mesh``/``--mesh-outer``/``--rule``/``--stage-layers``/``--hetero-batch``,
        pipeline flags without a stage axis, flags of two strategies at once, or ``--optimizer-sharding data``
        on a mesh without a ``data`` axis (`check_optimizer_sharding`); naming the flags.
    """
    sizes = parse_axis_sizes(args.mesh)
    outer = parse_axis_sizes(args.mesh_outer, field="mesh_outer", allow_fill=False) if args.mesh_outer else None
    rules = get_rules(args.rules, args.rule)
    strategy, plan = strategy_from_args(args, sizes, num_layers)
    check_optimizer_sharding(args.optimizer_sharding, sizes)
    if plan is not None:
        rules = pipeline_rules(rules)
    shares = parse_context_shares(getattr(args, "context_shares", None), args.seq_len)
    return Parallelism(
        sizes,
        rules,
        strategy,
        args.context_layout,
        outer,
        context_shares=shares,
        optimizer_sharding=args.optimizer_sharding,
        pipeline=plan,
    )


def check_optimizer_sharding(optimizer_sharding: str, sizes: dict[str, int]) -> None:
    """``--optimizer-sharding data`` on a ``--mesh`` whose ``data`` axis is given as 1 (or left out) is refused:
    there is nothing to split the optimizer state over, and the run would keep it whole without a word.

    Checked on the mesh as the user typed it, before the ``-1`` axis is resolved: ``data=-1`` passes, since the
    devices decide its size, and an elastic restart on fewer processes (`train.launcher.replan`), which only
    resizes that axis, may resolve it to 1; start-up then logs a note instead
    (`train.setup.checks.optimizer_sharding_note`).

    Args:
      optimizer_sharding: ``--optimizer-sharding``.
      sizes: ``--mesh`` as axis sizes (one may be ``-1``), every axis present.

    Raises:
      ValueError: Naming both flags, a mesh with a ``data`` axis (where one can be made from the ``-1`` axis
        or an even ``fsdp``), and ``--optimizer-sharding replicated``.
    """
    if optimizer_sharding != ax.DATA or sizes[ax.DATA] != 1:
        return
    given = format_mesh(sizes).replace("single device", "data=1")
    example = _with_data(sizes)
    works = f"a mesh with one, e.g. --mesh {format_mesh(example)}, or " if example else ""
    raise ValueError(
        f"--optimizer-sharding data on --mesh {given}: the mesh has no data axis to split the optimizer state "
        f"over; use {works}--optimizer-sharding replicated"
    )


def _with_data(sizes: dict[str, int]) -> dict[str, int] | None:
    """``sizes`` with a ``data`` axis of 2 made beside the ``-1`` axis, or taken from an even ``fsdp`` (the same
    data-parallel rows, so the batch still divides); None when neither exists."""
    if -1 in sizes.values():
        return {**sizes, ax.DATA: 2}
    if sizes[ax.FSDP] % 2 == 0:
        return {**sizes, ax.DATA: 2, ax.FSDP: sizes[ax.FSDP] // 2}
    return None


CONTEXT_SHARES_EXAMPLE = "--context-shares 2,1"


def parse_context_shares(value: str | None, seq_len: int) -> tuple[int, ...] | str | None:
    """``--context-shares auto|S,S,...`` -> ``"auto"``, the real tokens of a sequence per ring device (relative
    shares turned into even token counts summing to ``seq_len``, `sharding.balance.tokens_for_speeds`), or
    None (not given).

    Raises:
      ValueError: Not ``auto`` nor positive numbers, or a ``--seq-len`` that is odd; naming the flag and a
        value that works.
    """
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


def strategy_from_args(args, sizes: dict[str, int], num_layers: int) -> tuple[Strategy, PipelinePlan | None]:
    """The strategy value and the pipeline of the flags, built here and nowhere else: a stage axis over 1 runs
    the model as a pipeline (`pipeline_plan`) whose gradients come from one pass (`sharding.parallel.Accumulation`
    of 1), ``--hetero-batch`` gives each data-parallel group its own count (`uneven_from_args`), and otherwise
    ``--microbatches`` accumulate (`sharding.parallel.Accumulation`).

    Args:
      args: The parsed ``python -m train.train`` flags.
      sizes: ``--mesh`` as axis sizes (one may be ``-1``).
      num_layers: The model's layers (for the stage split).

    Returns:
      ``(strategy, pipeline)``: the `sharding.parallel.Parallelism` fields; ``pipeline`` None without a stage axis.

    Raises:
      ValueError: A flag ``--plan auto`` chooses itself, a stage axis of ``-1`` or over the layers, flags of
        two strategies at once (uneven counts with a pipeline, pipeline flags without a stage axis), or as
        `uneven_from_args` and `pipeline_plan`; naming the flags.
    """
    _check_planned(args)
    stages = _checked_stages(sizes, num_layers, args.microbatches)
    uneven = uneven_from_args(args)
    if stages > 1:
        if uneven is not None:
            raise ValueError(
                f"--hetero-batch supports meshes over data, fsdp and tensor only; --mesh splits "
                f"stage={stages}. Use e.g. --mesh data=-1 --rules dp, or --hetero-batch off"
            )
        return Accumulation(), pipeline_plan(args, stages, num_layers)
    _refuse_pipeline_flags(args)
    return (uneven if uneven is not None else Accumulation(args.microbatches)), None


def _checked_stages(sizes: dict[str, int], num_layers: int, microbatches: int) -> int:
    """The stage count of ``--mesh``.

    Raises:
      ValueError: ``stage=-1``, or more stages than the model has layers; naming a mesh that works.
    """
    stages = sizes[ax.STAGE]
    if stages == -1:
        more = "" if microbatches >= 2 else " --microbatches 2"  # a pipeline needs a microbatch per stage
        raise ValueError(f"--mesh stage=-1: give the pipeline's stage count, e.g. --mesh stage=2,fsdp=-1{more}")
    if num_layers < stages:
        # the whole mesh: fewer stages alone would leave devices out, which the device count check refuses
        good = max(d for d in range(1, num_layers + 1) if stages % d == 0)
        fsdp = sizes.get(ax.FSDP, 1)
        fixed = {**sizes, ax.STAGE: good, ax.FSDP: fsdp if fsdp == -1 else fsdp * (stages // good)}
        more = f" --microbatches {good}" if 1 < good and microbatches < good else ""  # a microbatch per stage
        raise ValueError(
            f"--mesh {format_mesh(sizes)}: the model has {num_layers} layers, fewer than the {stages} stages; use "
            f"--mesh {format_mesh(fixed)}{more} (or more layers, --set num_layers={stages})"
        )
    return stages


def uneven_from_args(args) -> UnevenBatch | None:
    """The `UnevenBatch` of ``--hetero-batch``, ``--rebalance-every`` and ``--hetero-max-share``, or None
    without ``--hetero-batch``.

    Raises:
      ValueError: As `parse_hetero_batch`; ``--rebalance-every`` or ``--hetero-max-share`` without
        ``--hetero-batch`` or below 1; given counts with ``--plan auto``; naming the flags.
    """
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
    return uneven


def _refuse_pipeline_flags(args) -> None:
    """Pipeline flags without a stage axis are refused, naming the first.

    Raises:
      ValueError: Naming the flag and a mesh with a stage axis (with the microbatches its stages need).
    """
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
        # the stages --stage-layers lists (else 2), and a microbatch in flight on each: the mesh alone would
        # be refused next for its one microbatch
        stages = len(args.stage_layers.split(",")) if args.stage_layers not in (None, "auto") else 2
        more = f" --microbatches {stages}" if (args.microbatches or 1) < stages else ""
        raise ValueError(
            f"{given[0]} needs a pipeline: add a stage axis to --mesh, e.g. --mesh stage={stages},fsdp=-1{more}"
        )


def pipeline_plan(args, stages: int, num_layers: int) -> PipelinePlan:
    """The `PipelinePlan` of ``--pipeline-schedule``, ``--pipeline-repeats`` and ``--stage-layers``.

    Raises:
      ValueError: ``--pipeline-repeats`` that does not fit the schedule, or as
        `sharding.pipeline.plan_layout`; naming the flag, its value and one that works.
    """
    schedule = parse_schedule(args.pipeline_schedule)
    circular = schedule is Schedule.CIRCULAR
    one_f_one_b = schedule.one_f_one_b
    repeats = args.pipeline_repeats or default_repeats(args)
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

    ``auto`` measures the devices at start-up (`train.setup.calibrate`), ``kinds`` takes speeds from the devices'
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
