"""Prepared shards -> packed global batches through Grain, each process loading only its rows.

1. **Streams.** A split's ArrayRecord shards (`train.data.prepare`) read as one token stream: the records'
   token counts (the ``.lengths.npy`` files) locate any token range, and `grain.sources.ArrayRecordDataSource`
   over all shards reads the few records it spans. A corpus whose split left one side without documents
   (a single document) holds out the tail of the stream instead.
2. **Windows.** The stream is cut into windows of ``seq_len + 1`` tokens with stride ``seq_len``; inputs are
   ``window[:-1]``, targets ``window[1:]``.
3. **Order.** Training visits windows in a global seeded shuffle, reshuffled every epoch
   (``grain.MapDataset.range(W).shuffle(seed).repeat()``); sample ``i`` of the run is window ``order[i]``.
   The held-out windows are visited in one fixed shuffle (seed + 1), so the evaluation batches are a sample
   of the whole held-out split, the same at every evaluation.
4. **Packing.** Inside a window, ``segment_ids`` number the documents from 1 (an EOD belongs to the document
   it ends), ``positions`` restart at 0 in each document, and ``loss_mask`` is 0 where the input is an EOD
   (its target opens another document), so no loss and no attention crosses a document boundary.
5. **Context layout.** With context parallelism (the length split over P devices of the ``sequence`` axis)
   and the ``zigzag`` layout, every field of a row is permuted the same way along the length
   (`context_permutation`: device r's slice holds chunks r and 2P-1-r of 2P), so causal ring attention does
   equal work on every device.
6. **Batches.** Step ``j`` of the loop reads global samples ``base + j*B + r`` for the rows ``r`` this
   process's devices hold (`local_rows`), through a Grain ``MapDataset`` whose reads run in background
   threads ahead of the step (`TrainBatches`). Grain's iterator state (the next step's index) is saved in
   every checkpoint with ``base`` and ``B``. Because a sample's window depends only on its global number,
   the position is exact on any mesh, data-parallel size or process count: a resume with the same global
   batch restores Grain's state; one with another global batch re-derives it from the samples consumed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from pathlib import Path

import numpy as np

from train.data.corpus import plan_units
from train.data.packing import FIELDS, pack_windows, permute_length
from train.data.prepared import (
    TokenStream,
    Windows,
    is_prepared,
    open_prepared,
    prepared_folder,
    read_manifest,
    shuffled_order,
)

# The dataset ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """One source of ``--data``: ``name`` (in metrics), ``path`` (a prepared folder or a raw source) and its
    mixture ``weight`` (share of training tokens, relative to the other sources')."""

    name: str
    path: str
    weight: float = 1.0


def source_name(path: str) -> str:
    """A source's default name: its file or folder name without the suffix, letters, digits, ``-`` and ``_``."""
    stem = "stdlib" if path == "stdlib" else Path(path).expanduser().resolve().stem
    return re.sub(r"[^A-Za-z0-9_-]+", "_", stem).strip("_") or "data"


def parse_sources(spec: str, flag: str = "--data") -> list[SourceSpec]:
    """The sources of ``--data``: one source (``stdlib``, a path), or a mixture ``[NAME=]PATH:WEIGHT,...``,
    e.g. ``web=runs/web:0.7,code=runs/code:0.3`` (a missing name is the path's stem, a missing weight 1).

    Raises:
      ValueError: a weight that is not a positive finite number, two sources of one name, or an empty item;
        the message names ``flag`` and a spelling that is accepted.
    """
    if spec == "stdlib" or Path(spec).expanduser().exists() or "," not in spec and ":" not in spec:
        return [SourceSpec(source_name(spec), spec)]
    sources = []
    for item in spec.split(","):
        name, _, rest = item.partition("=") if re.match(r"^[A-Za-z0-9_-]+=", item) else ("", "", item)
        path, _, weight_text = rest.rpartition(":")
        try:
            weight = float(weight_text)
        except ValueError:
            path, weight = rest, 1.0
        if not path:
            raise ValueError(f"{flag} {spec}: an empty source in the list; e.g. {flag} web=DIR:0.7,code=DIR2:0.3")
        sources.append(SourceSpec(name or source_name(path), path, weight))
    example = ",".join(f"{s.name}={s.path}:1" for s in sources)
    for s in sources:
        if not (math.isfinite(s.weight) and s.weight > 0):
            raise ValueError(
                f"{flag} {spec}: the weight of {s.name} is {s.weight}; each weight must be a positive number "
                f"(a share of the training tokens), e.g. {flag} {example}"
            )
    names = [s.name for s in sources]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        example = ",".join(f"{s.name}{i}={s.path}:{s.weight:g}" for i, s in enumerate(sources))
        raise ValueError(f"{flag} {spec}: two sources are named {dup}; name them, e.g. {flag} {example}")
    return sources


@dataclasses.dataclass
class Source:
    """One prepared source of a `Dataset`: its `SourceSpec` fields, train and held-out `Windows` and its
    manifest."""

    name: str
    path: str
    weight: float
    train: Windows
    heldout: Windows
    manifest: dict = dataclasses.field(default_factory=dict)


def _tag(k: int, j: int) -> tuple[int, int]:
    return k, j


@dataclasses.dataclass
class Dataset:
    """Train and held-out windows of one prepared corpus or a weighted mixture of several.

    Each source's windows are visited in their own seeded shuffle (source ``k``: seed ``seed + 2k``, its
    held-out windows ``seed + 2k + 1``). A mixture interleaves the sources by weight with Grain's
    ``MapDataset.mix``: sample ``i`` of the run is the ``j``-th sample of source ``k`` (Grain's deterministic
    selection), that is window ``order_k[j]``. Every sample is one window of ``seq_len + 1`` tokens, so the
    weights are shares of training tokens. The position of every source follows from the global sample
    number alone, so resuming stays exact exactly as for one source.

    Attributes:
      sources: `Source` s, in the order ``--data`` names them.
      eod_id: end-of-document token.
      global_batch: B, rows per step.
      seed: the order's seed.
      permutation: the context layout's token order along the length (`context_permutation`); None: natural.
    """

    sources: list[Source]
    eod_id: int
    global_batch: int
    seed: int
    permutation: np.ndarray | None = None

    def __post_init__(self):
        import grain

        self.train_orders = [
            shuffled_order(s.train.num_windows, self.seed + 2 * k, repeat=True) for k, s in enumerate(self.sources)
        ]
        self.heldout_orders = [
            shuffled_order(s.heldout.num_windows, self.seed + 2 * k + 1, repeat=True)
            for k, s in enumerate(self.sources)
        ]
        self.selection = None
        if len(self.sources) > 1:
            counters = [grain.MapDataset.range(MIX_RANGE).map(functools.partial(_tag, k)) for k in range(len(self))]
            self.selection = grain.MapDataset.mix(counters, [s.weight for s in self.sources])

    def __len__(self) -> int:
        return len(self.sources)

    @property
    def train(self) -> Windows:
        """The training windows of the first source (the only one outside a mixture)."""
        return self.sources[0].train

    @property
    def heldout(self) -> Windows:
        """The held-out windows of the first source (the only one outside a mixture)."""
        return self.sources[0].heldout

    @property
    def manifest(self) -> dict:
        return self.sources[0].manifest

    def sample_sources(self, samples) -> list[tuple[int, int]]:
        """``(source, j)`` of each global training sample number: the ``j``-th sample drawn from ``source``."""
        if self.selection is None:
            return [(0, int(s)) for s in samples]
        return [self.selection[int(s)] for s in samples]

    def source_samples(self, samples: int) -> list[int]:
        """How many of the first ``samples`` training samples each source gave (Grain's selection read
        forward from ``samples`` until every source has shown its count)."""
        if self.selection is None:
            return [samples]
        counts: list[int | None] = [None] * len(self)
        index = samples
        while None in counts:
            k, j = self.selection[index]
            if counts[k] is None:
                counts[k] = j
            index += 1
        return counts

    def samples(self, samples, which: str = "train", source: int = 0) -> dict[str, np.ndarray]:
        """The packed rows of global sample numbers ``samples``: training samples (of the mixture), or
        held-out samples of ``source``."""
        if which == "train":
            picks = [(k, self.train_orders[k][j]) for k, j in self.sample_sources(samples)]
        else:
            picks = [(source, self.heldout_orders[source][int(s)]) for s in samples]
        rows = np.empty((len(picks), self.train.seq_len + 1), np.int32)  # sources may differ in dtype
        mask = np.ones(rows.shape, bool)
        for k in sorted({k for k, _ in picks}):
            mine = [i for i, (kk, _) in enumerate(picks) if kk == k]
            windows = self.sources[k].train if which == "train" else self.sources[k].heldout
            tokens, masked = windows.read([picks[i][1] for i in mine])
            rows[mine] = tokens
            if masked is not None:
                mask[mine] = masked
        return permute_length(pack_windows(rows, self.eod_id, mask), self.permutation)

    def train_rows(self, first_sample: int, rows: range) -> dict[str, np.ndarray]:
        """Rows ``rows`` of the global batch that starts at sample ``first_sample``."""
        return self.samples(range(first_sample + rows.start, first_sample + rows.stop))

    def eval_rows(self, batch_index: int, rows: range, source: int = 0) -> dict[str, np.ndarray]:
        """Rows of held-out batch ``batch_index`` of ``source`` (fixed across the run)."""
        first = batch_index * self.global_batch
        return self.samples(range(first + rows.start, first + rows.stop), "heldout", source)

    def train_batches(self, rows: range, samples: int, saved: dict | None = None, threads: int = 2, prefetch: int = 4):
        """This process's rows of every step from the data position ``samples`` on (`TrainBatches`)."""
        return TrainBatches(self, rows, samples, saved, threads, prefetch)


MIX_RANGE = np.iinfo(np.int64).max // 4  # each source's sample counter in a mixture: never exhausted


class TrainBatches:
    """This process's rows of each step's global batch, read ahead by Grain's background threads.

    Element ``j`` of the Grain ``MapDataset`` is rows ``rows`` of the global batch of samples
    ``[base + j*B, base + (j+1)*B)``; its iterator runs ``threads`` reader threads ``prefetch`` elements ahead.

    Args:
      dataset: the `Dataset`.
      rows: this process's rows of the global batch (`local_rows`).
      samples: the data position (global samples consumed).
      saved: the ``iterator`` a checkpoint recorded (`state`), or None.
      threads, prefetch: Grain's ``ReadOptions``.

    Attributes:
      wait: seconds the caller has waited on ``next`` since the last `take_wait`.
      restored: ``grain`` (Grain's saved state was restored) or ``derived`` (position from ``samples``).
    """

    def __init__(self, dataset: Dataset, rows: range, samples: int, saved=None, threads=2, prefetch=4):
        import grain

        B = dataset.global_batch
        if saved and saved.get("global_batch") == B and saved["base"] + saved["grain"]["next_index"] * B == samples:
            self.base, state, self.restored = saved["base"], saved["grain"], "grain"
        else:
            self.base, state, self.restored = samples % B, {"next_index": samples // B}, "derived"
        base, first = self.base, np.arange(rows.start, rows.stop)
        steps = grain.MapDataset.range(np.iinfo(np.int64).max // (2 * B)).map(
            lambda j: dataset.samples(base + j * B + first)
        )
        options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)
        self._iterator = iter(steps.to_iter_dataset(options))
        self._iterator.set_state(state)
        self.global_batch, self.wait = B, 0.0

    def __next__(self) -> dict[str, np.ndarray]:
        import time

        t0 = time.perf_counter()
        batch = next(self._iterator)
        self.wait += time.perf_counter() - t0
        return batch

    def take_wait(self) -> float:
        """Seconds waited on input since the previous call."""
        wait, self.wait = self.wait, 0.0
        return wait

    def state(self) -> dict:
        """What a checkpoint records: Grain's iterator state, ``base`` and ``global_batch``."""
        return {"grain": self._iterator.get_state(), "base": self.base, "global_batch": self.global_batch}


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
    text_field: str = "text",
) -> Dataset:
    """The `Dataset` of ``--data``: one source or a mixture (`parse_sources`), each a prepared folder or a raw
    source prepared on first use into the cache.

    Raises:
      ValueError, FileNotFoundError, ImportError: as `parse_sources`, `read_manifest`,
        `train.data.prepare.prepare` and `check_sequences`.
    """
    specs = parse_sources(spec)
    opened = []
    for source in specs:
        folder = prepared_folder(source.path, tokenizer, seed, heldout, cache_dir, log, text_field)
        opened.append((source, *open_prepared(folder, tokenizer)))
    check_sequences(spec, [(s, train, held) for s, train, held, _ in opened], seq_len)
    sources = []
    for source, train, held, manifest in opened:
        where = f" of {source.name}" if len(specs) > 1 else ""
        sources.append(
            Source(
                source.name,
                source.path,
                source.weight,
                Windows(train, seq_len, f"training split{where}"),
                Windows(held, seq_len, f"held-out split{where}"),
                manifest,
            )
        )
    return Dataset(sources, eod_id=tokenizer.eod_id, global_batch=global_batch, seed=seed, permutation=permutation)


