"""``python -m train.data prepare``: raw sources -> tokenized ArrayRecord shards and a manifest.

The sources are cut into units of about ``shard_mb`` MB of input (`train.data.corpus.plan_units`); worker
processes tokenize one unit each into one shard. A shard is two ArrayRecord files, ``train-NNNNN`` and
``heldout-NNNNN`` (documents split by `train.data.corpus.is_heldout`), whose records are a document's tokens
cut into pieces of at most `RECORD_TOKENS` (the last piece of a document ends with the end-of-document token),
with a ``.lengths.npy`` of the records' token counts beside each, and a ``shard-NNNNN.json`` written last
(atomically) that marks the shard complete and holds each file's CRC-32 (checked when a run opens the folder
and by ``python -m train.data verify DIR``: a damaged file is named before any record of it is read). ``plan.json`` is written first and ``manifest.json`` last:

* a rerun on the same sources, tokenizer and settings finds the manifest and reuses the folder;
* an interrupted run finds the plan and tokenizes only the shards without their ``.json``;
* anything else in a non-empty ``--out`` is refused rather than overwritten.

Why ArrayRecord: it is the random-access format Grain reads natively (`grain.sources.ArrayRecordDataSource`
over many files is one indexable source), it reads one record by index without scanning, and it is written
by a streaming writer, so a worker holds one document at a time. Parquet is random-access only by row group
and `.npy` memmaps need one file sized up front; neither suits appending shards from parallel workers.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from checkpoints.argparser import Parser
from train.data.chat import load_chat_template
from train.data.corpus import SOURCE_HINT, Unit, corpus_files, is_heldout, jsonl_kind, plan_units, unit_documents
from train.data.integrity import SPLITS, file_crc32, shard_name, verify_command
from train.data.tokenizer import load_tokenizer
from train.setup.flagnames import render
from train.setup.folders import check_writable

FORMAT_VERSION = 1
RECORD_TOKENS = 4096
DEFAULT_SHARD_MB = 16
# Documents tokenized per call: a batch lets the Hugging Face tokenizer use its own threads; a bound on bytes keeps
# its per-token encodings (ids, offsets, strings: tens of bytes a token) from holding a worker's memory high.
ENCODE_BATCH_DOCS = 256
ENCODE_BATCH_BYTES = 1 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def preparation_key(
    specs: list[str], tokenizer, seed: int, heldout: float, shard_mb: float, text_field: str, flag: str = "--data"
) -> tuple[str, list[dict]]:
    """``(key, sources)``: a digest of everything a preparation depends on, and the source files with their
    sizes and modification times (what a rerun compares)."""
    sources, chat = [], False
    for spec in specs:
        for path in corpus_files(spec, flag):
            st = path.stat()
            sources.append({"spec": spec, "path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
            chat = chat or path.suffix == ".jsonl" and jsonl_kind(path, text_field) == "chat"
    h = hashlib.sha256()
    settings = [FORMAT_VERSION, RECORD_TOKENS, tokenizer.fingerprint, seed, heldout, shard_mb, text_field]
    if chat:  # the rendering is part of the tokens
        settings.append(load_chat_template(tokenizer).fingerprint)
    h.update(json.dumps([settings, sources, sys.version if "stdlib" in specs else ""]).encode())
    return h.hexdigest()[:20], sources


def _atomic_json(path: Path, value) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


# Workers ----------------------------------------------------------------------------------------------------

_WORKER_TOKENIZER: dict = {}


def _tokenizer(spec: tuple[str | None, str | None]):
    if spec not in _WORKER_TOKENIZER:
        _WORKER_TOKENIZER[spec] = load_tokenizer(*spec)
    return _WORKER_TOKENIZER[spec]


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored while worker processes start: they inherit the disposition, so a terminal's Ctrl-C (sent
    to the whole process group) reaches only the parent, which stops and terminates them on leaving the pool;
    one line is printed instead of a traceback per worker. Outside the main thread (no signals there) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class _ShardWriter:
    """One split of one shard: records of at most `RECORD_TOKENS` tokens, and their lengths. With ``masked``, a
    record is its tokens followed by their loss mask, one bit a token (`numpy.packbits`)."""

    def __init__(self, path: Path, masked: bool = False):
        from array_record.python.array_record_module import ArrayRecordWriter

        self.path, self.tmp = path, path.with_name(f".{path.name}.tmp{os.getpid()}")
        # group_size:1 makes every record its own chunk: a random read decodes only the record it asks for.
        self.writer = ArrayRecordWriter(str(self.tmp), "group_size:1")
        self.lengths: list[int] = []
        self.docs = self.tokens = 0
        self.masked = masked

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        """A document's tokens (and, when ``masked``, which of them carry loss: None for all)."""
        if self.masked and mask is None:
            mask = np.ones(len(ids), bool)
        for start in range(0, len(ids), RECORD_TOKENS):
            piece = ids[start : start + RECORD_TOKENS]
            record = piece.tobytes()
            if self.masked:
                record += np.packbits(mask[start : start + RECORD_TOKENS]).tobytes()
            self.writer.write(record)
            self.lengths.append(len(piece))
        self.docs += 1
        self.tokens += len(ids)

    def close(self) -> None:
        self.writer.close()
        lengths = self.path.with_suffix(".lengths.npy")
        tmp = lengths.with_name(f".{lengths.name}.tmp{os.getpid()}")
        with tmp.open("wb") as f:
            np.save(f, np.asarray(self.lengths, np.uint32))
        os.replace(tmp, lengths)
        self.crc32 = file_crc32(self.tmp)
        os.replace(self.tmp, self.path)


