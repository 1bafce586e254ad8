"""Prepared folders: the tokenized shards a source was prepared into (`train.data.prepare`), found by the key of
their sources and settings in the cache, read as token streams cut into windows, held by their readers and
removed once superseded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from train.data.corpus import default_cache_dir
from train.data.integrity import REPREPARE, shard_name, shard_problems
from train.data.prepare import preparation_key, prepare
from train.setup.folders import check_writable


def is_prepared(spec: str) -> bool:
    """Whether ``spec`` is a folder `train.data.prepare` completed (it holds ``manifest.json``)."""
    return spec != "stdlib" and (Path(spec).expanduser() / "manifest.json").is_file()


def read_manifest(folder: Path, tokenizer, flag: str = "--data") -> dict:
    """The manifest of a prepared folder, checked against the run's tokenizer and the shards on disk.

    Raises:
      ValueError: an unreadable manifest, another tokenizer's tokens, or a missing or damaged shard (named).
    """
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        saved = manifest["tokenizer"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{flag} {folder}: unreadable manifest.json ({e}); prepare the folder again") from None
    if saved["fingerprint"] != tokenizer.fingerprint:
        hint = "" if saved["name"] == "bytes" else f" {saved['name']}"
        raise ValueError(
            f"{flag} {folder}: prepared with the tokenizer {saved['name']} ({saved['fingerprint']}), but this run "
            f"uses {tokenizer.name} ({tokenizer.fingerprint}); pass --tokenizer{hint or ' bytes'}, or prepare again"
        )
    problems = shard_problems(folder, manifest)
    if problems:
        raise ValueError(f"{flag} {folder}: {problems[0]}; {REPREPARE}")
    return manifest


class TokenStream:
    """A split's tokens as one random-access stream over its ArrayRecord shards, or a range of one.

    Args:
      folder: the prepared folder.
      split: ``train`` or ``heldout``.
      manifest: its manifest (`read_manifest`).
      start, stop: the token range of the split this stream covers (None: to the end).
    """

    def __init__(self, folder: Path, split: str, manifest: dict, start: int = 0, stop: int | None = None):
        shards = [s for s in manifest["shards"] if s[f"{split}_tokens"] > 0]
        self.paths = [str(folder / shard_name(split, s["index"])) for s in shards]
        lengths = [np.load(Path(p).with_suffix(".lengths.npy")) for p in self.paths]
        self.ends = np.cumsum(np.concatenate(lengths) if lengths else np.zeros(0), dtype=np.int64)
        self.shard_of_record = np.repeat(np.arange(len(lengths)), [len(x) for x in lengths])
        self.dtype = np.dtype(manifest["dtype"])
        self.masked = bool(manifest.get("loss_mask", False))
        total = int(self.ends[-1]) if len(self.ends) else 0
        self.start, self.stop = start, total if stop is None else stop
        self._source = None

    def __len__(self) -> int:
        return self.stop - self.start

    def _records(self):
        if self._source is None:
            from grain.sources import ArrayRecordDataSource

            self._source = ArrayRecordDataSource(self.paths)
        return self._source

    def read(self, starts, count: int) -> tuple[np.ndarray, np.ndarray | None]:
        """``(tokens, mask)``, each ``[len(starts), count]``: rows ``[start, start + count)`` of this stream
        (tokens ``dtype``; mask bool, whether a token carries loss, or None when the stream has no mask),
        every record they span read in one call.

        Raises:
          ValueError: a record that does not read, or reads with another length (names its shard).
        """
        begins = self.start + np.asarray(starts, np.int64)
        firsts = np.searchsorted(self.ends, begins, side="right")
        lasts = np.searchsorted(self.ends, begins + count - 1, side="right")
        indices = sorted({i for f, l in zip(firsts, lasts) for i in range(int(f), int(l) + 1)})
        try:
            records = self._records().__getitems__(indices)
        except Exception as e:  # ArrayRecord raises its own errors for a damaged file
            raise ValueError(f"{self._shard_names(indices)}: cannot read records ({e})") from None
        pieces, masks = {}, {}
        for index, record in zip(indices, records):
            expected = int(self.ends[index] - (self.ends[index - 1] if index else 0))
            nbytes = expected * self.dtype.itemsize
            size = nbytes + (-(-expected // 8) if self.masked else 0)
            if len(record) != size:
                raise ValueError(
                    f"{self._shard_names([index])}: record {index} holds {len(record)} bytes, not the {size} of "
                    f"{expected} tokens"
                )
            pieces[index] = np.frombuffer(record[:nbytes], self.dtype)
            if self.masked:
                masks[index] = np.unpackbits(np.frombuffer(record[nbytes:], np.uint8), count=expected).astype(bool)
        out = np.empty((len(begins), count), self.dtype)
        mask = np.empty((len(begins), count), bool) if self.masked else None
        for row, (begin, first, last) in enumerate(zip(begins, firsts, lasts)):
            span = range(int(first), int(last) + 1)
            offset = int(begin) - (int(self.ends[first - 1]) if first else 0)
            out[row] = np.concatenate([pieces[i] for i in span])[offset : offset + count]
            if mask is not None:
                mask[row] = np.concatenate([masks[i] for i in span])[offset : offset + count]
        return out, mask

    def _shard_names(self, indices) -> str:
        return ", ".join(sorted({self.paths[self.shard_of_record[i]] for i in indices}))


class Windows:
    """Windows of ``seq_len + 1`` tokens of a stream, stride ``seq_len``.

    Raises:
      ValueError: when the stream is shorter than one window (names the split and ``--seq-len``).
    """

    def __init__(self, stream: TokenStream, seq_len: int, name: str):
        self.stream, self.seq_len = stream, seq_len
        self.num_windows = (len(stream) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(
                f"the {name} has {len(stream)} tokens, fewer than one sequence of --seq-len {seq_len} + 1; "
                "give more data or a smaller --seq-len"
            )

    def read(self, windows) -> tuple[np.ndarray, np.ndarray | None]:
        """``[len(windows), seq_len + 1]`` token windows and their loss mask (`TokenStream.read`)."""
        return self.stream.read(np.asarray(windows, np.int64) * self.seq_len, self.seq_len + 1)


def shuffled_order(num_windows: int, seed: int, repeat: bool):
    """Grain's global shuffle of ``range(num_windows)`` (reshuffled each epoch when ``repeat``): the window of
    each sample number."""
    import grain

    order = grain.MapDataset.range(num_windows).shuffle(seed=seed)
    return order.repeat() if repeat else order


def open_prepared(folder: Path, tokenizer, flag: str = "--data") -> tuple[TokenStream, TokenStream, dict]:
    """``(train, heldout, manifest)`` streams of a prepared folder; a split without documents takes the tail
    (held-out) or head (train) of the other, cut at the manifest's held-out share of tokens."""
    manifest = read_manifest(folder, tokenizer, flag)
    train, held = TokenStream(folder, "train", manifest), TokenStream(folder, "heldout", manifest)
    if len(train) == 0 or len(held) == 0:
        whole = train if len(train) else held
        split = "train" if len(train) else "heldout"
        cut = max(int(len(whole) * (1 - manifest["split"]["heldout"])), 1)
        train = TokenStream(folder, split, manifest, 0, cut)
        held = TokenStream(folder, split, manifest, cut)
    return train, held, manifest


