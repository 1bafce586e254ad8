"""The prepared-data targets: ``python -m train.data prepare`` on generated corpora, and training on the result.

One command measures every figure of the targets (run it under ``nice -n 19`` on a shared machine; the memory
and CPU-second figures do not depend on the load, the wall-clock ones do):

    python bench/prepare.py --keep /tmp/prep-bench --results

1. **Prepare.** For each ``--sizes`` (MB; default 200 and 2048) a corpus is generated from the standard
   library's sources, each pass over them in a freshly shuffled order, one document per source file, as JSONL
   (``--format jsonl``) or Parquet (``--format parquet``, row groups of 1,000 rows), written as it is generated
   (the generator holds the 30 MB of sources, never the corpus). ``python -m train.data prepare`` runs on it
   under ``/usr/bin/time -v`` once per ``--workers`` value, each into a fresh folder: wall and CPU seconds
   (user + system of the command and its waited-for workers), documents/s, tokens/s, the peak RSS of the
   largest single process (``time -v``) and the peak of the whole process tree's RSS summed (sampled every
   0.1 s from ``/proc``; shared pages counted once per process, so an upper bound). The generated corpus is
   deleted once its runs are done; of the preparations only the largest corpus's last one is kept, for step 2.
2. **Train.** ``python -m train.train --cpu-devices 8 --model small`` (the ``make train`` settings: sequence 256,
   global batch 16) for ``--train-steps`` steps on that preparation, then the same run on a preparation of
   ``stdlib``: start-up (wall seconds from launching the command to the start of the train step's compilation:
   imports, devices, opening the data, initialising the state and reading the first batch; compilation and the
   step-0 evaluation excluded; and the CPU seconds the process had spent when it logged that it starts
   compiling, a figure the load does not change), input wait per step against the step time (``perf/input_wait`` and
   ``perf/step_time`` of every log interval after the first, whose time includes the compilation) and the
   training process's peak RSS.

``--keep DIR`` writes everything under DIR and leaves the kept preparations and ``figures.json`` there;
``--reuse`` (with ``--keep DIR``) skips step 1 and trains on DIR's kept preparations, reprinting step 1's
recorded figures. ``--results`` writes the section into ``bench/RESULTS.md`` (between ``prepare_targets``
markers). A short check of the script: ``python bench/prepare.py --sizes 4 12 --train-steps 4 --log-every 1``.

``--loader DIR`` instead measures the input pipeline alone on a prepared folder (no model): tokens/s of
`train.data.TrainBatches` at ``--seq-len`` and ``--batch-size`` over ``--steps`` steps, one process reading
every row, after a warm-up of 5 steps.

    python bench/prepare.py --loader ~/.cache/meshwork/prepared/KEY --seq-len 256 --batch-size 16
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetero_cluster import metric, write_results  # noqa: E402  (bench/ is the script's folder)

BEGIN, END = "<!-- prepare_targets:begin -->", "<!-- prepare_targets:end -->"
TRAIN_FLAGS = ["--cpu-devices", "8", "--model", "small", "--eval-every", "0", "--eval-batches", "1", "--no-progress"]


def make_corpus(folder: Path, mb: float, fmt: str) -> Path:
    """A corpus of at least ``mb`` MiB of text (see the module docstring), written as it is generated."""
    import numpy as np

    from train.data.corpus import corpus_files

    texts = [f.read_text(errors="replace") for f in corpus_files("stdlib")]
    sizes = [len(t.encode()) for t in texts]
    rng = np.random.default_rng(0)

    def documents():
        """Indices into ``texts``: shuffled passes until ``mb`` MiB of text."""
        size = 0
        while True:
            for i in rng.permutation(len(texts)):
                yield i
                size += sizes[i]
                if size >= mb * 2**20:
                    return

    if fmt == "jsonl":
        lines = [(json.dumps({"text": t}) + "\n").encode() for t in texts]
        path = folder / f"corpus-{mb:g}mb.jsonl"
        with path.open("wb", buffering=1 << 22) as f:
            for i in documents():
                f.write(lines[i])
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / f"corpus-{mb:g}mb.parquet"
    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        rows = []
        for i in documents():
            rows.append(texts[i])
            if len(rows) == 1000:
                writer.write_table(pa.table({"text": rows}, schema=schema), row_group_size=1000)
                rows = []
        if rows:
            writer.write_table(pa.table({"text": rows}, schema=schema), row_group_size=1000)
    return path


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants, found from every process's parent in ``/proc/PID/stat``."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2 :].split()[1])  # field 4: the parent
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(child for child, parent in parents.items() if parent == pid)
    return pids


def tree_cpu(root: int) -> float:
    """CPU seconds (user + system) spent so far by ``root`` and its descendants (``/proc/PID/stat``)."""
    total = 0
    for pid in process_tree(root):
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # fields 14 and 15: utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


class TreeRss:
    """The peak of a process tree's summed RSS, sampled from ``/proc`` every ``period`` seconds (a thread)."""

    def __init__(self, pid: int, period: float = 0.1):
        self.pid, self.period, self.peak_kb = pid, period, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.period):
            total = 0
            for pid in process_tree(self.pid):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                found = re.search(r"VmRSS:\s+(\d+) kB", status)
                total += int(found.group(1)) if found else 0
            self.peak_kb = max(self.peak_kb, total)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak_kb


