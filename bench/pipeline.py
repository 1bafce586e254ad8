"""The pipeline dry-run figure: ``python -m bench.pipeline [--out bench/results/pipeline.md]``.

Compiles (never runs) one train step of the 7B model on 8 simulated CPU
devices with ``--mesh stage=4,fsdp=2 --stage-layers 10,10,6,6
--microbatches 16``, once per schedule (GPipe, circular with 2 repeats), and
writes the dry-run reports (bubble fraction, layers and padding per stage,
per-device bytes from ``compiled.memory_analysis()``, collectives) to a
Markdown file with the command, JAX version, machine and date.

With the 1F1B schedule too, and a second table: the temporaries of the gradient computation alone
(``jax.value_and_grad`` of the model's loss, no optimizer update) per schedule
(``python -m bench.pipeline --gradients SCHEDULE [--gather once|microbatch]`` prints one of its rows).

Each run is a separate process, so ``--cpu-devices`` applies before JAX starts. ``--device-memory 80GiB``
states the target device's memory, which the fit check otherwise takes from this host's RAM.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

BASE = [
    "--cpu-devices",
    "8",
    "--model",
    "7b",
    "--mesh",
    "stage=4,fsdp=2",
    "--stage-layers",
    "10,10,6,6",
    "--microbatches",
    "16",
    "--batch-size",
    "32",
    "--seq-len",
    "2048",
    "--dry-run",
    "--device-memory",
    "80GiB",
]
RUNS = (
    ("GPipe", []),
    ("circular, 2 repeats", ["--pipeline-schedule", "circular", "--pipeline-repeats", "2"]),
    ("1F1B", ["--pipeline-schedule", "1f1b"]),
)


def gradient_temporaries(schedule: str, gather: str = "once") -> str:
    """One table row: bytes per device of the compiled gradient computation alone, for ``schedule`` (gpipe,
    1f1b or 1f1b-fused) with the weights gathered ``gather`` (``--pipeline-gather``) on the `BASE` shapes (call
    in a process whose JAX has 8 CPU devices)."""
    import jax

    from models.config import get_config
    from sharding import pipeline as pl
    from sharding.mesh import make_mesh, parse_mesh
    from sharding.parallel import Parallelism
    from sharding.rules import get_rules
    from train.runtime.optimizer import OptimizerConfig
    from train.runtime.step import Trainer

    layout, _ = pl.plan_layout(32, 4, 1, (10, 10, 6, 6))
    plan = pl.PipelinePlan(layout, 16, schedule=schedule, gather=gather)
    par = Parallelism.of(make_mesh(parse_mesh("stage=4,fsdp=2", 8)), get_rules("fsdp_tp"), pipeline=plan)
    trainer = Trainer(get_config("7b"), OptimizerConfig(), par)
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), trainer.state_params, trainer.param_shardings
    )
    fn = jax.jit(lambda p, b: jax.value_and_grad(trainer.loss_sums, has_aux=True)(p, b))
    memory = fn.lower(params, trainer.abstract_batch(32, 2048)).compile().memory_analysis()
    return f"| {schedule}, gather {gather} | {memory.temp_size_in_bytes / 2**30:.2f} GiB | {memory.argument_size_in_bytes / 2**30:.2f} GiB |"


def dry_run(extra: list[str]) -> tuple[str, list[str]]:
    """Runs ``python -m train.train`` with ``BASE + extra``; returns the command and its report lines."""
    argv = [sys.executable, "-m", "train.train", *BASE, *extra]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    keep = [line for line in done.stdout.splitlines() if line.strip()]
    return "python -m train.train " + " ".join([*BASE, *extra]), keep


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores ({cpu}), {platform.system()} {platform.release()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/pipeline.md")
    parser.add_argument(
        "--gradients",
        choices=("gpipe", "1f1b", "1f1b-fused"),
        default=None,
        help="print one row of the gradients-only table (in this process) and exit",
    )
    parser.add_argument("--gather", choices=("once", "microbatch"), default="once", help="with --gradients")
    args = parser.parse_args(argv)
    if args.gradients:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        print(gradient_temporaries(args.gradients, args.gather))
        return 0
    import jax

    sections = [
        "# Pipeline dry run: 7B, stage=4 x fsdp=2, stage layers 10,10,6,6, 16 microbatches",
        "",
        f"JAX {jax.__version__}; {_machine()}; {time.strftime('%Y-%m-%d')}. Compiled only (8 simulated CPU devices); "
        "per-device bytes are XLA's `memory_analysis()` of the compiled step, the same on every device of the SPMD "
        "program. Batch 32 x 2048 tokens: 16 microbatches of 2 sequences, each split over fsdp=2.",
    ]
    for name, extra in RUNS:
        command, lines = dry_run(extra)
        table = [
            line for line in lines if not line.startswith(("embed/", "final_norm/", "layers/", "unembed", "parameter "))
        ]
        sections += ["", f"## {name}", "", "```", command, *table, "```"]
    rows = []
    for schedule in ("gpipe", "1f1b"):
        argv = [sys.executable, "-m", "bench.pipeline", "--gradients", schedule]
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        rows.append(done.stdout.strip().splitlines()[-1])
    sections += [
        "",
        "## Gradient computation alone (no optimizer update)",
        "",
        "| schedule | temporaries | arguments |",
        "|---|---|---|",
        *rows,
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(sections) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