def check_data_cache(cache_dir: str | None) -> None:
    """The token cache a raw ``--data`` is prepared into is writable: ``--data-cache``, else the default
    (`train.data.corpus.default_cache_dir`); train.train and train.evaluate check it before any device work.

    Raises:
      ValueError: As `check_writable`, naming ``--data-cache`` (and the default when it was not given).
    """
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    check_writable(
        cache, "--data-cache" if cache_dir else "--data-cache (default $MESHWORK_CACHE or ~/.cache/meshwork)"
    )


def prepared_folder(
    spec: str, tokenizer, seed: int, heldout: float, cache_dir=None, log=print, text_field: str = "text"
) -> Path:
    """The prepared folder of ``--data``: the folder itself, or the cache's preparation of a raw source
    (made on first use, by `train.data.prepare.prepare` with one worker per core)."""
    if is_prepared(spec):
        return Path(spec).expanduser()
    key, _ = preparation_key([spec], tokenizer, seed, heldout, DEFAULT_SHARD_MB_FOR_CACHE, text_field)
    folder = Path(cache_dir or default_cache_dir()).expanduser() / "prepared" / key
    manifest = prepare(
        [spec],
        folder,
        tokenizer,
        seed=seed,
        heldout=heldout,
        shard_mb=DEFAULT_SHARD_MB_FOR_CACHE,
        log=log,
        text_field=text_field,
        key=key,
    )
    hold_for_reading(folder)
    remove_superseded(folder, manifest, log)
    return folder


READERS_FILE = ".readers"


_HELD: list = []  # the reading locks of this process, held until it exits


def hold_for_reading(folder: Path) -> None:
    """Takes a shared lock (``fcntl.flock``) on ``folder/.readers`` for the rest of this process: a cache
    preparation in use is never removed by `remove_superseded`."""
    import fcntl

    handle = open(folder / READERS_FILE, "a")
    fcntl.flock(handle, fcntl.LOCK_SH)
    _HELD.append(handle)


def remove_superseded(folder: Path, manifest: dict, log=print) -> list[Path]:
    """Removes the cache's earlier preparations of the same sources with the same tokenizer and settings
    whose source files have since changed (sizes or modification times; they can never be reused), unless a
    process reads one (holds its `hold_for_reading` lock) or it is unfinished (no manifest: possibly being
    prepared). Returns the folders removed.

    The cache otherwise keeps every preparation (another tokenizer, seed or split may be used again); remove
    ``$MESHWORK_CACHE/prepared/KEY`` folders by hand when no run uses them.
    """
    import fcntl
    import shutil

    def identity(m: dict) -> list:
        same = ("text_field", "shard_mb", "record_tokens", "split")
        return [sorted({s["spec"] for s in m["sources"]}), m["tokenizer"]["fingerprint"], *[m.get(k) for k in same]]

    removed = []
    for other in sorted(folder.parent.iterdir()):
        if other == folder or not (other / "manifest.json").is_file():
            continue
        try:
            old = json.loads((other / "manifest.json").read_text())
            if old.get("key") == manifest["key"] or identity(old) != identity(manifest):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        with open(other / READERS_FILE, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a running job reads it
            shutil.rmtree(other)
        removed.append(other)
        log(f"removed {other}: an earlier preparation of the same sources, superseded since they changed")
    return removed


DEFAULT_SHARD_MB_FOR_CACHE = 8  # the 30 MB stdlib corpus in four shards: both cores busy on first use