def check_sequences(spec: str, splits: list[tuple[SourceSpec, TokenStream, TokenStream]], seq_len: int) -> None:
    """Every source's training and held-out split holds at least one sequence of ``seq_len + 1`` tokens.

    Args:
      spec: ``--data`` as given (for the message).
      splits: ``(source, train, heldout)`` of each source.
      seq_len: ``--seq-len``.

    Raises:
      ValueError: naming ``--data``, the source (of a mixture: its name and path), the split and its tokens, and
        a ``--seq-len`` every split holds (the largest power of two that fits the shortest; powers of two divide
        the usual meshes' length axes), when one of at least 8 fits.
    """
    short = [(s, name, len(x)) for s, t, h in splits for name, x in (("training", t), ("held-out", h))]
    shortest = min(n for _, _, n in short)
    for source, name, tokens in short:
        if tokens - 1 >= seq_len:
            continue
        which = f" of {source.name} ({source.path})" if len(splits) > 1 else ""
        fits = 1 << ((shortest - 1).bit_length() - 1) if shortest > 1 else 0
        remedies = [f"use --seq-len {fits}"] if fits >= 8 else []
        if name == "held-out":
            raw = not is_prepared(source.path)
            remedies.append("a larger --heldout" if raw else "a preparation with a larger --heldout")
        remedies.append("more data")
        remedy = f"{', '.join(remedies[:-1])} or {remedies[-1]}" if len(remedies) > 1 else remedies[0]
        raise ValueError(
            f"--data {spec}: the {name} split{which} has {tokens:,} tokens, fewer than one sequence of --seq-len "
            f"{seq_len} + 1; {remedy}"
        )


def check_source(spec: str, tokenizer, text_field: str = "text") -> None:
    """Before device work: the mixture spelling and weights are sound; each prepared folder's manifest and
    shards agree with the run's tokenizer, and each raw source is there, is text, and its Parquet files
    have the text column (footers only: nothing tokenized).

    Raises:
      ValueError, FileNotFoundError, ImportError: as `parse_sources`, `read_manifest` and
        `train.data.corpus.plan_units`.
    """
    for source in parse_sources(spec):
        if is_prepared(source.path):
            read_manifest(Path(source.path).expanduser(), tokenizer)
        else:
            plan_units(source.path, 1 << 62, text_field)


# Process-local global arrays ----------------------------------------------------------------------------------


def local_rows(sharding, global_shape: tuple[int, ...]) -> range:
    """The contiguous range of batch rows this process's devices hold.

    Raises:
      ValueError: if the rows of this process are not contiguous (a mesh whose batch axes interleave
        processes).
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
      Dict of `FIELDS` -> ``[B, T]`` arrays with ``sharding``; only the process's own rows are ever loaded.
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