def _prepare_unit(job) -> dict:
    """Tokenizes one unit into shard ``index`` of ``out``; returns its counts (also written as its ``.json``)."""
    index, unit, out, tokenizer_spec, seed, heldout, text_field, flag, masked = job
    tokenizer = _tokenizer(tokenizer_spec)
    dtype = token_dtype(tokenizer.vocab_size)
    out = Path(out)
    writers = {split: _ShardWriter(out / shard_name(split, index), masked) for split in SPLITS}
    eod = np.array([tokenizer.eod_id], dtype)
    pending: list = []
    template = load_chat_template(tokenizer) if unit.kind == "chat" else None

    def flush():
        for doc, ids in zip(pending, tokenizer.encode_batch([d.text for d in pending])):
            split = "heldout" if is_heldout(doc.name, seed, heldout) else "train"
            writers[split].add(np.concatenate([ids.astype(dtype), eod]))
        pending.clear()

    pending_bytes = dropped = 0
    for doc in unit_documents(unit, text_field, flag):
        if doc.messages is not None:
            ids, mask = chat_tokens(doc.messages, template, tokenizer, f"{flag} {doc.name}")
            if not mask.any():  # nothing to learn: it would only dilute the loss's denominator with zero
                dropped += 1
                continue
            split = "heldout" if is_heldout(doc.name, seed, heldout) else "train"
            writers[split].add(np.concatenate([ids.astype(dtype), eod]), np.append(mask, False))
            continue
        pending.append(doc)
        pending_bytes += len(doc.text)
        if len(pending) >= ENCODE_BATCH_DOCS or pending_bytes >= ENCODE_BATCH_BYTES:
            flush()
            pending_bytes = 0
    flush()
    counts = {"index": index, "bytes": unit.nbytes, "dropped_docs": dropped}
    for split, writer in writers.items():
        writer.close()
        counts[f"{split}_docs"], counts[f"{split}_tokens"] = writer.docs, writer.tokens
        counts[f"{split}_crc32"] = writer.crc32
    _atomic_json(out / f"shard-{index:05d}.json", counts)
    return counts


