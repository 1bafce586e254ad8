"""Time from SIGTERM to exit of ``python -m train.train``: finish the step, save, wait, exit 0.

Starts a training run, waits for its ``--signal-at`` step line, sends SIGTERM and
measures the seconds until the process exits, then checks the exit code and the
saved step. Prints a markdown row.

    python bench/preemption.py --signal-at 5 -- --cpu-devices 8 --model small
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--signal-at", type=int, default=5, help="send SIGTERM once this step is logged")
    parser.add_argument("train_args", nargs="*", help="flags for train.train (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "train.log"
        command = [
            sys.executable,
            "-m",
            "train.train",
            *args.train_args,
            "--steps",
            "100000",
            "--log-every",
            "1",
            "--ckpt-every",
            "0",
            "--eval-every",
            "0",
            "--no-progress",
            "--run-dir",
            str(Path(tmp) / "run"),
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with log_path.open("w") as log:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        pattern = re.compile(rf"^step\s+{args.signal_at}/")
        while not any(pattern.search(line) for line in log_path.read_text().splitlines()):
            if process.poll() is not None:
                print(log_path.read_text())
                return 1
            time.sleep(0.05)
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait()
        seconds = time.monotonic() - start
        text = log_path.read_text()
        saved = re.search(r"the checkpoint of step (\d+) is complete", text)
        step_ms = re.findall(r"\| (\d+) ms/step", text)
    print("| flags | exit code | saved step | SIGTERM to exit (s) | last step time (ms) |")
    print("|---|---|---|---|---|")
    print(
        f"| `{' '.join(args.train_args)}` | {code} | {saved.group(1) if saved else 'none'} | {seconds:.2f} | "
        f"{step_ms[-1] if step_ms else '?'} |"
    )
    return 0 if code == 0 and saved else 1


if __name__ == "__main__":
    sys.exit(main())
