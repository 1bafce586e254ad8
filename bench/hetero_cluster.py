"""A real mixed-speed cluster on one machine: uneven data parallelism and uneven stages, measured.

Two training processes (gloo CPU collectives, coordinator on 127.0.0.1, 4 CPU devices each) are pinned to
separate cores with ``taskset``; the "slow" one (process 1) is held to ``1/r`` of its core by a CPU-quota
cgroup (v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``, whichever this machine lets us write). Both run in
cgroups of the highest CPU weight, so other work on the machine yields to them. For each ratio ``r``, in
alternating order, the step time (``perf/step_time`` in ``metrics.jsonl``, ``--log-every 1``) of:

* ``uniform``: every device 3 microbatches (``--hetero-batch 3,...,3``);
* ``kinds``: counts from datasheet peaks of kinds whose ratio is deliberately not ``r``
  (``--hetero-batch kinds --simulate-cluster``): the contrast;
* ``auto``: counts from speeds measured at start-up (``--hetero-batch auto``, rebalancing every 10 steps).

Then a straggler run (``auto``, ``--rebalance-every 3``): both processes at full speed, process 1 lowered to
half its core at one third of the run and given it back at two thirds. And a ``stage=2`` pipeline across
the two processes at ``r = 2``: the even split against ``--stage-layers auto``.

``--schedules`` runs instead the pipeline schedules' comparison, without a quota (no cgroup, no root): a
``stage=2`` pipeline across the two processes, each pinned to its own core, M = 8 microbatches, timing
``gpipe``, lockstep ``1f1b``, ``1f1b-fused`` and ``zb`` (``--rounds`` rounds, the order reversed every other
round; the median step time of each schedule over all rounds, warm-up steps left out), and writes that table;
``--only gpipe,zb`` times only those (gpipe among them). ``--flops`` prints instead the compiled step's FLOPs and
temporaries of gpipe, fused 1F1B and zero bubble on those shapes (one process, no timing: load does not change
them).

``--context`` runs instead uneven sequence shards: one sequence split over a ring of the two processes' devices
(``--mesh sequence=2 --mesh-outer sequence=2``, one CPU device each, ``--attention ring``, zigzag), process 1
held to ``1/r`` of its core (``--context-ratio``, default 2), even shards against ``--context-shares auto``
(shares from the speeds measured at start-up), in alternating order over ``--rounds``. The model is small and
the sequence long (8,192 tokens), so attention, whose padding the kernels skip, is most of the step; the rest
(projections, MLP, head) runs on the padded blocks. ``--context-ratio 1`` makes no cgroup (a check that it
starts, no root needed).

The gain of a run is the uniform median step time over its own; the ideal gain with speeds 1 and 1/r is
(r+1)/2 (both processes busy the whole step). Writes a markdown section between markers in
``bench/RESULTS.md`` (unless ``--no-results``) and a PNG of the straggler run's step times.

    sudo python bench/hetero_cluster.py                 # ~30 min on a quiet 2-core machine
    python bench/hetero_cluster.py --ratios 2 --steps 8 --no-results   # a quick look
    python bench/hetero_cluster.py --schedules          # the schedules' step times, ~15 min quiet, no root
    python bench/hetero_cluster.py --schedules --only gpipe,zb --rounds 2 --steps 8 --skip 2   # zb against gpipe
    python bench/hetero_cluster.py --flops              # compiled FLOPs of gpipe, 1f1b-fused, zb (deterministic)
    sudo python bench/hetero_cluster.py --context       # uneven sequence shards at r = 2

Needs two cores and (except ``--schedules``) a writable CPU cgroup (root); says so and exits otherwise. Every cgroup and process
it starts is removed on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
PLOT = ROOT / "bench" / "results" / "hetero_straggler.png"
BEGIN, END = "<!-- hetero_cluster:begin -->", "<!-- hetero_cluster:end -->"
PERIOD_US = 100_000
TIMED_RUN = ["--eval-every", "0", "--ckpt-every", "0", "--log-every", "1", "--no-progress", "--dist-timeout", "600"]
"""What every timed run shares: no evaluation or checkpoints in the way, a step time per step, no progress bar."""
COMMON = [
    "--model",
    "small",
    "--seq-len",
    "256",
    "--batch-size",
    "48",
    "--mesh",
    "data=8",
    "--rules",
    "dp",
    "--mesh-outer",
    "data=2",
    "--warmup",
    "2",
    *TIMED_RUN,
]
UNIFORM = "3,3,3,3,3,3,3,3"
WRONG_KINDS = {1.5: "h100_sxm:4,a100_80gb:4", 2.0: "h100_sxm:4,a100_80gb:4", 3.0: "a100_80gb:4,rtx4090:4"}
"""Datasheet pairs whose peak ratio is not r: 3.17 for r = 1.5 and 2 (too many on the fast process), 1.89 for
r = 3 (too few)."""
STAGE_FLAGS = [
    "--model",
    "small",
    "--set",
    "num_layers=12",
    "--seq-len",
    "256",
    "--batch-size",
    "48",
    "--mesh",
    "stage=2,data=4",
    "--mesh-outer",
    "stage=2",
    "--microbatches",
    "12",
    "--warmup",
    "2",
    *TIMED_RUN,
]
SCHEDULE_FLAGS = [
    "--model",
    "small",
    "--set",
    "num_layers=12",
    "--seq-len",
    "256",
    "--batch-size",
    "64",
    "--mesh",
    "stage=2,data=4",
    "--mesh-outer",
    "stage=2",
    "--microbatches",
    "8",
    "--warmup",
    "0",
    *TIMED_RUN,
]
"""The schedules' runs: 12 layers split 6,6 over the two processes, 64 sequences = M = 8 microbatches of 8 (2
per data device)."""
SCHEDULES = ("gpipe", "1f1b", "1f1b-fused", "zb")
SCHEDULE_TARGETS = {"1f1b-fused": 1.1, "zb": 1.0}
"""Step time over GPipe's that each schedule should reach at most."""
SCHEDULES_BEGIN, SCHEDULES_END = "<!-- hetero_schedules:begin -->", "<!-- hetero_schedules:end -->"
CONTEXT_FLAGS = [
    "--model",
    "test",
    "--batch-size",
    "1",
    "--mesh",
    "sequence=2",
    "--mesh-outer",
    "sequence=2",
    "--attention",
    "ring",
    "--context-layout",
    "zigzag",
    "--warmup",
    "2",
    *TIMED_RUN,
]
"""The uneven-shards runs: one sequence of 8,192 tokens over a ring of two devices, one per process."""
CONTEXT_BEGIN, CONTEXT_END = "<!-- hetero_context:begin -->", "<!-- hetero_context:end -->"


