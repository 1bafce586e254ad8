"""Corpus -> tokens -> packed global batches, each process loading only its rows.

Pipeline:

1. **Corpus.** ``stdlib`` (the default) is the ``.py`` sources of the running
   interpreter's standard library (about 30 MB of real text on every
   machine); a path is a text file, a folder of text files, or JSONL whose
   lines carry a ``text`` field. A file is one document, a JSONL line is one.
2. **Split.** A document is held out when a hash of ``(seed, its name)``
   falls under ``heldout`` (fixed by seed; at least one document each side;
   a corpus of one document holds out its tail).
3. **Tokens.** Each split is tokenized once, documents shuffled by seed and
   each followed by the end-of-document (EOD) token, and cached as a flat
   NumPy memmap under ``cache_dir`` (keyed by corpus, tokenizer and seed).
4. **Windows.** The stream is cut into windows of ``seq_len + 1`` tokens with
   stride ``seq_len``; inputs are ``window[:-1]``, targets ``window[1:]``.
   Training visits windows in a seeded permutation per epoch; sample ``i``
   of the run is window ``perm[epoch(i)][i mod W]``.
5. **Packing.** Inside a window, ``segment_ids`` number the documents from 1
   (an EOD belongs to the document it ends), ``positions`` restart at 0 in
   each document, and ``loss_mask`` is 0 where the input is an EOD (its
   target opens another document), so no loss and no attention crosses a
   document boundary.
6. **Context layout.** With context parallelism (the length split over P
   devices of the ``sequence`` axis) and the ``zigzag`` layout, every field
   of a row is permuted the same way along the length
   (`context_permutation`: device r's slice holds chunks r and 2P-1-r of 2P),
   so causal ring attention does equal work on every device. Positions and
   segment ids travel with their tokens and the loss is a masked sum over
   tokens, so the loss is unchanged.

The only state is the number of samples consumed, saved with checkpoints, so
a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
import zlib
from pathlib import Path

import numpy as np

FIELDS = ("tokens", "targets", "positions", "segment_ids", "loss_mask")
CACHE_VERSION = "v1"


def default_cache_dir() -> Path:
    """``$MESHWORK_CACHE``, else ``~/.cache/meshwork``."""
    return Path(os.environ.get("MESHWORK_CACHE", Path.home() / ".cache" / "meshwork"))


# Corpus ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Document:
    name: str
    text: bytes


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[Path]:
    root = stdlib_root()
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def corpus_files(spec: str) -> list[Path]:
    """The files a ``--data`` value names, sorted.

    Raises:
      FileNotFoundError: the path does not exist.
      ValueError: a folder with no files, or an empty corpus.
    """
    if spec == "stdlib":
        files = _stdlib_files()
        if not files:
            raise ValueError(f"--data stdlib: no .py files under {stdlib_root()}; give --data PATH")
        return files
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--data {spec}: no such file or folder (give a text file, a folder or a .jsonl file)")
    if path.is_file():
        files = [path]
    else:
        files = sorted(
            p for p in path.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)
        )
    if not files or all(f.stat().st_size == 0 for f in files):
        raise ValueError(f"--data {spec}: no non-empty files found (give a text file, a folder or a .jsonl file)")
    for file in files:
        check_text(file)
    return files


# Share of printable characters (or whitespace) a text sample must reach; binary data falls far below it.
MIN_PRINTABLE = 0.9
TEXT_SAMPLE_BYTES = 8192


def check_text(path: Path, sample_bytes: int = TEXT_SAMPLE_BYTES) -> None:
    """Refuses a file that is not text: the first ``sample_bytes`` bytes must decode as UTF-8 and be at least
    `MIN_PRINTABLE` printable characters or whitespace.

    Raises:
      ValueError: Naming the path, where it stops being UTF-8 or its printable share.
    """
    import codecs

    with path.open("rb") as f:
        sample = f.read(sample_bytes)
    try:  # an incremental decoder does not fail on a character cut at the end of the sample
        text = codecs.getincrementaldecoder("utf-8")().decode(sample, final=False)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"--data {path}: not UTF-8 text (byte {e.start} is {sample[e.start]:#04x}); give text files "
            f"(UTF-8), a folder of them or a .jsonl file with a 'text' field"
        ) from None
    printable = sum(c.isprintable() or c.isspace() for c in text)
    if text and printable < MIN_PRINTABLE * len(text):
        raise ValueError(
            f"--data {path}: does not look like text ({printable / len(text):.0%} of its first "
            f"{len(sample)} bytes are printable characters, below {MIN_PRINTABLE:.0%}); give text files"
        )


def read_documents(spec: str) -> list[Document]:
    """Reads the corpus into documents (bytes, UTF-8).

    Raises:
      ValueError: a JSONL line that is not an object with a string ``text``
        field (names the file and line), or a corpus with no text.
    """
    files = corpus_files(spec)
    root = stdlib_root() if spec == "stdlib" else Path(spec).expanduser()
    docs: list[Document] = []
    for path in files:
        name = str(path.relative_to(root)) if path != root else path.name
        if path.suffix == ".jsonl":
            docs.extend(_read_jsonl(path, name))
        else:
            text = path.read_bytes()
            if text:
                docs.append(Document(name, text))
    if not docs:
        raise ValueError(f"--data {spec}: the corpus holds no text")
    return docs


def _read_jsonl(path: Path, name: str) -> list[Document]:
    docs = []
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--data {path}: line {number} is not JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"--data {path}: line {number} has no string field 'text'")
            if record["text"]:
                docs.append(Document(f"{name}:{number}", record["text"].encode("utf-8")))
    return docs


def split_documents(docs: list[Document], heldout: float, seed: int) -> tuple[list[Document], list[Document]]:
    """Splits documents into (train, heldout) by a seeded hash of their names."""
    if not 0.0 < heldout < 1.0:
        raise ValueError(f"--heldout {heldout}: must be between 0 and 1, e.g. 0.01")
    scores = [zlib.crc32(f"{seed}:{doc.name}".encode()) / 2**32 for doc in docs]
    held = [d for d, s in zip(docs, scores) if s < heldout]
    train = [d for d, s in zip(docs, scores) if s >= heldout]
    if len(docs) == 1:
        return docs, []
    if not held:
        i = int(np.argmin(scores))
        held, train = [docs[i]], docs[:i] + docs[i + 1 :]
    elif not train:
        i = int(np.argmax(scores))
        train, held = [docs[i]], docs[:i] + docs[i + 1 :]
    return train, held


# Token streams ----------------------------------------------------------------


def _stream(tokenizer, docs: list[Document], seed: int) -> np.ndarray:
    order = np.random.default_rng(seed).permutation(len(docs))
    docs = [docs[i] for i in order]
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    pieces = []
    batch = 256
    for start in range(0, len(docs), batch):
        for ids in tokenizer.encode_batch([d.text for d in docs[start : start + batch]]):
            pieces.append(ids.astype(dtype))
            pieces.append(np.array([tokenizer.eod_id], dtype))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype)


def _corpus_key(spec: str, files: list[Path], tokenizer, seed: int, heldout: float) -> str:
    h = hashlib.sha256()
    h.update(f"{CACHE_VERSION}|{spec}|{tokenizer.fingerprint}|{seed}|{heldout}|{sys.version}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def load_token_streams(spec: str, tokenizer, seed: int, heldout: float, cache_dir: Path | None = None, log=print):
    """Tokenized train and held-out streams as read-only memmaps (cached).

    Returns:
      ``(train, heldout)``: 1-D uint16/uint32 token arrays, documents joined
      by ``tokenizer.eod_id``.

    Raises:
      FileNotFoundError, ValueError: as `corpus_files` and `read_documents`.
    """
    files = corpus_files(spec)
    cache = Path(cache_dir or default_cache_dir()) / "tokens" / _corpus_key(spec, files, tokenizer, seed, heldout)
    train_path, held_path = cache / "train.npy", cache / "heldout.npy"
    if not (train_path.exists() and held_path.exists()):
        log(f"tokenizing --data {spec} ({len(files)} files) with {tokenizer.name}; cache {cache}")
        docs = read_documents(spec)
        train_docs, held_docs = split_documents(docs, heldout, seed)
        train = _stream(tokenizer, train_docs, seed)
        held = _stream(tokenizer, held_docs, seed + 1)
        if not held_docs:  # one document: hold out its tail
            cut = max(int(len(train) * (1 - heldout)), 1)
            train, held = train[:cut], train[cut:]
        cache.mkdir(parents=True, exist_ok=True)
        _save_atomic(held_path, held)
        _save_atomic(train_path, train)
    return np.load(train_path, mmap_mode="r"), np.load(held_path, mmap_mode="r")


# Packed windows -----------------------------------------------------------------


def pack_windows(windows: np.ndarray, eod_id: int) -> dict[str, np.ndarray]:
    """Turns ``[rows, seq_len + 1]`` token windows into model inputs.

    Returns:
      ``tokens, targets, positions, segment_ids`` int32 and ``loss_mask``
      float32, each ``[rows, seq_len]``, as described in the module docstring.
    """
    windows = windows.astype(np.int32)
    tokens, targets = windows[:, :-1], windows[:, 1:]
    is_eod = tokens == eod_id
    # Segment of position i: 1 + number of EODs strictly before i.
    before = np.concatenate([np.zeros_like(is_eod[:, :1]), is_eod[:, :-1]], axis=1)
    segment_ids = 1 + np.cumsum(before, axis=1, dtype=np.int32)
    index = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    starts = np.where(np.concatenate([np.ones_like(before[:, :1]), before[:, 1:]], axis=1), index, 0)
    positions = index - np.maximum.accumulate(starts, axis=1)
    return {
        "tokens": tokens,
        "targets": targets,
        "positions": positions.astype(np.int32),
        "segment_ids": segment_ids.astype(np.int32),
        "loss_mask": (~is_eod).astype(np.float32),
    }


def context_permutation(seq_len: int, num_shards: int, layout: str) -> np.ndarray | None:
    """The order in which a row's tokens are laid out along the length, for ``--context-layout``.

    Args:
      seq_len: T, tokens per row (``--seq-len``).
      num_shards: P, devices the length is split over (the ``sequence`` axis).
      layout: ``contiguous`` (natural order) or ``zigzag`` (device r holds chunks r and
        2P-1-r of 2P; `models.kernels.ring_attention.zigzag_permutation`).

    Returns:
      int64 ``[seq_len]`` indices (``field[:, perm]`` is the laid-out row), or None for the
      natural order.

    Raises:
      ValueError: an unknown layout, or a ``--seq-len`` not divisible by 2P for zigzag.
    """
    if layout == "contiguous":
        return None
    if layout != "zigzag":
        raise ValueError(f"--context-layout {layout!r}: choose contiguous or zigzag")
    from models.kernels.ring_attention import zigzag_permutation

    try:
        permutation = zigzag_permutation(seq_len, num_shards)
    except ValueError:
        raise ValueError(
            f"--seq-len {seq_len}: --context-layout zigzag needs a multiple of 2 x {num_shards} (the sequence "
            f"axis) = {2 * num_shards}; e.g. --seq-len {max(1, seq_len // (2 * num_shards)) * 2 * num_shards}"
        ) from None
    return None if num_shards == 1 else permutation  # over one device zigzag is the natural order


def permute_length(fields: dict[str, np.ndarray], permutation: np.ndarray | None) -> dict[str, np.ndarray]:
    """Every ``[rows, seq_len]`` field with its columns in ``permutation`` order (None: as is)."""
    if permutation is None:
        return fields
    return {name: np.ascontiguousarray(value[:, permutation]) for name, value in fields.items()}


class WindowSource:
    """Fixed-length windows of a token stream, visited in seeded per-epoch permutations.

    Args:
      stream: 1-D token array.
      seq_len: T, tokens per sequence (windows hold T + 1 tokens).
      seed: permutation seed.
      shuffle: visit windows in a permutation (training) or in order (eval).
      name: for error messages.

    Raises:
      ValueError: when the stream is shorter than one window.
    """

    def __init__(self, stream: np.ndarray, seq_len: int, seed: int, shuffle: bool, name: str):
        self.stream, self.seq_len, self.seed, self.shuffle = stream, seq_len, seed, shuffle
        self.num_windows = (len(stream) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(
                f"the {name} split has {len(stream)} tokens, fewer than one sequence of --seq-len {seq_len} + 1; "
                "give more data or a smaller --seq-len"
            )
        self._perms: dict[int, np.ndarray] = {}

    def window_index(self, sample: np.ndarray) -> np.ndarray:
        """Window index of each global sample number."""
        epoch, offset = np.divmod(sample, self.num_windows)
        if not self.shuffle:
            return offset
        out = np.empty_like(sample)
        for e in np.unique(epoch):
            if e not in self._perms:
                self._perms = {e: np.random.default_rng([self.seed, int(e)]).permutation(self.num_windows)}
            out[epoch == e] = self._perms[e][offset[epoch == e]]
        return out

    def windows(self, samples: np.ndarray) -> np.ndarray:
        """``[len(samples), seq_len + 1]`` token windows for global sample numbers."""
        starts = self.window_index(np.asarray(samples, np.int64)) * self.seq_len
        return np.stack([self.stream[s : s + self.seq_len + 1] for s in starts])


@dataclasses.dataclass
class Dataset:
    """Train and held-out windows of a corpus.

    Attributes:
      train, heldout: `WindowSource`s.
      eod_id: end-of-document token.
      global_batch: B, rows per step.
      permutation: the context layout's token order along the length
        (`context_permutation`), applied to every field; None: natural order.
    """

    train: WindowSource
    heldout: WindowSource
    eod_id: int
    global_batch: int
    permutation: np.ndarray | None = None

    def train_rows(self, first_sample: int, rows: range) -> dict[str, np.ndarray]:
        """Rows ``rows`` of the global batch that starts at sample ``first_sample``."""
        samples = first_sample + np.arange(rows.start, rows.stop)
        return permute_length(pack_windows(self.train.windows(samples), self.eod_id), self.permutation)

    def eval_rows(self, batch_index: int, rows: range) -> dict[str, np.ndarray]:
        """Rows of held-out batch ``batch_index`` (fixed across the run)."""
        samples = batch_index * self.global_batch + np.arange(rows.start, rows.stop)
        return permute_length(pack_windows(self.heldout.windows(samples), self.eod_id), self.permutation)


def load_dataset(
    spec: str,
    tokenizer,
    seq_len: int,
    global_batch: int,
    seed: int,
    heldout: float = 0.01,
    cache_dir=None,
    log=print,
    permutation: np.ndarray | None = None,
) -> Dataset:
    """Builds the `Dataset` for ``--data``; see the module docstring.

    ``permutation`` is the context layout's token order (`context_permutation`), or None.
    """
    train, held = load_token_streams(spec, tokenizer, seed, heldout, cache_dir, log)
    return Dataset(
        train=WindowSource(train, seq_len, seed, shuffle=True, name="training"),
        heldout=WindowSource(held, seq_len, seed, shuffle=False, name="held-out"),
        eod_id=tokenizer.eod_id,
        global_batch=global_batch,
        permutation=permutation,
    )


# Process-local global arrays ----------------------------------------------------


def local_rows(sharding, global_shape: tuple[int, ...]) -> range:
    """The contiguous range of batch rows this process's devices hold.

    Raises:
      ValueError: if the rows of this process are not contiguous (a mesh
        whose batch axes interleave processes).
    """
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        rows = index[0]
        starts.append(rows.start or 0)
        stops.append(global_shape[0] if rows.stop is None else rows.stop)
    first, last = min(starts), max(stops)
    covered = np.zeros(last - first, bool)
    for s, e in zip(starts, stops):
        covered[s - first : e - first] = True
    if not covered.all():
        raise ValueError("this process's batch rows are not contiguous; check --mesh-outer")
    return range(first, last)


def to_global_arrays(rows_fn, global_batch: int, seq_len: int, sharding) -> dict:
    """Global `jax.Array`s of a batch from the rows this process loads.

    Args:
      rows_fn: ``range -> dict[str, np.ndarray [len(range), seq_len]]``.
      global_batch: B.
      seq_len: T.
      sharding: the `NamedSharding` of a ``[batch, length]`` array.

    Returns:
      Dict of `FIELDS` -> ``[B, T]`` arrays with ``sharding``; only the
      process's own rows are ever loaded.
    """
    import jax

    shape = (global_batch, seq_len)
    rows = local_rows(sharding, shape)
    local = rows_fn(rows)

    def make(field):
        data = local[field]
        return jax.make_array_from_callback(
            shape, sharding, lambda index: data[_shift(index[0], rows.start, global_batch)][:, index[1]]
        )

    return {field: make(field) for field in FIELDS}


def _shift(rows: slice, offset: int, total: int) -> slice:
    start = rows.start or 0
    stop = total if rows.stop is None else rows.stop
    return slice(start - offset, stop - offset)
