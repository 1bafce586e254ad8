"""Time lost per failure under ``python -m train.launch``: detection, restart, recompute.

Runs the launcher on this machine (``--local-processes``, ``--rejoin``), kills training processes with
SIGKILL at the steps of ``--kill PROCESS@STEP,...`` (a step counted after the previous restart, so the
second kill hits the restarted job), lets the lost slots rejoin at the next checkpoint, and reports per kill:

- detection: kill to the launcher's restart line (it has seen the loss, stopped the survivors and chosen the
  layout for the processes left);
- restart: restart line to the first step line after it (process start, JAX start, restore, compilation);
- kill to first step: the two together (the issue's target: under 60 s on this machine);
- CPU seconds (what load does not inflate as it does wall time): the launcher's from the kill to its restart
  line, and the restarted training processes' together from their start to the first step line (read from
  /proc as the lines appear);
- steps recomputed (the restart line's count: recorded steps after the checkpoint resumed).

Then it replays the same generations by hand in a second run folder (each a launcher run without kills, on
the same process count, from the same checkpoint step to the step the next generation resumed from) and
compares every step's loss with the elastic run's (``--rtol``, 1e-6 by default): what the restarts recomputed
must be what a person restarting by hand on the same meshes gets.

    python bench/elastic.py                       # the issue's scenario: 3 x 2 CPU devices, --model small
    python bench/elastic.py --model test --steps 20 --kill 1@6,0@13   # a quick check

Prints markdown (the commands, the machine, the date and one row per kill); exit status 1 when the run
fails or a loss differs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def train_flags(args, run_dir: Path, steps: int) -> list[str]:
    return [
        "--model",
        args.model,
        "--cpu-devices",
        str(args.cpu_devices),
        "--mesh",
        "data=-1",
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--steps",
        str(steps),
        "--warmup",
        "5",
        "--decay-steps",
        str(args.steps),  # the schedule does not depend on where a segment stops
        "--ckpt-every",
        str(args.ckpt_every),
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--log-every",
        "1",
        "--no-progress",
        "--dist-timeout",
        "300",  # a kill is seen by its exit; a heartbeat missed on a starved machine would add a restart
        "--data-cache",
        str(args.cache),
        "--run-dir",
        str(run_dir),
    ]


def launch(processes: int, flags: list[str], log: Path, extra=()) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    handle = log.open("w")
    command = [sys.executable, "-m", "train.launch", "--local-processes", str(processes), *extra, *flags]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (all its threads) from /proc (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Watch:
    """The launcher's log as it grows: the monotonic time each line was first seen (polled every 20 ms) and,
    then, the CPU seconds the launcher and the newest generation's training processes had used."""

    def __init__(self, log: Path, launcher: subprocess.Popen):
        self.log, self.launcher = log, launcher
        self.seen: dict[int, float] = {}
        self.cpu: dict[int, tuple[float, float]] = {}
        self.pids: list[int] = []
        self.last: dict[int, float] = {}

    def launcher_cpu(self) -> float:
        return cpu_seconds(self.launcher.pid) or 0.0

    def processes_cpu(self) -> float:
        for pid in self.pids:
            now = cpu_seconds(pid)
            if now is not None:
                self.last[pid] = now
        return sum(self.last.get(pid, 0.0) for pid in self.pids)

    def lines(self) -> list[str]:
        lines = self.log.read_text().split("\n")[:-1]  # a line without its newline may still be written
        now = time.monotonic()
        for i, line in enumerate(lines):
            if i in self.seen:
                continue
            self.seen[i] = now
            if line.startswith("launch: process 0 of"):
                self.pids = []
            m = re.match(r"launch: process \d+ of \d+ \(slot \d+\) started, pid (\d+)$", line)
            if m:
                self.pids.append(int(m.group(1)))
                self.processes_cpu()
            self.cpu[i] = (self.launcher_cpu(), self.processes_cpu())
        return lines


def elastic_run(args, folder: Path):
    """The launcher run with the kills: its log, a `Watch` of its lines, and per kill ``(time, launcher CPU
    seconds, process, step, processes)``."""
    log, kills = folder / "elastic.log", []
    plan = [(int(p), int(s)) for p, s in (item.split("@") for item in args.kill.split(","))]
    flags = train_flags(args, folder / "elastic", args.steps)
    launcher = launch(args.processes, flags, log, ["--rejoin", "--max-restarts", str(len(plan) + 1)])
    watch = Watch(log, launcher)
    try:
        for process, step in plan:
            while True:  # a step >= STEP of the newest generation, after the previous kill's restart
                lines = watch.lines()
                restarts = [i for i, line in enumerate(lines) if line.startswith("launch: restart")]
                starts = [i for i, line in enumerate(lines) if line.startswith("launch: process 0 of")]
                if len(restarts) >= len(kills) and starts:
                    since = max(starts[-1], restarts[len(kills) - 1] if kills else 0)
                    reached = [
                        int(m.group(1)) for m in (re.match(r"step\s+(\d+)/", line) for line in lines[since:]) if m
                    ]
                    if reached and max(reached) >= step:
                        count = int(re.search(r"^launch: process 0 of (\d+)", lines[starts[-1]]).group(1))
                        pids = re.findall(
                            rf"^launch: process {process} of {count} \(slot \d+\) started, pid (\d+)$",
                            "\n".join(lines),
                            re.M,
                        )
                        try:
                            os.kill(int(pids[-1]), signal.SIGKILL)
                            break
                        except ProcessLookupError:  # that generation just ended (growing back): the next one
                            pass
                if launcher.poll() is not None:
                    raise SystemExit(
                        f"the launcher ended ({launcher.returncode}) before step {step}:\n{log.read_text()}"
                    )
                time.sleep(0.02)
            kills.append((time.monotonic(), watch.launcher_cpu(), process, step, count))
        while launcher.poll() is None:
            watch.lines()
            time.sleep(0.02)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=60)
    watch.lines()
    text = log.read_text()
    return launcher.returncode, text, watch, kills


