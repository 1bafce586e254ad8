"""The pipeline dry-run figure: ``python -m bench.pipeline [--out bench/results/pipeline.md]``.

Compiles (never runs) one train step of the 7B model on 8 simulated CPU
devices with ``--mesh stage=4,fsdp=2 --stage-layers 10,10,6,6
--microbatches 16``, once per schedule (GPipe, circular with 2 repeats), and
writes the dry-run reports (bubble fraction, layers and padding per stage,
per-device bytes from ``compiled.memory_analysis()``, collectives) to a
Markdown file with the command, JAX version, machine and date.

Each run is a separate process, so ``--cpu-devices`` applies before JAX starts.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

BASE = ["--cpu-devices", "8", "--model", "7b", "--mesh", "stage=4,fsdp=2", "--stage-layers", "10,10,6,6",
        "--microbatches", "16", "--batch-size", "32", "--seq-len", "2048", "--dry-run"]
RUNS = (("GPipe", []), ("circular, 2 repeats", ["--pipeline-schedule", "circular", "--pipeline-repeats", "2"]))


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
    args = parser.parse_args(argv)
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
        table = [line for line in lines if not line.startswith(("embed/", "final_norm/", "layers/", "unembed",
                                                                "parameter "))]
        sections += ["", f"## {name}", "", "```", command, *table, "```"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(sections) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