def time_v(stderr: str) -> dict:
    """Peak RSS (kB) and CPU seconds (user + system) from ``/usr/bin/time -v``'s report."""
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr).group(1))
    cpu = sum(float(re.search(rf"{kind} time \(seconds\): ([\d.]+)", stderr).group(1)) for kind in ("User", "System"))
    return {"rss_mb": rss_kb / 1024, "cpu": cpu}


def run_prepare(path: Path, out: Path, workers: int, tokenizer: str | None) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "train.data", "prepare", str(path), "--out", str(out)]
    cmd += ["--workers", str(workers), "--no-progress"] + (["--tokenizer", tokenizer] if tokenizer else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree = TreeRss(proc.pid)
    stdout, stderr = proc.communicate()
    wall, tree_kb = time.perf_counter() - t0, tree.stop()
    if proc.returncode:
        raise SystemExit(f"prepare failed ({proc.returncode}): {stderr[-2000:]}")
    manifest = json.loads((out / "manifest.json").read_text())
    return {
        "input_mb": path.stat().st_size / 2**20,
        "workers": workers,
        "wall": wall,
        "docs": manifest["train_docs"] + manifest["heldout_docs"],
        "tokens": manifest["train_tokens"] + manifest["heldout_tokens"],
        "tree_rss_mb": tree_kb / 1024,
        "output_mb": sum(f.stat().st_size for f in out.iterdir()) / 2**20,
        **time_v(stderr),
    }


def prepare_figures(args, work: Path) -> tuple[list[dict], Path]:
    """Step 1: every size and worker count; returns the figures and the kept preparation."""
    figures, kept = [], None
    for mb in args.sizes:
        corpus = make_corpus(work, mb, args.format)
        print(f"corpus {corpus.name}: {corpus.stat().st_size / 2**20:,.0f} MB", flush=True)
        for workers in args.workers:
            out = work / f"prepared-{mb:g}mb-w{workers}"
            shutil.rmtree(out, ignore_errors=True)
            figures.append(run_prepare(corpus, out, workers, args.tokenizer))
            print(prepare_row(figures[-1]), flush=True)
            if kept is not None:
                shutil.rmtree(kept)
            kept = out
        corpus.unlink()  # generated corpora never outlive their runs
    return figures, kept


PREPARE_HEADER = (
    "| input MB | workers | wall s | CPU s | documents/s | tokens/s | tokens per CPU s | peak RSS MB, largest process | "
    "peak RSS MB, process tree | output MB |\n|---|---|---|---|---|---|---|---|---|---|"
)


def prepare_row(r: dict) -> str:
    return (
        f"| {r['input_mb']:,.0f} | {r['workers']} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['docs'] / r['wall']:,.0f} | "
        f"{r['tokens'] / r['wall']:,.0f} | {r['tokens'] / r['cpu']:,.0f} | {r['rss_mb']:.0f} | {r['tree_rss_mb']:.0f} | "
        f"{r['output_mb']:,.0f} |"
    )


def run_training(data: Path, run_dir: Path, steps: int, log_every: int) -> dict:
    """One training run on a prepared folder; start-up, input wait, step time and peak RSS (module docstring)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = ["/usr/bin/time", "-v", sys.executable, "-u", "-m", "train.train", *TRAIN_FLAGS, "--data", str(data)]
    cmd += ["--steps", str(steps), "--log-every", str(log_every), "--run-dir", str(run_dir)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)
    reader.start()
    startup = startup_cpu = None
    for line in proc.stdout:
        if line.startswith("compiling the train step ...") and startup_cpu is None:
            startup_cpu = tree_cpu(proc.pid)
        found = re.search(r"compiled the train step in ([\d.]+) s", line)
        if found and startup is None:
            startup = time.perf_counter() - t0 - float(found.group(1))
    proc.wait()
    reader.join()
    stderr = "".join(errors)
    if proc.returncode or startup is None:
        raise SystemExit(f"training on {data} failed ({proc.returncode}): {stderr[-2000:]}")
    waits, times = metric(run_dir, "perf/input_wait"), metric(run_dir, "perf/step_time")
    later = sorted(waits)[1:] or sorted(waits)  # the first interval's time includes the compilation
    shares = [waits[s] / times[s] for s in later]
    return {
        "data": str(data),
        "startup": startup,
        "startup_cpu": startup_cpu,
        "wait_max_ms": 1e3 * max(waits[s] for s in later),
        "wait_share_max": max(shares),
        "wait_share_median": statistics.median(shares),
        "step_time": statistics.median(times[s] for s in later),
        "intervals": len(later),
        **time_v(stderr),
    }


def training_figures(args, work: Path, kept: Path) -> list[dict]:
    stdlib = work / "prepared-stdlib"
    subprocess.run(
        [sys.executable, "-m", "train.data", "prepare", "stdlib", "--out", str(stdlib), "--no-progress"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    runs = []
    for data, name in ((kept, "large"), (stdlib, "stdlib")):
        runs.append(run_training(data, work / f"run-{name}", args.train_steps, args.log_every))
        runs[-1]["tokens"] = json.loads((data / "manifest.json").read_text())["train_tokens"]
        print(train_row(runs[-1]), flush=True)
    return runs


TRAIN_HEADER = (
    "| prepared data | training tokens | start-up s (to compiling) | start-up CPU s | step time s (median) | "
    "input wait ms (max) | input wait / step time (median, max) | peak RSS MB | CPU s |\n|---|---|---|---|---|---|---|---|---|"
)


def train_row(r: dict) -> str:
    return (
        f"| {Path(r['data']).name} | {r['tokens']:,} | {r['startup']:.1f} | {r.get('startup_cpu', float('nan')):.1f} | "
        f"{r['step_time']:.2f} | "
        f"{r['wait_max_ms']:.1f} | {100 * r['wait_share_median']:.2f}%, {100 * r['wait_share_max']:.2f}% | "
        f"{r['rss_mb']:,.0f} | {r['cpu']:.1f} |"
    )


def section(args, prep: list[dict], runs: list[dict], command: str) -> str:
    from importlib.metadata import version

    lines = [
        BEGIN,
        f"### Prepare and train at {max(r['input_mb'] for r in prep):,.0f} MB: the targets - {datetime.date.today()}",
        "",
        f"`{command}` on {platform.node()} ({os.cpu_count()} cores, load average "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end), Python {platform.python_version()}, "
        f"jax {version('jax')}; {args.format} corpora of the standard library's sources, tokenizer "
        f"{args.tokenizer or 'bytes'}.",
        "",
        PREPARE_HEADER,
        *map(prepare_row, prep),
    ]
    if runs:
        large, small = runs
        lines += [
            "",
            f"Training `small` on 8 CPU devices, {args.train_steps} steps (log every {args.log_every}; the "
            "first interval left out of the step and wait figures):",
            "",
            TRAIN_HEADER,
            *map(train_row, runs),
            "",
            f"Peak RSS of the training process, large against stdlib: {100 * (large['rss_mb'] / small['rss_mb'] - 1):+.1f}%.",
        ]
    return "\n".join(lines + [END, ""])


def loader(args) -> int:
    from train.data import load_dataset
    from train.data.tokenizer import load_tokenizer

    dataset = load_dataset(args.loader, load_tokenizer(args.tokenizer), args.seq_len, args.batch_size, seed=0)
    batches = dataset.train_batches(range(args.batch_size), 0)
    for _ in range(5):
        next(batches)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        next(batches)
    elapsed = time.perf_counter() - t0
    tokens = args.steps * args.batch_size * args.seq_len
    print(
        f"loader: {args.steps} steps of {args.batch_size} x {args.seq_len} in {elapsed:.2f} s: {tokens / elapsed:,.0f} tok/s"
    )
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[200, 2048], help="corpus sizes, MB")
    parser.add_argument("--mb", type=float, default=None, help="one corpus size, MB (earlier spelling of --sizes)")
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json (default: bytes)")
    parser.add_argument("--train-steps", type=int, default=20, help="steps of each training run (0: no training)")
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--keep", default=None, help="work in this folder and keep its preparations and figures")
    parser.add_argument("--reuse", action="store_true", help="with --keep: train on its kept preparation")
    parser.add_argument("--results", action="store_true", help="write the section into bench/RESULTS.md")
    parser.add_argument("--loader", default=None, help="a prepared folder: measure the input pipeline alone")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300, help="--loader: steps to time")
    args = parser.parse_args(argv)
    if args.loader:
        return loader(args)
    if args.mb is not None:
        args.sizes = [args.mb]
    if args.reuse and not args.keep:
        parser.error("--reuse reads a kept preparation: give its folder, e.g. --keep /tmp/prep-bench --reuse")
    if args.reuse and args.tokenizer:
        parser.error("--reuse trains with the bytes tokenizer; drop --tokenizer")
    command = "python bench/prepare.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with contextlib.ExitStack() as stack:
        work = Path(args.keep).expanduser() if args.keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        record = work / "figures.json"
        if args.reuse:
            saved = json.loads(record.read_text())
            prep, kept = saved["prepare"], Path(saved["kept"])
            print(PREPARE_HEADER + "\n" + "\n".join(map(prepare_row, prep)), flush=True)
        else:
            print(PREPARE_HEADER, flush=True)
            prep, kept = prepare_figures(args, work)
            record.write_text(json.dumps({"prepare": prep, "kept": str(kept)}, indent=1))
        runs = []
        if args.train_steps and args.tokenizer is None:  # the trainer reads the bytes preparation
            print(TRAIN_HEADER, flush=True)
            runs = training_figures(args, work, kept)
            record.write_text(json.dumps({"prepare": prep, "kept": str(kept), "train": runs}, indent=1))
        text = section(args, prep, runs, command)
        print(text)
        if args.results:
            write_results(text, BEGIN, END)
            print("written to bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
