"""Throughput of ``python -m train.data prepare`` on a generated corpus.

Makes a corpus of about ``--mb`` MB from the standard library's sources, each pass over them in a freshly
shuffled order, as JSONL (``--format jsonl``) or Parquet (``--format parquet``, row groups of 1,000 rows),
then runs ``python -m train.data prepare`` on it under ``/usr/bin/time -v`` once per ``--workers`` value and
prints a table: wall seconds, CPU seconds (user + system, the parent and its workers), documents/s, tokens/s, input MB/s and the peak RSS of the largest process
(the parent, or one worker: ``time -v`` reports the largest of the process and its waited-for children).

    python bench/prepare.py --mb 200 --format jsonl --workers 1 2

``--loader DIR`` instead measures the input pipeline alone on a prepared folder (no model): tokens/s of
`train.data.TrainBatches` at ``--seq-len`` and ``--batch-size`` over ``--steps`` steps, one process reading
every row, after a warm-up of 5 steps.

    python bench/prepare.py --loader ~/.cache/meshwork/prepared/KEY --seq-len 256 --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_corpus(folder: Path, mb: float, fmt: str) -> Path:
    import numpy as np

    from train.data.corpus import corpus_files

    files = corpus_files("stdlib")
    texts = [f.read_text(errors="replace") for f in files]
    rng = np.random.default_rng(0)
    target, size, rows = mb * 2**20, 0, []
    while size < target:
        for i in rng.permutation(len(texts)):
            rows.append(texts[i])
            size += len(texts[i].encode())
            if size >= target:
                break
    if fmt == "jsonl":
        path = folder / "corpus.jsonl"
        with path.open("w") as f:
            for text in rows:
                f.write(json.dumps({"text": text}) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "corpus.parquet"
        pq.write_table(pa.table({"text": rows}), path, row_group_size=1000)
    return path


def run(path: Path, out: Path, workers: int, tokenizer: str | None) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "train.data", "prepare", str(path), "--out", str(out)]
    cmd += ["--workers", str(workers), "--no-progress"] + (["--tokenizer", tokenizer] if tokenizer else [])
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    cpu = sum(
        float(re.search(rf"{kind} time \(seconds\): ([\d.]+)", done.stderr).group(1)) for kind in ("User", "System")
    )
    manifest = json.loads((out / "manifest.json").read_text())
    docs = manifest["train_docs"] + manifest["heldout_docs"]
    tokens = manifest["train_tokens"] + manifest["heldout_tokens"]
    return {"workers": workers, "wall": wall, "cpu": cpu, "docs": docs, "tokens": tokens, "rss_mb": rss_kb / 1024}


def loader(args) -> int:
    from train.data import load_dataset
    from train.tokenizer import load_tokenizer

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200)
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json (default: bytes)")
    parser.add_argument("--loader", default=None, help="a prepared folder: measure the input pipeline alone")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--keep", default=None, help="write the prepared folders under this folder (kept)")
    args = parser.parse_args()
    if args.loader:
        return loader(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_corpus(Path(tmp), args.mb, args.format)
        mb = path.stat().st_size / 2**20
        print(f"corpus: {path.name}, {mb:.0f} MB; tokenizer {args.tokenizer or 'bytes'}")
        print("| workers | wall s | CPU s | documents/s | tokens/s | tokens per CPU s | input MB/s | peak RSS MB |")
        print("|---|---|---|---|---|---|---|---|")
        for workers in args.workers:
            out = Path(args.keep) / f"w{workers}" if args.keep else Path(tmp) / f"out{workers}"
            r = run(path, out, workers, args.tokenizer)
            print(
                f"| {workers} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['docs'] / r['wall']:,.0f} | "
                f"{r['tokens'] / r['wall']:,.0f} | {r['tokens'] / r['cpu']:,.0f} | {mb / r['wall']:.1f} | "
                f"{r['rss_mb']:.0f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
