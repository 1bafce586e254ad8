"""Cost model against the compiler, and what the planner gains on mixed clusters.

Writes a Markdown report (default ``bench/results/costmodel.md``) with:

1. **The cost model's error** per mesh and model (1b: pipelined steps, `costmodel_grid.PIPELINE_GRID`): for each layout, one train step is compiled
   from abstract shapes on 8 simulated CPU devices (`Trainer.compile_train_step`) and the
   prediction of `sharding.costmodel.estimate(..., backend="cpu")` is compared with
   ``cost_analysis()["flops"]`` (each loop body counted once: `Cost.counted_flops`), the matrix
   products of the HLO with trip counts folded in (`sharding.hlo.dot_flops`: `Cost.matmul_flops`),
   ``memory_analysis().argument_size_in_bytes`` and the bytes of each collective kind
   (`sharding.hlo.collectives`), on the grid the tests assert on (`bench/costmodel_grid.py`).
   Temporaries (activations) are listed for information: the cost
   model predicts a fraction of what XLA's CPU backend allocates.
2. **The uneven data-parallel step** (`train.strategies.UnevenGradients`): its compiled collectives against the model.
3. **The optimizer's FLOPs per parameter** as XLA counts them (`OPTIMIZER_FLOPS_PER_PARAM`).
4. **Simulated gains**: 4 fast + 4 slow devices with speed ratio r = 1.5, 2, 3; the planned step
   time against the best uniform split (ideal gain (r+1)/2), and the planner against brute force.
5. **The plan table** for ``--model 7b --cluster h100:8,a100:8 --batch 1024 --seq-len 4096``.

Run by hand: ``python bench/costmodel.py`` (about 3 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from costmodel_grid import (  # noqa: E402
    BENCH_ONLY,
    CONTEXT_GRID,
    GRID,
    PIPELINE_BENCH_ONLY,
    PIPELINE_GRID,
    UNEVEN_CONTEXT_GRID,
    UNMODELLED,
    compiled_figures,
    gather_of,
    predicted,
    schedule_of,
    shares_of,
)

from models.config import get_config  # noqa: E402
from models.spec import describe  # noqa: E402
from sharding import costmodel as cm  # noqa: E402
from sharding import devices, hlo, planner  # noqa: E402
from sharding.mesh import make_mesh, parse_mesh  # noqa: E402
from sharding.parallel import Parallelism, UnevenBatch  # noqa: E402
from sharding.rules import get_rules  # noqa: E402
from train.plan import plan_flags  # noqa: E402
from train.runtime.optimizer import OptimizerConfig  # noqa: E402
from train.runtime.step import Trainer  # noqa: E402

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def _err(pred: float, actual: float) -> str:
    if not actual:
        return "0 = 0" if not pred else f"{pred:.3g} vs 0"
    return f"{(pred - actual) / actual:+.1%}"


def error_table() -> list[str]:
    lines = [
        "## 1. Predicted vs compiled, per device per step (CPU backend)",
        "",
        "Relative error of the prediction. `cost_analysis` counts each loop body once; `folded "
        "products` are the HLO's dot FLOPs with loop trip counts multiplied in (per step); `arguments` "
        "is parameters + AdamW moments + batch. Collective columns: per-device result bytes per step "
        "of each kind (blank: the kind is absent from both). `temp` is `temp_size_in_bytes` against "
        "the predicted activations + logits + gathered weights + gradients (information only).",
        "",
        "| model | mesh | rules | B x T | M | remat | cost_analysis FLOPs | folded products | arguments | "
        + " | ".join(KINDS)
        + " | temp (pred/compiled) |",
        "|" + "---|" * (10 + len(KINDS)),
    ]
    for case in GRID + BENCH_ONLY + CONTEXT_GRID + UNEVEN_CONTEXT_GRID:
        model, mesh_spec, rules, batch, seq, micro, remat = case[:7]
        if shares_of(case):
            mesh_spec += f" shares {','.join(map(str, shares_of(case)))}"
        figures, cost = compiled_figures(case), predicted(case)
        actual, pred = figures["collectives"], cm.collective_bytes(cost.comms)
        kinds = [_err(pred.get(k, 0.0), actual.get(k, 0.0)) if (k in actual or k in pred) else "" for k in KINDS]
        m = cost.memory
        runs = figures["dot_outside"] + figures["dot_branches"] / 2  # the zigzag ring's switch: one of two runs
        temp = m.in_flight / figures["temp"]
        lines.append(
            f"| {model} | {mesh_spec} | {rules} | {batch} x {seq} | {micro} | {remat} | "
            f"{_err(cost.counted_flops, figures['flops'])} | {_err(cost.matmul_flops, runs)} | "
            f"{_err(cost.argument_bytes, figures['arguments'])} | " + " | ".join(kinds) + f" | {temp:.2f} |"
        )
        print(lines[-1], flush=True)
    lines += [
        "",
        "The `sequence=2` row (context parallelism by the partitioner on reference attention) "
        "is outside the tested grid (`costmodel_grid.BENCH_ONLY`). The last three (`costmodel_grid.CONTEXT_GRID`: "
        "ring, ulysses and USP attention over a split length, 256 tokens; the test asserts USP) count as folded "
        "products those outside conditionals and half of those inside: the zigzag ring's only conditional "
        "picks one of two visiting blocks of equal products. The row with `shares` (`costmodel_grid."
        "UNEVEN_CONTEXT_GRID`) runs ring attention on uneven sequence shards, compiled at the padded length; its "
        "folded products count the flash kernels' loops, whose trip counts are run-time values there, once "
        "(not asserted), and its price is the busiest ring device's.",
        "",
    ]
    return lines


def pipeline_table() -> list[str]:
    """Section 1b: the pipelined cases (`costmodel_grid.PIPELINE_GRID`, then `PIPELINE_BENCH_ONLY`), and
    the worst error of each figure over the asserted cases."""
    lines = [
        "## 1b. Pipelines: predicted vs compiled, per device per step (CPU backend)",
        "",
        "Predicted with every slot of every step priced (`skip_empty=False`): the compiled program counts a "
        "conditional's branch on every loop trip. Asterisk: not asserted (`UNMODELLED`); last rows: bench only.",
        "",
        "| model | mesh | rules | B x T | M | stages | R | schedule | cost_analysis FLOPs | folded products | arguments | "
        + " | ".join(KINDS)
        + " | temp (pred/compiled) |",
        "|" + "---|" * (12 + len(KINDS)),
    ]
    worst: dict[str, float] = {}
    for case in PIPELINE_GRID + PIPELINE_BENCH_ONLY:
        model, mesh_spec, rules, batch, seq, micro, remat, stages, repeats = case[:9]
        figures, cost = compiled_figures(case), predicted(case)
        actual, pred = figures["collectives"], cm.collective_bytes(cost.comms)
        errors = {
            "cost_analysis FLOPs": (cost.counted_flops, figures["flops"]),
            "folded products": (cost.matmul_flops, figures["dot_flops"]),
            "arguments": (cost.argument_bytes, figures["arguments"]),
        }
        errors.update({k: (pred.get(k, 0.0), actual.get(k, 0.0)) for k in KINDS if k in actual or k in pred})
        if case in PIPELINE_GRID:
            for name, (p, a) in errors.items():
                if a and name not in UNMODELLED.get(case, ()):
                    worst[name] = max(worst.get(name, 0.0), abs(p - a) / a)
        cells = [
            _err(*errors[k]) + ("*" if k in UNMODELLED.get(case, ()) else "") if k in errors else ""
            for k in ("cost_analysis FLOPs", "folded products", "arguments", *KINDS)
        ]
        m = cost.memory
        temp = m.in_flight / figures["temp"]
        split = ",".join(map(str, stages)) if stages else "even"
        lines.append(
            f"| {model} | {mesh_spec} | {rules} | {batch} x {seq} | {micro} | {split} | {repeats} | "
            f"{schedule_of(case)}{', gather ' + gather_of(case) if len(case) > 10 else ''} | "
            + " | ".join(cells)
            + f" | {temp:.2f} |"
        )
        print(lines[-1], flush=True)
    lines += [
        "",
        "Worst error over the asserted pipeline cases: " + ", ".join(f"{k} {v:.1%}" for k, v in worst.items()) + ".",
        "",
    ]
    return lines


def hetero_table() -> list[str]:
    lines = [
        "## 2. Uneven data-parallel step (train/strategies.py), counts 3,3,3,3,1,1,1,1 of 2-row microbatches",
        "",
        "| mesh | rules | cost_analysis FLOPs | arguments | " + " | ".join(KINDS) + " |",
        "|" + "---|" * (4 + len(KINDS)),
    ]
    counts, rows, seq = (3, 3, 3, 3, 1, 1, 1, 1), 2, 64
    for mesh_spec, rules in (("data=8", "dp"), ("data=2,fsdp=4", "fsdp")):
        config = get_config("test")
        par = Parallelism.of(make_mesh(parse_mesh(mesh_spec, 8)), get_rules(rules), UnevenBatch(counts))
        compiled = Trainer(config, OptimizerConfig(), par).compile_train_step(sum(counts) * rows, seq)
        analysis = compiled.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        layout = cm.layout_of(par, config)
        cost = cm.device_cost(
            config, layout, seq_len=seq, rows=rows, microbatches=3, backend="cpu", batch_rows=sum(counts) * rows
        )
        actual, pred = cm.collective_bytes(hlo.collectives(compiled.as_text())), cm.collective_bytes(cost.comms)
        kinds = [_err(pred.get(k, 0.0), actual.get(k, 0.0)) if (k in actual or k in pred) else "" for k in KINDS]
        lines.append(
            f"| {mesh_spec} | {rules} | {_err(cost.counted_flops, analysis['flops'])} | "
            f"{_err(cost.argument_bytes, compiled.memory_analysis().argument_size_in_bytes)} | "
            + " | ".join(kinds)
            + " |"
        )
    return lines + [""]


def optimizer_flops() -> list[str]:
    """The update's XLA-counted FLOPs per parameter: a 1-layer ``test`` model on ``data=8`` at 8, 16
    and 32 tokens per device; the per-token part is linear, the rest is the update."""
    found = {}
    config = get_config("test", ["num_layers=1"])
    for seq in (8, 16, 32):
        trainer = Trainer(
            config, OptimizerConfig(), Parallelism.of(make_mesh(parse_mesh("data=8", 8)), get_rules("dp"))
        )
        compiled = trainer.compile_train_step(8, seq)
        analysis = compiled.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        found[seq] = analysis["flops"] - hlo.dot_flops(compiled.as_text())
    per_token = (found[16] - found[8]) / 8
    update = (found[8] - 8 * per_token) / config.num_params
    return [
        "## 3. Optimizer FLOPs per parameter (XLA's count)",
        "",
        f"Elementwise FLOPs (cost_analysis minus products) of a 1-layer `test` step on `data=8` at 8, 16, 32 "
        f"tokens per device: {found[8]:,.0f}, {found[16]:,.0f}, {found[32]:,.0f}; the update is "
        f"{update:.1f} FLOPs per parameter (`OPTIMIZER_FLOPS_PER_PARAM` = {cm.OPTIMIZER_FLOPS_PER_PARAM:g}).",
        "",
    ]


def _pair(ratio):
    fast = devices.DeviceKind("fast", "fast", 100e12 * ratio, 80e9, 2e12, 300e9, "simulated")
    slow = devices.DeviceKind("slow", "slow", 100e12, 80e9, 2e12, 300e9, "simulated")
    return devices.Inventory((devices.Host(fast, 4, "h0"), devices.Host(slow, 4, "h1")), 50e9)


def gains() -> list[str]:
    model = describe(get_config("125m"))
    lines = [
        "## 4. Simulated gains: 4 fast + 4 slow devices, `125m` shape, batch 256 x 1024",
        "",
        "Devices: fast = r x 100 TFLOP/s, slow = 100 TFLOP/s, 80 GB, 300 GB/s links, hosts of 4, 50 GB/s "
        "between them. Uniform: the best plan where every device does the same work.",
        "",
        "| r | chosen plan | step (s) | uniform plan | uniform (s) | gain | ideal (r+1)/2 | gain / ideal | "
        "brute-force best (s) | planner time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ratio in (1.5, 2.0, 3.0):
        inventory = _pair(ratio)
        t0 = time.perf_counter()
        best = planner.plan(model, inventory, 256, 1024)[0]
        seconds = time.perf_counter() - t0
        uniform = planner.uniform_baseline(model, inventory, 256, 1024)
        brute = planner.brute_force(model, inventory, 256, 1024)
        gain, ideal = uniform.step_time / best.step_time, (ratio + 1) / 2
        lines.append(
            f"| {ratio:g} | {plan_flags(best)} | {best.step_time:.4f} | {plan_flags(uniform)} | "
            f"{uniform.step_time:.4f} | {gain:.3f} | {ideal:.2f} | {gain / ideal:.1%} | "
            f"{brute.step_time:.4f} | {seconds:.2f} s |"
        )
    return lines + [""]


def plan_7b() -> list[str]:
    model = get_config("7b")
    inventory = devices.parse_cluster("h100:8,a100:8")
    plans = planner.plan(model, inventory, 1024, 4096, top=8)
    base = planner.uniform_baseline(model, inventory, 1024, 4096)
    return [
        "## 5. `python -m train.plan --model 7b --cluster h100:8,a100:8 --batch 1024 --seq-len 4096`",
        "",
        "```",
        *planner.format_table(plans),
        "```",
        "",
        f"Best plan with the same work on every device: {plan_flags(base)}, {base.step_time:.2f} s/step; "
        f"the chosen plan is {base.step_time / plans[0].step_time:.2f}x faster.",
        "",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "costmodel.md"))
    parser.add_argument("--pipeline-only", action="store_true", help="only section 1b (the pipelined cases)")
    args = parser.parse_args()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.perf_counter()
    lines = [
        "# Cost model against the compiler; planner gains",
        "",
        f"JAX {jax.__version__}, {jax.device_count()} simulated {jax.devices()[0].platform} devices, {now}. "
        f"Command: `python bench/costmodel.py`.",
        "",
    ]
    if args.pipeline_only:
        lines += pipeline_table()
    else:
        lines += error_table() + pipeline_table() + hetero_table() + optimizer_flops() + gains() + plan_7b()
    lines.append(f"Total time {time.perf_counter() - t0:.0f} s.")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
