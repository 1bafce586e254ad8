"""Plan a training layout for a cluster: ``python -m train.plan``; and ``--plan auto`` of train.train.

Examples::

    python -m train.plan --model 7b --cluster h100:8,a100:8 --batch 1024 --seq-len 4096
    python -m train.plan --model 1b --cluster h100:8x2@3200Gbps --batch 512 --seq-len 2048 --plot plan.png
    python -m train.plan --model small --cluster cluster.json --batch 64 --seq-len 256 --no-pipeline
    python -m train.plan --model 7b --cluster a100:8x4 --batch 512 --seq-len 2048 \
        --layout "--mesh data=8,tensor=4 --rules tp --microbatches 4 --remat full"

Prints the cluster, the best plans (predicted step time, tokens/s, MFU, memory per device kind,
why each lost to the best), the best plan where every device does the same work (for the gain),
and the ``python -m train.train`` flags of the chosen plan. ``--layout "FLAGS"`` prices one given
layout instead of searching (``python -m train.train``'s own layout flags, read by its parser) and
prints the cost model's breakdown; ``--json`` prints either as one JSON object. ``--plot FILE.png`` draws the
predicted step time and per-device memory of each plan (needs matplotlib: ``pip install
'meshwork[plot]'``).

The model is a preset of ``models.config`` with ``--set FIELD=VALUE`` overrides; the planner
(`sharding.planner`) reads its description (`models.spec.describe`), never the model itself.

``python -m train.train --plan auto`` runs the same search for the run's own devices
(`train.setup.auto_plan.apply_plan`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from collections.abc import Sequence

from checkpoints.argparser import Parser
from models import attention_registry
from models.attention import check_context_shares
from models.config import PRESETS, get_config
from models.spec import describe
from sharding import costmodel as cm
from sharding import devices, planner
from sharding.axes import MESH_AXES
from sharding.devices import inventory_from_flag
from sharding.mesh import format_mesh, parse_mesh
from sharding.modeldesc import ModelDescription
from sharding.pipeline import check_microbatches, example_split
from train.reports.plot import plot, pyplot_for
from train.setup.checks import check_expert_axis
from train.setup.flagnames import render
from train.setup.flags import parallelism_flags
from train.setup.layout_flags import LAYOUT_COUNTS, PRICED_FLAGS, parallelism_from_args
from train.setup.parser import build_parser as build_train_parser
from train.setup.parser import check_positive_counts

EXAMPLE_CLUSTER = "h100:8,a100:8"
"""The cluster of ``--help``'s examples: 16 devices, two kinds."""

EXAMPLE_LAYOUT = "--mesh data=2,stage=2,tensor=4 --rules tp --microbatches 64 --pipeline-schedule 1f1b --remat full"
"""``--help``'s ``--layout``: its mesh's sizes multiply to `EXAMPLE_CLUSTER`'s 16 devices, and it fits 7b at the
example's 1024 x 4096 tokens (62 GB of the 73 usable per device)."""