def check_trainable(specs: list[str], flag: str, totals: dict, dropped: int, log) -> None:
    """Refuses chat data none of whose conversations has a token to train on (no assistant turn, or only
    empty ones), naming the sources; says how many were dropped when only some lack one.

    Raises:
      ValueError: every conversation was dropped.
    """
    if not dropped:
        return
    kept = totals["train_docs"] + totals["heldout_docs"]
    if kept == 0:
        raise ValueError(
            f"{flag} {' '.join(specs)}: none of its {dropped} conversations has an assistant turn with text, so "
            'there is no token to train on; give conversations with a {"role": "assistant", "content": "..."} message'
        )
    log(f"dropped {dropped} of {dropped + kept} conversations with no assistant text (no token to train on)")


def chat_tokens(messages: list[dict], template, tokenizer, where: str) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)``: the tokens of a conversation rendered by ``template`` (`train.data.chat`) and, for
    each, whether it starts inside an assistant turn (the tokens a chat example is trained on).

    Raises:
      ValueError: the template fails or hides the assistant's turns (prefixed by ``where``).
    """
    try:
        text, spans = template.assistant_spans(messages)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    ids, starts = tokenizer.encode_offsets(text)
    mask = np.zeros(len(ids), bool)
    for begin, end in spans:
        mask |= (starts >= begin) & (starts < end)
    return ids, mask


# The preparation ----------------------------------------------------------------------------------------------


def prepare(
    specs: list[str],
    out: str | Path,
    tokenizer,
    *,
    workers: int | None = None,
    seed: int = 0,
    heldout: float = 0.01,
    text_field: str = "text",
    shard_mb: float = DEFAULT_SHARD_MB,
    log=print,
    progress: bool = True,
    flag: str = "--data",
    key: str | None = None,
) -> dict:
    """Prepares ``specs`` into ``out`` (see the module docstring); returns the manifest.

    Args:
      specs: sources (`train.data.corpus`).
      out: the output folder.
      tokenizer: a `train.data.tokenizer` tokenizer (its name and end-of-document token are reloaded in workers).
      workers: worker processes (None: the cores; 1: in this process).
      seed, heldout: the held-out split (`train.data.corpus.is_heldout`).
      text_field: JSONL field / Parquet column holding the text.
      shard_mb: input megabytes per shard.
      log: one-line messages.
      progress: show a progress bar (on a terminal).
      flag: the flag the sources came from, for messages.
      key: `preparation_key` of these arguments when the caller has it (the sources are not listed again).

    Several processes preparing the same ``out`` at once (the processes of one run on a shared file system)
    take turns on a lock file beside it, ``.NAME.lock`` (``fcntl.flock``): the first prepares, the others then
    reuse. The holder removes the file before it lets go; a process that then gets the lock of a removed
    file opens the path again, so no two hold the lock at once.

    Raises:
      ValueError: a non-empty ``out`` holding something else, a source without text, or bad settings.
      FileNotFoundError, ImportError: as `train.data.corpus.plan_units`.
    """
    import fcntl

    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    while True:
        lock = open(lock_path, "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.fstat(lock.fileno()).st_ino == os.stat(lock_path).st_ino:
                break  # the file we hold is still the one at the path
        except FileNotFoundError:
            pass
        lock.close()  # its holder removed it meanwhile: take the path's new file
    try:
        return _prepare(specs, out, tokenizer, workers, seed, heldout, text_field, shard_mb, log, progress, flag, key)
    finally:
        lock_path.unlink(missing_ok=True)
        lock.close()


def _prepare(specs, out, tokenizer, workers, seed, heldout, text_field, shard_mb, log, progress, flag, key) -> dict:
    """`prepare`, holding its lock."""
    if not 0.0 < heldout < 1.0:
        raise ValueError(f"--heldout {heldout}: must be between 0 and 1, e.g. --heldout 0.01")
    if not (math.isfinite(shard_mb) and shard_mb > 0):  # nan and inf pass a plain `<= 0`, then fail in int()
        raise ValueError(f"--shard-mb {shard_mb}: must be a positive number, e.g. --shard-mb {DEFAULT_SHARD_MB}")
    manifest_path, plan_path = out / "manifest.json", out / "plan.json"
    if key is not None and manifest_path.is_file() and json.loads(manifest_path.read_text()).get("key") == key:
        log(f"reusing the prepared data in {out} (same sources, tokenizer and settings)")
        return json.loads(manifest_path.read_text())
    key, sources = preparation_key(specs, tokenizer, seed, heldout, shard_mb, text_field, flag)
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("key") == key:
            log(f"reusing the prepared data in {out} (same sources, tokenizer and settings)")
            return manifest
    if (
        plan_path.is_file()
        and json.loads(plan_path.read_text()).get("key") != key
        or (not plan_path.is_file() and out.is_dir() and any(out.iterdir()))
    ):
        raise ValueError(
            f"--out {out}: holds other files or a preparation of other sources or settings; "
            f"choose an empty or new folder, e.g. --out {out}-2"
        )
    units: list[Unit] = []
    for spec in specs:
        units.extend(plan_units(spec, int(shard_mb * 2**20), text_field, flag))
    out.mkdir(parents=True, exist_ok=True)
    _atomic_json(plan_path, {"key": key, "units": len(units)})
    done = {
        i: json.loads((out / f"shard-{i:05d}.json").read_text())
        for i in range(len(units))
        if (out / f"shard-{i:05d}.json").is_file()
    }
    todo = [i for i in range(len(units)) if i not in done]
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    resumed = f", resuming: {len(done)} of {len(units)} shards already done" if done else ""
    log(f"preparing {', '.join(specs)} into {out}: {len(units)} shards, {workers} workers, {tokenizer.name}{resumed}")
    tokenizer_spec = (None if tokenizer.name == "bytes" else tokenizer.name, getattr(tokenizer, "eod_token", None))
    masked = any(unit.kind == "chat" for unit in units)
    jobs = [(i, units[i], str(out), tokenizer_spec, seed, heldout, text_field, flag, masked) for i in todo]
    t0 = time.perf_counter()
    bar = _Progress(sum(units[i].nbytes for i in todo), progress)
    try:
        if workers == 1:
            results = map(_prepare_unit, jobs)
            for counts in results:
                done[counts["index"]] = counts
                bar.update(counts)
        else:
            import multiprocessing

            # spawn: the parent may hold JAX's or the tokenizer's threads, which a fork would copy mid-state
            with _sigint_ignored():  # the workers inherit it from their first instruction
                pool = multiprocessing.get_context("spawn").Pool(workers)
            with pool:
                for counts in pool.imap_unordered(_prepare_unit, jobs):
                    done[counts["index"]] = counts
                    bar.update(counts)
    finally:
        bar.close()
    shards = [done[i] for i in range(len(units))]
    totals = {f"{s}_{k}": sum(c[f"{s}_{k}"] for c in shards) for s in SPLITS for k in ("docs", "tokens")}
    check_trainable(specs, flag, totals, sum(c.get("dropped_docs", 0) for c in shards), log)
    if totals["train_docs"] + totals["heldout_docs"] == 0:
        raise ValueError(
            f"{flag} {' '.join(specs)}: no document with text in {len(sources)} file(s) (field '{text_field}'); "
            f"{SOURCE_HINT}"
        )
    manifest = {
        "format": FORMAT_VERSION,
        "key": key,
        "record_tokens": RECORD_TOKENS,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "tokenizer": {
            "name": tokenizer.name,
            "fingerprint": tokenizer.fingerprint,
            "eod_id": int(tokenizer.eod_id),
            "vocab_size": int(tokenizer.vocab_size),
        },
        "split": {"seed": seed, "heldout": heldout, "rule": "crc32('{seed}:{name}') / 2**32 < heldout"},
        "text_field": text_field,
        "loss_mask": masked,
        "chat_template": load_chat_template(tokenizer).origin if masked else None,
        "shard_mb": shard_mb,
        "sources": sources,
        "shards": shards,
        **totals,
        "dropped_docs": sum(c.get("dropped_docs", 0) for c in shards),
    }
    _atomic_json(manifest_path, manifest)
    elapsed = time.perf_counter() - t0
    docs = sum(c["train_docs"] + c["heldout_docs"] for c in shards if c["index"] in todo)
    tokens = sum(c["train_tokens"] + c["heldout_tokens"] for c in shards if c["index"] in todo)
    log(
        f"prepared {totals['train_docs'] + totals['heldout_docs']:,} documents, {totals['train_tokens']:,} training and "
        f"{totals['heldout_tokens']:,} held-out tokens in {elapsed:.1f} s "
        f"({docs / max(elapsed, 1e-9):,.0f} docs/s, {tokens / max(elapsed, 1e-9):,.0f} tokens/s)"
    )
    return manifest


class _Progress:
    """A tqdm bar over input bytes, with documents/s and tokens/s (off when not on a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        self.docs = self.tokens = 0
        self.t0 = time.perf_counter()
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, dynamic_ncols=True, desc="prepare")

    def update(self, counts: dict) -> None:
        self.docs += counts["train_docs"] + counts["heldout_docs"]
        self.tokens += counts["train_tokens"] + counts["heldout_tokens"]
        if self.bar is not None:
            elapsed = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.docs / elapsed:,.0f} docs/s, {self.tokens / elapsed:,.0f} tokens/s")
            self.bar.update(counts["bytes"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def build_parser() -> argparse.ArgumentParser:

    parser = Parser(
        prog="python -m train.data",
        description="Tokenize raw sources into ArrayRecord shards that training reads with --data DIR.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenize sources into shards and a manifest")
    p.add_argument("sources", nargs="+", metavar="SRC", help="text file, folder, .jsonl, .parquet, or stdlib")
    p.add_argument("--out", required=True, help="output folder (reused when prepared before from the same sources)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: UTF-8 bytes)")
    p.add_argument("--eod-token", default=None, help="end-of-document token of --tokenizer")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: the cores)")
    p.add_argument("--text-field", default="text", help="JSONL field or Parquet column holding the text")
    p.add_argument("--heldout", type=float, default=0.01, help="share of documents held out")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out split (training's --seed)")
    p.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_MB, help="input megabytes per shard")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    v = commands.add_parser("verify", help="check a prepared folder's shards against their token counts and CRC-32s")
    v.add_argument("folder", metavar="DIR", help="a folder written by prepare")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``prepare`` and ``verify`` commands (`train.data.integrity.verify_command`); a refused input is one line on stderr and exit status 2, Ctrl-C one line and
    exit status 130 (the shards already written are kept: the same command resumes)."""
    args = build_parser().parse_args(argv)
    if args.command == "verify":
        return verify_command(args.folder)
    try:
        if args.workers is not None and args.workers < 1:
            raise ValueError(f"--workers {args.workers}: must be at least 1, e.g. --workers 2")
        tokenizer = load_tokenizer(args.tokenizer, args.eod_token)
        check_writable(Path(args.out).expanduser(), "--out")  # a file in the way, no permission: before reading
        prepare(
            args.sources,
            args.out,
            tokenizer,
            workers=args.workers,
            seed=args.seed,
            heldout=args.heldout,
            text_field=args.text_field,
            shard_mb=args.shard_mb,
            progress=not args.no_progress,
            flag="SRC",
        )
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {render(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"error: interrupted (Ctrl-C); the shards already written to {args.out} are kept: the same command "
            "tokenizes only the rest",
            file=sys.stderr,
        )
        return 130
    return 0