def figures(text: str, watch: Watch, kills) -> list[dict]:
    """Per kill: the phases in seconds of wall time, and the CPU seconds of the launcher from the kill to its
    restart line and of the restarted processes (together) from their start to the first step line."""
    lines = text.splitlines()
    rows = []
    restarts = [i for i, line in enumerate(lines) if line.startswith("launch: restart")]
    for (killed_at, launcher_cpu, process, step, count), r in zip(kills, restarts, strict=False):
        first = next(i for i in range(r, len(lines)) if re.match(r"step\s+\d+/", lines[i]))
        recomputed = int(re.search(r"(\d+) step\(s\) recomputed", lines[r]).group(1))
        resumed = int(re.search(r"resuming from step (\d+)", lines[r]).group(1))
        rows.append(
            {
                "kill": f"process {process} of {count} at step {step}",
                "detection": watch.seen[r] - killed_at,
                "restart": watch.seen[first] - watch.seen[r],
                "total": watch.seen[first] - killed_at,
                "launcher_cpu": watch.cpu[r][0] - launcher_cpu,
                "processes_cpu": watch.cpu[first][1],
                "resumed": resumed,
                "recomputed": recomputed,
                "line": lines[r],
            }
        )
    return rows


def generations(text: str, processes: int, steps: int) -> list[tuple[int, int, int]]:
    """``(processes, from_step, to_step)`` of each generation, read from the launcher's lines."""
    starts = [(processes, 0)]
    for line in text.splitlines():
        m = re.search(r"resuming from step (\d+) on (\d+) process", line)
        if m:
            starts.append((int(m.group(2)), int(m.group(1))))
        m = re.match(r"launch: growing back to (\d+) processes at step (\d+)", line)
        if m:
            starts.append((int(m.group(1)), int(m.group(2))))
    return [(n, s, starts[i + 1][1] if i + 1 < len(starts) else steps) for i, (n, s) in enumerate(starts)]


def by_hand(args, folder: Path, gens) -> dict[int, float]:
    """The same generations run one after another without kills, each from the step the next one resumed at."""
    run_dir = folder / "by-hand"
    for i, (count, start, stop) in enumerate(gens):
        if stop <= start:
            continue
        flags = train_flags(args, run_dir, stop)
        extra = ["--resume", "--resume-step", str(start), "--discard-later"] if start else []
        log = folder / f"by-hand-{i}.log"
        code = launch(count, flags + extra, log).wait()
        if code != 0:
            raise SystemExit(
                f"the by-hand generation {i} ({count} processes, {start}..{stop}) failed:\n{log.read_text()}"
            )
    return losses(run_dir)


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "train/loss" in record:
            out[record["step"]] = record["train/loss"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--cpu-devices", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=12, help="divisible by every process count's devices")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--kill", default="1@12,0@24", help="PROCESS@STEP,...: SIGKILL that process at that step")
    parser.add_argument("--rtol", type=float, default=1e-6)
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "meshwork-bench-cache"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshwork-elastic-") as tmp:
        folder = Path(tmp)
        t0 = time.monotonic()
        code, text, watch, kills = elastic_run(args, folder)
        wall = time.monotonic() - t0
        if code != 0:
            print(text)
            return 1
        rows = figures(text, watch, kills)
        elastic = losses(folder / "elastic")
        gens = generations(text, args.processes, args.steps)
        hand = by_hand(args, folder, gens)
    steps = sorted(elastic)
    worst = max(abs(elastic[s] - hand[s]) / max(abs(hand[s]), 1e-30) for s in steps)
    same = steps == sorted(hand) == list(range(1, args.steps + 1)) and worst <= args.rtol
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"Command: `python bench/elastic.py {' '.join(sys.argv[1:])}`; {platform.machine()}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} at the end, {now}; whole run {wall:.0f} s."
    )
    print(f"Generations (processes, from step, to step): {gens}.")
    print(
        f"Losses against the same generations restarted by hand: {'equal' if same else 'DIFFERENT'} "
        f"(largest relative difference {worst:.1e}, rtol {args.rtol:g}; {len(steps)} steps, one record each)."
    )
    print()
    print(
        "| kill | detection (s) | restart (s) | kill to first step (s) | launcher CPU s, detection | "
        "processes' CPU s to the first step | resumed from | steps recomputed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['kill']} | {row['detection']:.1f} | {row['restart']:.1f} | {row['total']:.1f} | "
            f"{row['launcher_cpu']:.1f} | {row['processes_cpu']:.1f} | {row['resumed']} | {row['recomputed']} |"
        )
    return 0 if same and len(rows) == len(kills) else 1


if __name__ == "__main__":
    sys.exit(main())