EXAMPLE = f"python -m train.plan --model 7b --cluster {EXAMPLE_CLUSTER} --batch 1024 --seq-len 4096"
"""``--help``'s search example; with ``--layout`` it prices `EXAMPLE_LAYOUT` instead."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m train.plan",
        description=__doc__.split("\n\n")[0],
        epilog=f'Examples (search, then price one layout):\n  {EXAMPLE}\n  {EXAMPLE} --layout "{EXAMPLE_LAYOUT}"',
    )
    p.add_argument("--model", default="7b", choices=sorted(PRESETS), help="model preset (models.config)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a model field")
    p.add_argument("--cluster", required=True, help=f"cluster spec ({EXAMPLE_CLUSTER}[@400Gbps]) or a JSON/YAML file")
    p.add_argument("--batch", type=int, required=True, help="global batch, sequences")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--top", type=int, default=8, help="plans to list")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="compute dtype")
    p.add_argument("--attention", default="any", choices=("any", *searched_attentions()), help="attention to plan for")
    p.add_argument(
        "--efficiency",
        type=float,
        default=None,
        help="fraction of peak FLOP/s the step's work reaches, for every kind; default: priced from the "
        "shapes (each matrix product's tiles and waves at the kind's measured matmul ceiling, "
        "sharding.devices.GEMM_BENCHMARKS, times what it holds under sustained load, SUSTAINED_FRACTION; "
        "elementwise work at the memory bandwidth)",
    )
    p.add_argument("--no-pipeline", action="store_true", help="leave stage=1 (no pipeline parallelism)")
    p.add_argument(
        "--no-hetero",
        action="store_true",
        help="no uneven shares: neither data-parallel counts nor sequence shards (--context-shares)",
    )
    p.add_argument(
        "--sequence",
        action="store_true",
        help="also split the length (context parallelism): over sequence inside a host and context across "
        "hosts, with ring, all-to-all (ulysses) or USP attention, chosen by the links and the head count; a ring "
        "across kinds of unequal speed may get uneven sequence shards (--context-shares)",
    )
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw step time and memory per plan")
    p.add_argument(
        "--layout",
        default=None,
        metavar='"FLAGS"',
        help="price this layout instead of searching: python -m train.train's layout flags in one string, "
        f'e.g. --layout "{EXAMPLE_LAYOUT}" on --cluster {EXAMPLE_CLUSTER} (the mesh\'s sizes multiply to the '
        "cluster's devices); --remat, --attention and --dtype default to none, flash and --dtype",
    )
    p.add_argument(
        "--pipeline-clock",
        default="lockstep",
        choices=planner.PIPELINE_CLOCKS,
        help="how a 1F1B pipeline's step is clocked: lockstep, meshwork's schedules as they run (each tick as "
        "long as its busiest stage); fused, each stage on its own as Megatron-LM runs 1F1B, bubble "
        "(S-1)/(M v) with v the interleaved chunks (--pipeline-repeats): to price a published Megatron layout",
    )
    p.add_argument(
        "--overlap-axes",
        default=None,
        metavar="AXES",
        help="mesh axes (comma-separated: tensor, stage, data, ...) whose collectives the priced run hides behind "
        "compute although meshwork's program waits on them, e.g. --overlap-axes tensor,data,stage for "
        "Megatron-core's --tp-comm-overlap --overlap-grad-reduce and overlapped pipeline sends",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (step_seconds, tokens_per_second, "
        "mfu, memory_gb per kind, fits, flags; with a search also every plan) instead of the tables",
    )
    return p


def plan_flags(plan: planner.Plan, cluster: str | None = None) -> str:
    """The ``python -m train.train`` flags that reproduce ``plan``: its layout's (`train.setup.flags.parallelism_flags`
    of `Plan.parallelism`), then the model's execution flags (``--remat``, ``--attention``, ``--dtype``) and
    ``--cluster`` when given, as one string."""
    lay = plan.layout
    parts = parallelism_flags(plan.parallelism()) + ["--remat", lay.remat, "--attention", lay.attention]
    parts += ["--dtype", lay.dtype] + (["--cluster", cluster] if cluster else [])
    return " ".join(parts)


def searched_attentions() -> tuple[str, ...]:
    """The attentions the planner tries by default (`sharding.modeldesc.AttentionTraits.searched`; ``dot_product``
    is priced as ``reference`` and ``ring``/``ulysses`` as ``flash`` without a sequence axis, so they are left
    out); the one the ``--attention`` choices of ``python -m train.plan`` offer."""
    return tuple(k.name for k in attention_registry.KERNELS if k.traits.searched)


def model_description(preset: str, overrides: Sequence[str]) -> ModelDescription:
    """The description of a preset with ``--set`` overrides (`models.spec.describe`).

    Raises:
      ValueError: Unknown preset or field (from models.config), naming the flag.
    """
    return describe(get_config(preset, overrides))


def options_from(args) -> planner.PlanOptions:
    attentions = None if args.attention == "any" else (args.attention,)  # None: the searched ones (and the
    # context-parallel ones over a split length, `sharding.planner.search`)
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise ValueError(f"--efficiency {args.efficiency}: must be in (0, 1], e.g. --efficiency 0.5")
    return planner.PlanOptions(
        attentions=attentions,
        dtype=args.dtype,
        pipeline=not args.no_pipeline,
        hetero=not args.no_hetero,
        sequence=args.sequence,
        efficiency=args.efficiency,
        one_f_one_b_clock=args.pipeline_clock,
        overlaps=() if args.overlap_axes is None else overlap_axes(args.overlap_axes),
    )


def overlap_axes(text: str) -> tuple[str, ...]:
    """``--overlap-axes`` as mesh axis names.

    Raises:
      ValueError: On a name that is not a mesh axis, naming the flag and the axes.
    """
    names = tuple(a.strip() for a in text.split(","))
    example = "e.g. --overlap-axes tensor,data"
    if not any(names):
        raise ValueError(f"--overlap-axes {text!r}: names no axis; {example}, or leave the flag out")
    unknown = [a for a in names if a not in MESH_AXES]
    if unknown:
        what = "an empty item" if not unknown[0] else f"{unknown[0]!r} is not a mesh axis"
        raise ValueError(f"--overlap-axes {text}: {what}; {example}")
    repeated = [a for i, a in enumerate(names) if a in names[:i]]
    if repeated:
        raise ValueError(f"--overlap-axes {text}: {repeated[0]} is named twice; {example}")
    return names


def efficiency_note(inventory, options) -> str:
    """``efficiency 50% of peak`` (``--efficiency``), or the clock's own: ``compute from the shapes (sustained
    matmul ceiling a100_80gb 86%, h100_sxm 76%, ...)``: each kind's best measured matmul burst times the fraction
    of it held under sustained load (`sharding.devices.GEMM_BENCHMARKS`, `sharding.devices.SUSTAINED_FRACTION`)."""
    if options.efficiency is not None:
        return f"efficiency {options.efficiency:.0%} of peak"
    kinds = devices.kinds
    ceilings = ", ".join(
        f"{k.name} "
        f"{(k.gemm_fraction or kinds.DEFAULT_GEMM_FRACTION) * (k.sustained_fraction or kinds.DEFAULT_SUSTAINED_FRACTION):.0%}"
        for k in inventory.kinds_present
    )
    return f"compute from the shapes (sustained matmul ceiling {ceilings} of peak)"


def idle_warnings(plans: Sequence[planner.Plan]) -> list[str]:
    """Lines for a best plan that gives a kind no work: the memory it still holds, and the best listed plan
    that gives every kind work (how much slower)."""
    best = plans[0]
    if not best.idle_kinds:
        return []
    lines = [
        f"warning: the {kind} devices get no microbatches in the chosen plan (counts of 0) but still hold "
        f"{best.memory[kind] / 1e9:.1f} GB each (their parameter and optimizer shards), as FSDP memory "
        f"holders only"
        for kind in best.idle_kinds
    ]
    working = next(((i, p) for i, p in enumerate(plans, 1) if not p.idle_kinds and p.fits), None)
    if working is not None:
        i, p = working
        lines.append(
            f"  the best listed plan that gives every kind work is #{i} ({format_mesh(p.layout.mesh)}, "
            f"{p.step_time / best.step_time - 1:+.0%} step time): {plan_flags(p)}"
        )
    return lines


def _state_words(p: planner.Plan) -> str:
    """How plan ``p`` lays out its optimizer state, in words: ``replicated`` or ``split over data=N``."""
    if p.layout.optimizer_sharding == "replicated":
        return "replicated"
    return f"split over {p.layout.optimizer_sharding}={p.layout.mesh[p.layout.optimizer_sharding]}"


def report(model, inventory, args, options) -> tuple[list[str], list[planner.Plan]]:
    """The printed lines and the plans.

    Raises:
      ValueError: When no plan is found, with the reason (`planner.no_plan_reason`), e.g. a batch that
        divides over no mesh's data-parallel devices and a ``--batch`` that does.
    """
    t0 = time.perf_counter()
    plans = planner.plan(model, inventory, args.batch, args.seq_len, options, top=args.top)
    seconds = time.perf_counter() - t0
    if not plans:  # nothing to print: bad input (exit 2 in `main`), with the reason when it is knowable
        raise ValueError(render(planner.no_plan_reason(model, inventory, args.batch, args.seq_len, options)))
    # One kind: every device already does the same work, so the search would only run again to say "1.00x".
    mixed = len(inventory.kinds_present) > 1
    base = planner.uniform_baseline(model, inventory, args.batch, args.seq_len, options) if mixed else None
    lines = [
        inventory.describe(),
        "",
        f"model {args.model}: {args.batch} x {args.seq_len} tokens per step, {plans[0].layout.dtype}"
        + (
            f" ({', '.join(sorted({k.name for k in inventory.kinds_present if not k.bfloat16}))} has no bfloat16)"
            if plans[0].layout.dtype != options.dtype
            else ""
        )
        + f", {efficiency_note(inventory, options)}; planned in {seconds:.1f} s",
        "",
    ]
    lines += planner.format_table(plans)
    idle = idle_warnings(plans)
    if idle:
        lines += [""] + idle
    best = plans[0]
    if base is not None:
        lines += [
            "",
            f"same work on every device (best such plan: {format_mesh(base.layout.mesh)}, rules "
            f"{base.layout.rules_name}, {base.layout.microbatches} microbatches, remat {base.layout.remat}, "
            f"optimizer state {_state_words(base)}): "
            f"{base.step_time:.3f} s/step; the chosen plan is {base.step_time / best.step_time:.2f}x faster",
        ]
    if not best.fits:
        lines += ["", "warning: no plan fits the devices' memory; the closest are shown, least over memory first"]
    lines += [
        "",
        "chosen plan:",
        f"  python -m train.train --model {args.model} "
        + "".join(f"--set {s} " for s in args.set)
        + f"--batch-size {args.batch} --seq-len {args.seq_len} {plan_flags(best, args.cluster)}",
    ]
    return lines, plans


class _OneLineParser(Parser):
    """``python -m train.train``'s parser (`train.setup.parser.build_parser`) whose errors raise a one-line
    ``ValueError`` naming ``--layout`` instead of printing the usage and exiting."""

    def error(self, message):
        raise ValueError(f"--layout: {message}")


def given_layout(text: str, num_layers: int, num_devices: int, defaults: argparse.Namespace, experts=None):
    """``(layout, counts)``: the `sharding.costmodel.Layout` that ``--layout "FLAGS"`` describes.

    The flags are ``python -m train.train``'s (`train.setup.layout_flags.PRICED_FLAGS`), read by its own parser and turned into
    its `sharding.parallel.Parallelism` (`train.setup.layout_flags.parallelism_from_args`), then into the cost model's
    layout (`sharding.costmodel.layout_of`), so a layout printed by the planner or run by ``train.train``
    is priced as given.

    Args:
      text: The flags in one string, e.g. ``"--mesh data=8,tensor=4 --rules tp --microbatches 4"``.
      num_layers: The model's layers (for the stage split).
      num_devices: The cluster's devices (``--mesh`` may hold one ``-1``).
      defaults: ``python -m train.plan``'s namespace: ``--batch`` (the pipeline's microbatches must split it),
        ``--dtype`` and ``--attention`` where the layout gives none
        (``any`` attention: ``flash``); remat defaults to ``none``.
      experts: The model's `sharding.modeldesc.ExpertGeometry` (None: a dense model): a pipeline must be able
        to run its mixture (`ExpertGeometry.pipelined`), as ``train.train`` checks (`train.setup.checks.check_experts`),
        and an ``expert`` axis must split it (`train.setup.checks.check_expert_axis`).

    Returns:
      The layout, and the per-device microbatch counts of ``--hetero-batch COUNTS`` (data x fsdp, data major)
      or None.

    Raises:
      ValueError: One line naming ``--layout``: no flags at all, an unknown or malformed flag, a count
        ``--microbatches``/``--pipeline-repeats`` below 1 (`train.setup.parser.check_positive_counts`), a flag that is not a layout's,
        a mesh that does not cover the devices, ``--hetero-batch auto``/``kinds``, ``--stage-layers auto`` or
        ``--context-shares auto`` (give the counts or shares), pipeline microbatches that --batch or the
        stages refuse (`sharding.pipeline.check_microbatches`), pipeline stages on a mixture of experts with
        dense layers or a capacity, an expert axis on a dense model or one that does not divide its experts,
        or a value the cost model does not price.
    """
    try:
        tokens = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"--layout {text!r}: {e}") from None
    if not tokens:  # no flags would price train.train's default layout, which nobody asked for
        raise ValueError(
            f'--layout {text!r}: gives no layout flags; e.g. --layout "--mesh fsdp={num_devices}" (every device '
            "of the cluster), or leave --layout out to search"
        )
    parser = build_train_parser()
    parser.__class__ = _OneLineParser
    args = parser.parse_args(tokens)
    foreign = sorted(
        f"--{k.replace('_', '-')}"
        for k, v in vars(args).items()
        if k not in PRICED_FLAGS and v != parser.get_default(k)
    )
    if foreign:
        # only the flags train.plan has can be given to it; the others (--lora-rank, --steps, ...) price nothing
        own = {o for action in build_parser()._actions for o in action.option_strings}
        given, left = [f for f in foreign if f in own], [f for f in foreign if f not in own]
        remedy = "; ".join(
            part
            for part in (
                f"give {', '.join(given)} to train.plan itself" if given else "",
                f"leave {', '.join(left)} out" if left else "",
            )
            if part
        )
        raise ValueError(
            f"--layout: {', '.join(foreign)} is not a layout flag; {remedy} (layout flags: --mesh, --rules, --rule, --microbatches, --stage-layers, "
            f"--pipeline-schedule, --pipeline-repeats, --pipeline-gather, --hetero-batch, --context-shares, --remat, --attention, "
            f"--dtype, --optimizer-sharding)"
        )
    try:
        check_positive_counts(args, LAYOUT_COUNTS)  # as train.train refuses them, before a Layout names its fields
        par = parallelism_from_args(args, num_layers)
        mesh = parse_mesh(args.mesh, num_devices, seen_by="the cluster has")
        # train.train checks these with the run (`train.setup.strategy_setup.check_run_batch`)
        if par.pipeline is not None:
            pipe = par.pipeline
            check_microbatches(
                pipe.microbatches,
                pipe.layout.stages,
                defaults.batch,
                par.replace(mesh_shape=mesh).data_parallel,
                pipe.layout.repeats if pipe.one_f_one_b else 1,
                batch_field="global_batch",
            )
    except ValueError as e:
        raise ValueError(f"--layout: {render(e)}") from None
    if par.pipeline is not None and experts is not None and not experts.pipelined(num_layers):
        sets = [] if experts.layers == num_layers else ["--set first_dense_layers=0 --set moe_every=1"]
        sets += ["--set capacity_factor=0"] if experts.capacity_factor else []
        raise ValueError(
            f"--layout: --mesh {args.mesh}: pipeline stages run a mixture of experts whose every layer is one, "
            f"dropless ({experts.layers} of the {num_layers} layers here, capacity_factor="
            f"{experts.capacity_factor:g}); e.g. {' '.join(sets)}, or drop stage from --mesh"
        )
    try:  # as train.train refuses it
        check_expert_axis(experts, mesh, args.mesh)
    except ValueError as e:
        raise ValueError(f"--layout: {e}") from None
    if par.context_shares == "auto":
        raise ValueError(
            "--layout: --context-shares auto is measured at run time; give one relative share per ring device, "
            "e.g. --context-shares 2,1"
        )
    strategy, counts = par.strategy, None
    if strategy.uneven:
        if strategy.kind_counts is not None:
            counts = dict(strategy.kind_counts)
        elif strategy.counts is None:
            raise ValueError(
                f"--layout: --hetero-batch {args.hetero_batch} is decided at run time; give the counts, "
                f"e.g. --hetero-batch h100=3,a100=1 (per kind) or 3,3,3,3,1,1,1,1 (one per data x fsdp device)"
            )
        else:
            counts = tuple(strategy.counts)
    elif par.pipeline is not None and par.pipeline.measure_stages:
        raise ValueError(
            "--layout: --stage-layers auto is measured at run time; give the layers per stage, "
            f"e.g. --stage-layers {example_split(num_layers, par.pipeline.layout.stages)}"
        )
    attention = args.attention or ("flash" if defaults.attention == "any" else defaults.attention)
    try:
        if par.context_shares is not None:  # ring attention in the zigzag layout, one share per ring device
            check_context_shares(attention, par.replace(mesh_shape=mesh), args.seq_len)
        layout = cm.layout_of(
            par.replace(mesh_shape=mesh),
            remat=args.remat or "none",
            attention=attention,
            dtype=args.dtype or defaults.dtype,
            logits=args.logits or "auto",
        )
    except ValueError as e:
        raise ValueError(f"--layout: {render(e)}") from None
    if not args.rule:  # a preset by name, as the search names it (the pipeline's layers -> stage is implied)
        layout = dataclasses.replace(layout, rules=args.rules)
    return layout, counts


def price_report(model, inventory, args, options) -> tuple[list[str], planner.Plan]:
    """The printed lines and the `planner.Plan` of ``--layout``: the layout priced as the search prices it
    (`sharding.planner.evaluate`), with its `breakdown`.

    Raises:
      ValueError: As `given_layout`, or when the batch does not split over the layout (naming ``--batch``).
    """
    layout, counts = given_layout(args.layout, model.num_layers, inventory.num_devices, args, model.experts)
    t0 = time.perf_counter()
    plan_ = planner.evaluate(model, inventory, args.batch, args.seq_len, layout, counts, options)
    seconds = time.perf_counter() - t0
    if plan_ is None:
        per = layout.batch_split * layout.microbatches
        raise ValueError(
            f"--batch {args.batch} does not split over the layout's {layout.batch_split} data-parallel "
            f"devices x {layout.microbatches} microbatches ({per} rows per step at least); give a "
            f"--batch divisible by {per}"
        )
    lines = [
        inventory.describe(),
        "",
        f"model {args.model}: {args.batch} x {args.seq_len} tokens per step, {layout.dtype}, "
        f"{efficiency_note(inventory, options)}; priced in {seconds:.2f} s",
        "",
    ]
    lines += planner.format_table([plan_]) + [""] + breakdown(plan_)
    lines += [
        "",
        "as flags:",
        f"  python -m train.train --model {args.model} "
        + "".join(f"--set {s} " for s in args.set)
        + f"--batch-size {args.batch} --seq-len {args.seq_len} {plan_flags(plan_, args.cluster)}",
    ]
    return lines, plan_


def breakdown(p: planner.Plan) -> list[str]:
    """Lines of where a plan's step time and memory go: the slowest device's seconds as they add up
    (compute + the overlappable traffic no compute hides + what the hidden traffic slows compute by +
    exposed traffic + optimizer + pipeline bubble), and each kind's memory against its usable limit, with
    whether it fits and, if not, why."""
    parts, total = p.parts, p.step_time
    lines = [f"step {total:.3f} s, paced by {p.paced_by}:"]
    rows = [
        ("compute (matrix products, elementwise)", parts["compute"]),
        ("overlappable traffic (weight gathers, gradient reductions)", parts["overlapped_comm"]),
        ("  of which exposed (first/last of the loop, beyond compute)", parts["overlap_exposed"]),
        ("  compute slowed by the hidden part (SMs it holds)", parts["contention"]),
        ("exposed traffic (tensor, sequence, stage, pipeline weights)", parts["exposed_comm"]),
        ("optimizer update", parts["optimizer"]),
        ("pipeline bubble and schedule", parts["bubble"]),
    ]
    lines += [f"  {name:<58} {sec:9.4f} s  {sec / total:6.1%}" for name, sec in rows]
    if p.comm:
        lines.append(
            "traffic by collective (slowest device, overlapped or not): "
            + ", ".join(f"{kind} {sec:.4f} s" for kind, sec in sorted(p.comm.items(), key=lambda kv: -kv[1]))
        )
    lines.append("memory per device:")
    for kind, used in p.memory.items():
        limit = p.memory_limit[kind]
        parts = dict(p.memory_parts.get(kind, {}))
        before = parts.pop("before_loop", 0.0)  # a pipeline's phase before its tick loop, beside the gradients
        lines.append(
            f"  {kind:<20} {used / 1e9:8.1f} GB of {limit / 1e9:.1f} GB usable"
            + ("" if used <= limit else f"  over by {(used - limit) / 1e9:.1f} GB")
            + (": " + ", ".join(f"{name} {b / 1e9:.1f}" for name, b in parts.items() if b) if parts else "")
            + (
                f"; before the tick loop {before / 1e9:.1f} beside the gradients (the larger phase counts)"
                if before
                else ""
            )
        )
    lines.append("fits" if p.fits else f"does not fit: {planner.why_lost(p, p).removeprefix('does not fit: ')}")
    return lines


def plan_json(p: planner.Plan) -> dict:
    """One plan for scripts: ``step_seconds``, ``tokens_per_second``, ``mfu`` (fraction), ``memory_gb`` (kind ->
    GB per device, 1e9 bytes), ``memory_limit_gb``, ``fits``, ``why`` (empty when it fits), ``parts`` (seconds
    of the slowest device), ``paced_by``, ``counts`` (uneven microbatches or null), ``kind_counts`` (kind ->
    count when each kind's groups share one, or null), ``stage_kinds`` (a pipeline's kinds per stage, or
    null), ``context_shares`` (real tokens of a sequence per ring device with uneven sequence shards, or
    null), ``comm_seconds`` (seconds
    per collective kind), ``idle_kinds`` (kinds given no microbatch) and ``flags`` (the
    ``python -m train.train`` layout flags, `plan_flags`)."""
    return {
        "step_seconds": p.step_time,
        "tokens_per_second": p.tokens_per_second,
        "mfu": p.mfu,
        "memory_gb": {k: v / 1e9 for k, v in p.memory.items()},
        "memory_limit_gb": {k: v / 1e9 for k, v in p.memory_limit.items()},
        "fits": p.fits,
        "why": "" if p.fits else planner.why_lost(p, p),
        "parts": dict(p.parts),
        "paced_by": p.paced_by,
        "counts": list(p.counts) if p.counts is not None else None,
        "kind_counts": dict(p.kind_counts) if p.kind_counts is not None else None,
        "stage_kinds": list(p.stage_kinds) if p.stage_kinds is not None else None,
        "context_shares": None if p.layout.context_shares is None else [int(n) for n in p.layout.context_shares],
        "comm_seconds": dict(p.comm),
        "idle_kinds": list(p.idle_kinds),
        "flags": plan_flags(p),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.batch <= 0 or args.seq_len <= 0:
            raise ValueError(
                f"--batch {args.batch} --seq-len {args.seq_len}: must be positive, e.g. --batch 1024 --seq-len 4096"
            )
        if args.top < 1:
            raise ValueError(f"--top must be at least 1 (got {args.top}), e.g. --top 8")
        if args.plot:
            pyplot_for(args.plot)
        model = model_description(args.model, args.set)
        inventory = inventory_from_flag(args.cluster)
        options = options_from(args)
        if args.layout is not None:
            lines, priced = price_report(model, inventory, args, options)
            plans = [priced]
            out = plan_json(priced)
        else:
            lines, plans = report(model, inventory, args, options)
            out = dict(plan_json(plans[0]), plans=[plan_json(p) for p in plans])
        print(json.dumps(out, indent=1) if args.json else "\n".join(lines))
        if args.plot and plans:
            plot(plans, args.plot, f"{args.model} on {args.cluster}, batch {args.batch} x {args.seq_len}")
            print(f"\nplot written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    except (ValueError, RuntimeError, OSError) as e:  # OSError: e.g. a --plot path that cannot be written
        print(f"error: {render(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