class CpuQuota:
    """Two CPU cgroups (``fast``, ``slow``) at the highest weight; ``slow``'s quota set by `set_ratio`.

    Raises:
      SystemExit: Neither cgroup v1 (``/sys/fs/cgroup/cpu``) nor v2 (``/sys/fs/cgroup`` with the cpu
        controller) is writable here.
    """

    def __init__(self):
        tag = f"meshwork_bench_{os.getpid()}"
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        self.paths = {}
        if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
            self.version = 1
            for name in ("fast", "slow"):
                path = v1 / f"{tag}_{name}"
                path.mkdir(exist_ok=True)
                (path / "cpu.shares").write_text("262144")
                (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                self.paths[name] = path
        elif "cpu" in _read(v2 / "cgroup.controllers").split() and os.access(v2, os.W_OK):
            self.version = 2
            for name in ("fast", "slow"):
                path = v2 / f"{tag}_{name}"
                path.mkdir(exist_ok=True)
                (path / "cpu.weight").write_text("10000")
                self.paths[name] = path
        else:
            raise SystemExit(
                "bench/hetero_cluster.py needs a writable CPU cgroup: cgroup v1 /sys/fs/cgroup/cpu/"
                "cpu.cfs_quota_us or v2 /sys/fs/cgroup/cpu.max (run as root, e.g. sudo)"
            )
        self.set_ratio(1.0)

    def set_ratio(self, r: float) -> None:
        """Holds the slow cgroup to ``1/r`` of one core (``r = 1``: no limit)."""
        quota = -1 if r <= 1 else int(PERIOD_US / r)
        if self.version == 1:
            (self.paths["slow"] / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.paths["slow"] / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {PERIOD_US}")

    def procs(self, name: str) -> Path:
        return self.paths[name] / "cgroup.procs"

    def remove(self) -> None:
        for path in self.paths.values():
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except OSError:  # processes still leaving
                    time.sleep(0.1)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return dict(env, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def metric(run_dir: Path, key: str) -> dict:
    """``{step: value}`` of ``key`` in process 0's ``metrics.jsonl`` (``perf/step_time``: seconds;
    ``train/processed``: microbatches per device)."""
    rows = (json.loads(line) for line in _read(run_dir / "metrics.jsonl").splitlines())
    return {row["step"]: row[key] for row in rows if key in row}


def step_times(run_dir: Path) -> dict[int, float]:
    return metric(run_dir, "perf/step_time")


def counts_seen(run_dir: Path) -> dict[int, list[int]]:
    return metric(run_dir, "train/processed")


def run(
    quota: CpuQuota | None,
    flags: list[str],
    run_dir: Path,
    log_dir: Path,
    cores: tuple[int, int],
    on_step=None,
    devices: int = 4,
) -> None:
    """Two processes of ``devices`` CPU devices: process 0 on ``cores[0]`` in the fast cgroup, process 1 on
    ``cores[1]`` in the slow one (``quota`` None: no cgroup, pinned only); ``on_step(step)`` is called (from a
    thread) as process 0 logs steps."""
    port = _port()
    procs = []
    try:
        for i in range(2):
            cmd = [
                sys.executable,
                "-m",
                "train.train",
                *flags,
                "--run-dir",
                str(run_dir),
                "--cpu-devices",
                str(devices),
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ]
            join = "" if quota is None else f"echo $$ > {quota.procs('slow' if i else 'fast')} && "
            shell = f"{join}exec taskset -c {cores[i]} " + " ".join(cmd)
            log = (log_dir / f"p{i}.log").open("w")
            procs.append(
                subprocess.Popen(["sh", "-c", shell], cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
            )
        seen = 0
        while any(p.poll() is None for p in procs):
            time.sleep(0.5)
            if on_step is not None:
                steps = step_times(run_dir)
                if steps and max(steps) > seen:
                    seen = max(steps)
                    on_step(seen)
        if any(p.returncode for p in procs):
            raise SystemExit(
                f"a training process failed; its log:\n{_read(log_dir / 'p0.log')[-3000:]}\n"
                f"{_read(log_dir / 'p1.log')[-3000:]}"
            )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def median_after(times: dict[int, float], skip: int, until: int | None = None) -> float:
    """Median step time over steps ``skip+1 .. until`` (compilation and warm-up excluded)."""
    values = [t for s, t in sorted(times.items()) if s > skip and (until is None or s <= until)]
    return statistics.median(values)


def data_parallel(args, quota, tmp: Path) -> list[dict]:
    """The uniform / kinds / auto runs at every ratio, alternating the order between ratios."""
    rows = []
    order = ["uniform", "kinds", "auto"]
    for k, r in enumerate(args.ratios):
        quota.set_ratio(r)
        kinds = WRONG_KINDS.get(r, "h100_sxm:4,a100_80gb:4")
        extra = {
            "uniform": ["--hetero-batch", UNIFORM],
            "kinds": ["--hetero-batch", "kinds", "--microbatches", "3", "--simulate-cluster", kinds],
            "auto": ["--hetero-batch", "auto", "--microbatches", "3"],
        }
        for name in order if k % 2 == 0 else order[::-1]:
            run_dir = tmp / f"{name}_{r}"
            print(f"r = {r}: {name} ...", flush=True)
            run(quota, [*COMMON, *extra[name], "--steps", str(args.steps)], run_dir, tmp, args.cores)
            times, counts = step_times(run_dir), counts_seen(run_dir)
            rows.append(
                {
                    "r": r,
                    "scenario": name,
                    "median": median_after(times, args.skip),
                    "counts": counts[max(counts)] if counts else None,
                    "kinds": kinds if name == "kinds" else "",
                }
            )
            print(f"  median step {rows[-1]['median']:.3f} s, counts {rows[-1]['counts']}", flush=True)
    return rows


def straggler(args, quota, tmp: Path) -> dict:
    """``auto`` with process 1 lowered to half a core at a third of the run and restored at two thirds."""
    n = args.straggler_steps
    events = {}
    quota.set_ratio(1.0)

    def on_step(step):
        if step >= n // 3 and "slow" not in events:
            quota.set_ratio(2.0)
            events["slow"] = step + 1
            print(f"  process 1 held to half its core from step {step + 1}", flush=True)
        if step >= 2 * n // 3 and "fast" not in events:
            quota.set_ratio(1.0)
            events["fast"] = step + 1
            print(f"  process 1 given its core back from step {step + 1}", flush=True)

    run_dir = tmp / "straggler"
    print(f"straggler: {n} steps, --rebalance-every {args.rebalance_every} ...", flush=True)
    run(
        quota,
        [
            *COMMON,
            "--hetero-batch",
            "auto",
            "--microbatches",
            "3",
            "--rebalance-every",
            str(args.rebalance_every),
            "--steps",
            str(n),
        ],
        run_dir,
        tmp,
        args.cores,
        on_step,
    )
    quota.set_ratio(1.0)
    return {
        "times": step_times(run_dir),
        "counts": counts_seen(run_dir),
        "events": events,
        "log": _read(tmp / "p0.log"),
    }


def stages(args, quota, tmp: Path) -> list[dict]:
    """``stage=2`` across the processes at ``r = args.stage_ratio``: even split, then ``--stage-layers auto``."""
    quota.set_ratio(args.stage_ratio)
    rows = []
    for name, extra in (("even", []), ("auto", ["--stage-layers", "auto"])):
        run_dir = tmp / f"stage_{name}"
        print(f"stage=2, r = {args.stage_ratio}: {name} split ...", flush=True)
        run(quota, [*STAGE_FLAGS, *extra, "--steps", str(args.steps)], run_dir, tmp, args.cores)
        log = _read(tmp / "p0.log")
        split = next((line.split()[1] for line in log.splitlines() if line.startswith("pipeline: ")), "")
        layers = [
            line.split()[-2]
            for line in log.splitlines()
            if line.strip().startswith("stage ") and "layers" in line and "ms per microbatch" in line
        ]
        rows.append(
            {
                "scenario": name,
                "median": median_after(step_times(run_dir), args.skip),
                "layers": ",".join(layers) if layers else "6,6",
                "note": split,
            }
        )
        print(f"  median step {rows[-1]['median']:.3f} s, layers {rows[-1]['layers']}", flush=True)
    quota.set_ratio(1.0)
    return rows


def schedules(args, tmp: Path) -> dict[str, list[float]]:
    """Each schedule of ``args.only`` (default `SCHEDULES`): its step times (steps after ``args.skip``) over
    ``args.rounds`` rounds, no quota."""
    names = args.only
    times = {name: [] for name in names}
    for k in range(args.rounds):
        for name in names if k % 2 == 0 else names[::-1]:
            run_dir = tmp / f"schedule_{name}_{k}"
            print(f"round {k + 1}/{args.rounds}: --pipeline-schedule {name} ...", flush=True)
            flags = [*SCHEDULE_FLAGS, "--pipeline-schedule", name, "--steps", str(args.steps)]
            run(None, flags, run_dir, tmp, args.cores)
            steps = [t for s, t in sorted(step_times(run_dir).items()) if s > args.skip]
            times[name] += steps
            print(f"  median step {statistics.median(steps):.3f} s over {len(steps)} steps", flush=True)
    return times


def schedules_markdown(args, times: dict[str, list[float]], started: str, elapsed: float) -> str:
    """The schedules' table: median step time (s) of each and its ratio to GPipe's, against the targets."""
    import jax

    gpipe = statistics.median(times["gpipe"])
    lines = [
        SCHEDULES_BEGIN,
        f"## Pipeline schedules on the two-process cluster — {started[:10]}",
        "",
        f"`python bench/hetero_cluster.py --schedules --steps {args.steps} --skip {args.skip} --rounds "
        f"{args.rounds}{'' if tuple(args.only) == SCHEDULES else ' --only ' + ','.join(args.only)}`, jax {jax.__version__}, {platform.machine()} {os.cpu_count()} cores ({platform.node()}), "
        f"started {started}, {elapsed / 60:.0f} min. Two processes x 4 CPU devices, process 0 pinned to core "
        f"{args.cores[0]}, process 1 to core {args.cores[1]}, no quota; flags `{' '.join(SCHEDULE_FLAGS)}` and "
        f"`--pipeline-schedule` as named. Median step time over steps {args.skip + 1}-{args.steps} of every round "
        f"(the order reversed every other round).",
        "",
        "| schedule | median step (s) | steps timed | over GPipe | target |",
        "|---|---:|---:|---:|---|",
    ]
    for name in times:
        median = statistics.median(times[name])
        target = SCHEDULE_TARGETS.get(name)
        verdict = "" if target is None else f"at most {target:.1f}x: {'met' if median <= target * gpipe else 'not met'}"
        lines.append(f"| {name} | {median:.3f} | {len(times[name])} | {median / gpipe:.2f}x | {verdict} |")
    lines.append(SCHEDULES_END)
    return "\n".join(lines) + "\n"


FLOPS_SCHEDULES = ("gpipe", "1f1b-fused", "zb")
"""The schedules whose compiled step ``--flops`` reports."""


def schedule_flops() -> str:
    """The compiled step of each of `FLOPS_SCHEDULES` on the schedules' shapes (`SCHEDULE_FLAGS`: the small model
    with 12 layers split 6,6 over ``stage=2,data=4``, 64 x 256 tokens, M = 8) in this process, on 8 simulated
    CPU devices: ``cost_analysis`` FLOPs (each loop body once: one tick's forward, head, input and weight
    gradient for the 1F1B family; one forward and one backward step for GPipe), the matrix-product FLOPs with
    loop trip counts folded in (every branch of a conditional counted on every trip: all that every tick can
    run) and the temporaries. Deterministic: measurable on a loaded machine, before timing."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from costmodel_grid import compiled_figures

    rows = [
        "| schedule | cost_analysis FLOPs (loop bodies once) | product FLOPs, every branch every trip | temporaries (B) |"
    ]
    rows.append("|---|---:|---:|---:|")
    for name in FLOPS_SCHEDULES:
        case = ("small+num_layers=12", "stage=2,data=4", "dp", 64, 256, 8, "none", (6, 6), 1, name)
        f = compiled_figures(case)
        rows.append(f"| {name} | {f['flops']:.4e} | {f['dot_flops']:.4e} | {f['temp']:,.0f} |")
    return "\n".join(rows) + "\n"


def context(args, quota, tmp: Path) -> list[dict]:
    """Even shards against ``--context-shares auto`` at ``r = args.context_ratio``, ``args.rounds`` rounds in
    alternating order; each run's step times after ``args.skip`` and the shares it used."""
    if quota is not None:
        quota.set_ratio(args.context_ratio)
    extra = {"even": [], "auto": ["--context-shares", "auto"]}
    rows = []
    for k in range(args.rounds):
        for name in ("even", "auto") if k % 2 == 0 else ("auto", "even"):
            run_dir = tmp / f"context_{name}_{k}"
            print(f"round {k + 1}/{args.rounds}, r = {args.context_ratio}: {name} shards ...", flush=True)
            flags = [*CONTEXT_FLAGS, *extra[name], "--seq-len", str(args.context_len), "--steps", str(args.steps)]
            run(quota, flags, run_dir, tmp, args.cores, devices=1)
            log = _read(tmp / "p0.log")
            shares = [line.split()[-2] for line in log.splitlines() if line.strip().startswith("ring device ")]
            steps = [t for s, t in sorted(step_times(run_dir).items()) if s > args.skip]
            rows.append({"scenario": name, "times": steps, "shares": ",".join(shares) or "even"})
            print(f"  median step {statistics.median(steps):.3f} s, tokens per device {rows[-1]['shares']}", flush=True)
    if quota is not None:
        quota.set_ratio(1.0)
    return rows


def context_markdown(args, rows: list[dict], started: str, elapsed: float) -> str:
    """The uneven-shards table: median step time of even and measured shards, the gain, the ideal (r+1)/2."""
    import jax

    r = args.context_ratio
    median = {name: statistics.median([t for row in rows if row["scenario"] == name for t in row["times"]])
              for name in ("even", "auto")}  # fmt: skip
    gain, ideal = median["even"] / median["auto"], (r + 1) / 2
    shares = next(row["shares"] for row in rows if row["scenario"] == "auto")
    lines = [
        CONTEXT_BEGIN,
        f"## Uneven sequence shards on the two-process cluster — {started[:10]}",
        "",
        f"`python bench/hetero_cluster.py --context --context-ratio {r:g} --context-len {args.context_len} "
        f"--steps {args.steps} --skip {args.skip} --rounds {args.rounds}`{' (as root)' if r > 1 else ''}, "
        f"jax {jax.__version__}, "
        f"{platform.machine()} {os.cpu_count()} cores ({platform.node()}), started {started}, {elapsed / 60:.0f} min. "
        f"Two processes x 1 CPU device, a ring over both (`{' '.join(CONTEXT_FLAGS)}`, `--seq-len "
        f"{args.context_len}`), process 0 pinned to core {args.cores[0]}, process 1 to core {args.cores[1]}"
        f"{f' and held to 1/{r:g} of it by a CPU-quota cgroup' if r > 1 else ', no quota'}. Median step time over "
        f"steps {args.skip + 1}-{args.steps} of "
        f"every round (the order reversed every other round).",
        "",
        "| shards | tokens per device | median step (s) | gain over even | ideal (r+1)/2 | % of ideal (target 80%) |",
        "|---|---|---:|---:|---:|---:|",
        f"| even | {args.context_len // 2},{args.context_len // 2} | {median['even']:.3f} | 1.00x | {ideal:.2f}x | |",
        f"| measured (`--context-shares auto`) | {shares} | {median['auto']:.3f} | {gain:.2f}x | {ideal:.2f}x | "
        f"{100 * gain / ideal:.0f}% |",
        CONTEXT_END,
    ]
    return "\n".join(lines) + "\n"


def stage_ideal(r: float, layers: int = 12) -> float:
    """Even split's time over the best integer split's, stage 1 ``r`` times slower (layers only)."""
    even = max(layers / 2, layers / 2 * r)
    best = min(max(n, (layers - n) * r) for n in range(1, layers))
    return even / best


def markdown(args, dp_rows, strag, stage_rows, started: str, elapsed: float) -> str:
    import jax

    lines = [
        BEGIN,
        f"## Mixed-speed cluster on one machine — {started[:10]}",
        "",
        f"`python bench/hetero_cluster.py --ratios {','.join(map(str, args.ratios))} --steps {args.steps} "
        f"--straggler-steps {args.straggler_steps}` (as root), jax {jax.__version__}, {platform.machine()} "
        f"{os.cpu_count()} cores ({platform.node()}), started {started}, {elapsed / 60:.0f} min. Two processes x 4 "
        f"CPU devices, process 0 pinned to core {args.cores[0]}, process 1 to core {args.cores[1]} and held to 1/r "
        f"of it by a CPU-quota cgroup; both cgroups at the highest CPU weight, so other work on the machine "
        f"yields to them. Flags: `{' '.join(COMMON)}` (48 sequences = 24 microbatches of 2). "
        f"Median step time over steps {args.skip + 1}-{args.steps}.",
        "",
        "| r | counts from | counts (last step) | median step (s) | gain over uniform | ideal (r+1)/2 | % of ideal |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in args.ratios:
        uniform = next(row["median"] for row in dp_rows if row["r"] == r and row["scenario"] == "uniform")
        for row in (x for x in dp_rows if x["r"] == r):
            gain, ideal = uniform / row["median"], (r + 1) / 2
            source = {
                "uniform": "uniform (3 each)",
                "kinds": f"datasheet `{row['kinds']}` (wrong on purpose)",
                "auto": "measured (`--hetero-batch auto`)",
            }[row["scenario"]]
            counts = ",".join(map(str, row["counts"])) if row["counts"] else UNIFORM
            lines.append(
                f"| {r} | {source} | {counts} | {row['median']:.3f} | {gain:.2f}x | {ideal:.2f}x | "
                f"{100 * gain / ideal:.0f}% |"
            )
    if strag:
        lines += ["", *straggler_summary(args, strag)]
    if stage_rows:
        even = stage_rows[0]["median"]
        lines += [
            "",
            f"`stage=2` across the two processes, process 1 at 1/{args.stage_ratio} of its core, "
            f"`{' '.join(STAGE_FLAGS)}`; ideal gain of the best integer split of 12 layers "
            f"{stage_ideal(args.stage_ratio):.2f}x:",
            "",
            "| split | layers | median step (s) | gain over even | % of ideal |",
            "|---|---|---:|---:|---:|",
        ]
        for row in stage_rows:
            gain = even / row["median"]
            lines.append(
                f"| {row['scenario']} | {row['layers']} | {row['median']:.3f} | {gain:.2f}x | "
                f"{100 * gain / stage_ideal(args.stage_ratio):.0f}% |"
            )
    lines.append(END)
    return "\n".join(lines) + "\n"


def straggler_summary(args, strag) -> list[str]:
    times, events = strag["times"], strag["events"]
    slow, fast = events.get("slow"), events.get("fast")
    before = median_after(times, args.skip, (slow or args.straggler_steps) - 1)
    out = [
        f"Straggler (`--hetero-batch auto --rebalance-every {args.rebalance_every}`, {args.straggler_steps} steps): "
        f"process 1 held to half its core from step {slow}, given it back from step {fast}; plot "
        f"`bench/results/{PLOT.name}`.",
        "",
    ]
    if slow:
        ideal = before * 2 / 1.5  # speeds 1 and 1/2 instead of 1 and 1: (1 + 1) / (1 + 1/2)
        window = args.rebalance_every + 5
        after = [(s, t) for s, t in sorted(times.items()) if slow <= s < (fast or 10**9)]
        back = next(
            (s for s, t in after if t <= 1.1 * ideal and all(u <= 1.1 * ideal for v, u in after if v >= s)), None
        )
        out += [
            "| phase | median step (s) | ideal (s) |",
            "|---|---:|---:|",
            f"| both at full speed (steps {args.skip + 1}-{slow - 1}) | {before:.3f} | {before:.3f} |",
            f"| process 1 at half speed, settled (last half of steps {slow}-{(fast or args.straggler_steps + 1) - 1})"
            f" | {statistics.median([t for _, t in after[len(after) // 2 :]]):.3f} | {ideal:.3f} |",
        ]
        if fast:
            restored = [t for s, t in sorted(times.items()) if s >= fast]
            out.append(
                f"| process 1 back at full speed (last half of steps {fast}-{args.straggler_steps}) | "
                f"{statistics.median(restored[len(restored) // 2 :]):.3f} | {before:.3f} |"
            )
        out += [
            "",
            f"Step time back within 10% of the new ideal from step {back} on "
            f"({'' if back is None else back - slow} steps after the slowdown; target at most "
            f"--rebalance-every + 5 = {window})."
            if back
            else f"Step time did not settle within 10% of the new ideal ({ideal:.3f} s).",
        ]
    counts = strag["counts"]
    changes = [(s, c) for s, c in sorted(counts.items()) if s == min(counts) or c != counts.get(s - 1)]
    out += [
        "",
        "Counts per device over the run: " + "; ".join(f"step {s}: {','.join(map(str, c))}" for s, c in changes),
    ]
    return out


def plot(strag, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = sorted(strag["times"].items())
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot([s for s, _ in times], [t for _, t in times], marker=".", label="step time")
    for name, step in strag["events"].items():
        ax.axvline(
            step,
            color="red" if name == "slow" else "green",
            linestyle="--",
            label="process 1 at 1/2 core" if name == "slow" else "process 1 at full core",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title(f"uneven counts rebalanced while training (--rebalance-every {strag.get('every', '')})")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def write_results(section: str, begin: str = BEGIN, end: str = END) -> None:
    text = _read(RESULTS)
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end) + 1 :]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--ratios", default="1.5,2,3", help="slow process's slowdowns r (default 1.5,2,3)")
    parser.add_argument("--steps", type=int, default=14, help="steps per data-parallel and stage run (default 14)")
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the medians (default 3)")
    parser.add_argument("--straggler-steps", type=int, default=36, help="steps of the straggler run; 0: skip it")
    parser.add_argument("--rebalance-every", type=int, default=3, help="the straggler run's --rebalance-every")
    parser.add_argument("--stage-ratio", type=float, default=2.0, help="r of the stage=2 runs; 0: skip them")
    parser.add_argument("--cores", default="0,1", help="the two cores to pin the processes to (default 0,1)")
    parser.add_argument("--no-results", action="store_true", help="print the table; leave bench/RESULTS.md alone")
    parser.add_argument(
        "--schedules",
        action="store_true",
        help="time the pipeline schedules (gpipe, 1f1b, 1f1b-fused, zb) on stage=2 across the two processes, "
        "M = 8, no quota (no root needed) instead of the uneven runs",
    )
    parser.add_argument(
        "--only",
        default=",".join(SCHEDULES),
        help="with --schedules: the schedules to time, gpipe among them (default all: " + ",".join(SCHEDULES) + ")",
    )
    parser.add_argument(
        "--flops",
        action="store_true",
        help="print the compiled step's FLOPs and temporaries of gpipe, 1f1b-fused and zb on the --schedules "
        "shapes (one process, 8 simulated devices; deterministic, no timing)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="with --schedules or --context: rounds over the runs (default 3)"
    )
    parser.add_argument(
        "--context",
        action="store_true",
        help="time even sequence shards against --context-shares auto on a ring over the two processes, process 1 "
        "at 1/--context-ratio of its core, instead of the uneven-batch runs",
    )
    parser.add_argument(
        "--context-ratio", type=float, default=2.0, help="with --context: r (default 2; 1: no cgroup, no root)"
    )
    parser.add_argument(
        "--context-len", type=int, default=8192, help="with --context: tokens per sequence (default 8192)"
    )
    args = parser.parse_args(argv)
    try:
        args.ratios = [float(r) for r in args.ratios.split(",")]
        args.cores = tuple(int(c) for c in args.cores.split(","))
    except ValueError:
        parser.error("--ratios and --cores take comma-separated numbers, e.g. --ratios 1.5,2,3 --cores 0,1")
    args.only = tuple(name for name in args.only.split(",") if name)
    if set(args.only) - set(SCHEDULES) or "gpipe" not in args.only:
        parser.error(
            f"--only {','.join(args.only)}: name schedules of {','.join(SCHEDULES)}, gpipe among them, e.g. --only gpipe,zb"
        )
    if args.flops:
        print(schedule_flops())
        return 0
    if any(r < 1 for r in args.ratios) or len(args.cores) != 2 or args.steps <= args.skip or args.rounds < 1:
        parser.error("--ratios must be >= 1, --cores two cores, --steps more than --skip, --rounds at least 1")
    available = os.sched_getaffinity(0)
    if not set(args.cores) <= available:
        parser.error(f"--cores {args.cores} are not all available here (cores {sorted(available)})")
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.perf_counter()
    if args.context:
        quota = CpuQuota() if args.context_ratio > 1 else None
        try:
            with tempfile.TemporaryDirectory() as tmp:
                rows = context(args, quota, Path(tmp))
        finally:
            if quota is not None:
                quota.set_ratio(1.0)
                quota.remove()
        section = context_markdown(args, rows, started, time.perf_counter() - t0)
        print(section)
        if not args.no_results:
            write_results(section, CONTEXT_BEGIN, CONTEXT_END)
            print(f"written to {RESULTS.relative_to(ROOT)}")
        return 0
    if args.schedules:
        with tempfile.TemporaryDirectory() as tmp:
            times = schedules(args, Path(tmp))
        section = schedules_markdown(args, times, started, time.perf_counter() - t0)
        print(section)
        if not args.no_results:
            write_results(section, SCHEDULES_BEGIN, SCHEDULES_END)
            print(f"written to {RESULTS.relative_to(ROOT)}")
        return 0
    quota = CpuQuota()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            dp_rows = data_parallel(args, quota, tmp) if args.ratios else []
            strag = straggler(args, quota, tmp) if args.straggler_steps else None
            if strag:
                strag["every"] = args.rebalance_every
                plot(strag, PLOT)
            stage_rows = stages(args, quota, tmp) if args.stage_ratio else []
    finally:
        quota.set_ratio(1.0)
        quota.remove()
    section = markdown(args, dp_rows, strag, stage_rows, started, time.perf_counter() - t0)
    print(section)
    if not args.no_results:
        write_results(section)
        print(f"written to {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
