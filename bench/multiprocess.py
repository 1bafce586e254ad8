"""Two processes of 4 CPU devices against one process of 8: the same losses step by step.

Runs ``python -m train.train`` as two processes (gloo collectives, coordinator on
127.0.0.1) for ``--steps`` steps, stops, resumes them for as many again, then one
8-device process for the whole run with the same flags, and prints the losses side
by side as a markdown table.

    python bench/multiprocess.py --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = [
    "--model",
    "test",
    "--seq-len",
    "64",
    "--batch-size",
    "8",
    "--mesh",
    "data=2,fsdp=4",
    "--mesh-outer",
    "data=2",
    "--warmup",
    "2",
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--ckpt-every",
    "5",
    "--no-progress",
]


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return dict(env, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(flags, log_dir: Path) -> None:
    port = _port()
    procs = []
    for i in range(2):
        log = (log_dir / f"p{i}.log").open("w")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "train.train",
                    *flags,
                    "--cpu-devices",
                    "4",
                    "--coordinator",
                    f"127.0.0.1:{port}",
                    "--num-processes",
                    "2",
                    "--process-id",
                    str(i),
                ],
                cwd=ROOT,
                env=_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    if any(p.wait() != 0 for p in procs):
        raise SystemExit((log_dir / "p0.log").read_text())


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="steps before the stop (as many again after)")
    args = parser.parse_args()
    total = 2 * args.steps
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        common = [*FLAGS, "--decay-steps", str(total)]
        _two_processes([*common, "--steps", str(args.steps), "--run-dir", str(tmp / "multi")], tmp)
        _two_processes([*common, "--steps", str(total), "--resume", "--run-dir", str(tmp / "multi")], tmp)
        single = subprocess.run(
            [
                sys.executable,
                "-m",
                "train.train",
                *common,
                "--steps",
                str(total),
                "--cpu-devices",
                "8",
                "--run-dir",
                str(tmp / "single"),
            ],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
        )
        if single.returncode:
            raise SystemExit(single.stdout.decode() + single.stderr.decode())
        multi, one = _losses(tmp / "multi"), _losses(tmp / "single")
    print(f"flags: `{' '.join(FLAGS)}`; two processes stop after step {args.steps} and resume\n")
    print("| step | 2 processes x 4 devices | 1 process x 8 devices | relative difference |")
    print("|---:|---:|---:|---:|")
    worst = 0.0
    for step in range(1, total + 1):
        diff = abs(multi[step] - one[step]) / abs(one[step])
        worst = max(worst, diff)
        print(f"| {step} | {multi[step]:.6f} | {one[step]:.6f} | {diff:.1e} |")
    print(f"\nlargest relative difference: {worst:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
