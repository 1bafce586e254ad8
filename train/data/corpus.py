"""Raw corpora: which files a source names, how they are cut into units of work, and the documents of a unit.

A source is ``stdlib`` (the ``.py`` sources of the running interpreter's standard library, about 30 MB of
real text on every machine), a text file, a folder (every file under it, hidden ones skipped), a JSONL file
(``.jsonl``: one document per line, in the ``text`` field or ``text_field``) or a Parquet file (``.parquet``:
one document per row of the column ``text_field``). Text files are one document each.

Units are what one worker tokenizes into one shard: consecutive whole text files up to a byte budget, a byte
range of a JSONL file (lines belong to the range their first byte falls in), or consecutive row groups of a
Parquet file. They are planned from file sizes and Parquet footers alone, before any tokenizing, so a shard's
content is fixed by the plan and an interrupted preparation resumes shard by shard. Parquet is read one
record batch of one row group at a time (`pyarrow.parquet.ParquetFile.iter_batches`), never a whole file.

Every document has a name (the path relative to the source; ``path@byte`` for a JSONL line,
``path:row`` for a Parquet row); the held-out split hashes ``(seed, name)`` (`is_heldout`).
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path

from train.data.chat import check_messages

PARQUET_EXTRA = "pip install 'meshwork[data]'"

# Share of printable characters (or whitespace) a text sample must reach; binary data falls far below it.
MIN_PRINTABLE = 0.9
TEXT_SAMPLE_BYTES = 8192
SOURCE_HINT = "give a text file, a folder, a .jsonl or .parquet file, or stdlib"


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: ``name`` (for the held-out split and errors) and ``text`` (UTF-8 bytes), or for a chat
    example ``messages`` (``[{"role", "content"}, ...]``, rendered by `train.data.chat`) and empty ``text``."""

    name: str
    text: bytes
    messages: list | None = None


@dataclasses.dataclass(frozen=True)
class Unit:
    """A piece of work: the documents of ``files`` (whole text files), or of one JSONL byte range
    ``[start, stop)``, or of Parquet row groups ``[start, stop)``.

    Attributes:
      kind: ``text``, ``jsonl``, ``chat`` (JSONL of conversations) or ``parquet``.
      files: ``(path, name)`` pairs: the file and its name relative to the source.
      start, stop: bytes (JSONL) or row groups (Parquet); unused for text.
      nbytes: input bytes (for the progress bar).
    """

    kind: str
    files: tuple[tuple[str, str], ...]
    start: int = 0
    stop: int = 0
    nbytes: int = 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_cache_dir() -> Path:
    """``$MESHWORK_CACHE``, else ``~/.cache/meshwork``."""
    return Path(os.environ.get("MESHWORK_CACHE", Path.home() / ".cache" / "meshwork"))


def source_root(spec: str) -> Path:
    """The folder document names are relative to (a file's own folder for a file)."""
    if spec == "stdlib":
        return stdlib_root()
    path = Path(spec).expanduser()
    return path if path.is_dir() else path.parent


def corpus_files(spec: str, flag: str = "--data") -> list[Path]:
    """The files a source names, sorted; each checked to be text, JSONL or Parquet.

    Raises:
      FileNotFoundError: the path does not exist.
      ValueError: a folder with no non-empty files, or a file that is not text (`check_text`).
    """
    if spec == "stdlib":
        root = stdlib_root()
        files = [p for p in _walk(root, skip={"site-packages"}) if p.suffix == ".py"]
        if not files:
            raise ValueError(f"{flag} stdlib: no .py files under {root}; give {flag} PATH")
        return files
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{flag} {spec}: no such file or folder ({SOURCE_HINT})")
    if path.is_file():
        files = [path]
    else:
        files = _walk(path)
    if not files or all(f.stat().st_size == 0 for f in files):
        raise ValueError(f"{flag} {spec}: no non-empty files found ({SOURCE_HINT})")
    for file in files:
        if file.suffix == ".parquet":
            _parquet_file(file, flag)
        else:
            check_text(file, flag=flag)
    return files


# Files found to be text, as (path, size, mtime_ns): a source is listed by the check before device work, by the
# preparation's key and by its plan; a file is sampled again only when it changed.
_TEXT_FILES: set[tuple[str, int, int]] = set()


def _walk(root: Path, skip: frozenset | set = frozenset()) -> list[Path]:
    """The files under ``root``, sorted, leaving out hidden files and folders and the folders named in ``skip``
    (pruned, not entered: the standard library's folder may hold a large ``site-packages``)."""
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip]
        files.extend(
            Path(folder, n) for n in names if not n.startswith(".") and os.path.isfile(os.path.join(folder, n))
        )
    return sorted(files)


def check_text(path: Path, sample_bytes: int = TEXT_SAMPLE_BYTES, flag: str = "--data") -> None:
    """Refuses a file that is not text: the first ``sample_bytes`` bytes must decode as UTF-8 and be at least
    `MIN_PRINTABLE` printable characters or whitespace. A file found to be text before, unchanged since (same
    size and modification time), is not read again.

    Raises:
      ValueError: Naming the path, where it stops being UTF-8 or its printable share.
    """
    st = path.stat()
    seen = (str(path), st.st_size, st.st_mtime_ns)
    if seen in _TEXT_FILES:
        return
    with path.open("rb") as f:
        sample = f.read(sample_bytes)
    try:  # an incremental decoder does not fail on a character cut at the end of the sample
        text = codecs.getincrementaldecoder("utf-8")().decode(sample, final=False)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{flag} {path}: not UTF-8 text (byte {e.start} is {sample[e.start]:#04x}); give text files "
            f"(UTF-8), a folder of them, a .jsonl file with a 'text' field or a .parquet file"
        ) from None
    printable = sum(c.isprintable() or c.isspace() for c in text)
    if text and printable < MIN_PRINTABLE * len(text):
        raise ValueError(
            f"{flag} {path}: does not look like text ({printable / len(text):.0%} of its first "
            f"{len(sample)} bytes are printable characters, below {MIN_PRINTABLE:.0%}); give text files"
        )
    _TEXT_FILES.add(seen)


def _parquet_file(path: Path, flag: str = "--data"):
    """The `pyarrow.parquet.ParquetFile` of ``path`` (reads the footer only).

    Raises:
      ImportError: pyarrow is missing (names the extra that installs it).
      ValueError: the file is not Parquet.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{flag} {path}: reading Parquet needs pyarrow; {PARQUET_EXTRA}") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid
        raise ValueError(f"{flag} {path}: not a readable Parquet file ({e})") from None


def plan_units(spec: str, unit_bytes: int, text_field: str = "text", flag: str = "--data") -> list[Unit]:
    """Cuts a source into units of about ``unit_bytes`` input bytes each (see the module docstring).

    Raises:
      FileNotFoundError, ValueError, ImportError: as `corpus_files`; a Parquet file without the column
        ``text_field`` (naming the columns it has).
    """
    root = source_root(spec)
    units: list[Unit] = []
    batch: list[tuple[str, str]] = []
    batch_bytes = 0

    def close_text_batch():
        nonlocal batch, batch_bytes
        if batch:
            units.append(Unit("text", tuple(batch), nbytes=batch_bytes))
        batch, batch_bytes = [], 0

    for path in corpus_files(spec, flag):
        name = str(path.relative_to(root))
        size = path.stat().st_size
        if path.suffix == ".jsonl":
            close_text_batch()
            kind = jsonl_kind(path, text_field)
            for start in range(0, max(size, 1), unit_bytes):
                stop = min(start + unit_bytes, size)
                units.append(Unit(kind, ((str(path), name),), start, stop, stop - start))
        elif path.suffix == ".parquet":
            close_text_batch()
            meta = _parquet_file(path, flag).metadata
            columns = meta.schema.names
            if text_field not in columns:
                raise ValueError(
                    f"{flag} {path}: no column '{text_field}' (it has {', '.join(columns)}); "
                    f"{field_hint(flag, path, columns[-1])}"
                )
            first, nbytes = 0, 0
            for group in range(meta.num_row_groups):
                nbytes += meta.row_group(group).total_byte_size
                if nbytes >= unit_bytes or group == meta.num_row_groups - 1:
                    units.append(Unit("parquet", ((str(path), name),), first, group + 1, nbytes))
                    first, nbytes = group + 1, 0
        else:
            if batch_bytes + size > unit_bytes:
                close_text_batch()
            batch.append((str(path), name))
            batch_bytes += size
    close_text_batch()
    return units


def unit_documents(unit: Unit, text_field: str = "text", flag: str = "--data") -> Iterator[Document]:
    """The documents of a unit, in order; empty ones are skipped.

    Raises:
      ValueError: a JSONL line that is not JSON or lacks a string ``text_field`` (naming the file and byte
        offset), or a Parquet column that is not strings.
    """
    if unit.kind == "text":
        for path, name in unit.files:
            text = Path(path).read_bytes()
            if text:
                yield Document(name, text)
    elif unit.kind in ("jsonl", "chat"):
        yield from _jsonl_documents(unit, text_field, flag)
    else:
        yield from _parquet_documents(unit, text_field, flag)


def _jsonl_documents(unit: Unit, text_field: str, flag: str) -> Iterator[Document]:
    ((path, name),) = unit.files
    example = '{"messages": [{"role": "user", "content": "..."}, ...]}' if unit.kind == "chat" else '{"text": "..."}'
    with open(path, "rb") as f:
        offset = unit.start
        if offset > 0:  # the line that crosses the start belongs to the previous range
            f.seek(offset - 1)
            offset = offset - 1 + len(f.readline())
        while offset < unit.stop:
            line = f.readline()
            if not line:
                break
            here, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{flag} {path}: the line at byte {here} is not JSON ({e.msg}); each line must be one JSON "
                    f"object, e.g. {example}: fix or remove that line"
                ) from None
            if unit.kind == "chat":
                where = f"{flag} {path}: the line at byte {here}"
                messages = check_messages(record.get("messages") if isinstance(record, dict) else None, where)
                yield Document(f"{name}@{here}", b"", messages)
                continue
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(
                    f"{flag} {path}: the line at byte {here} has no string field '{text_field}'; "
                    f"{field_hint(flag, path, 'FIELD')}"
                )
            if record[text_field]:
                yield Document(f"{name}@{here}", record[text_field].encode("utf-8"))


def jsonl_kind(path: Path, text_field: str) -> str:
    """``chat`` when the file's first record has a ``messages`` field and no ``text_field``, else ``jsonl``."""
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    return "jsonl"  # reading the unit names the line
                chat = isinstance(record, dict) and "messages" in record and text_field not in record
                return "chat" if chat else "jsonl"
    return "jsonl"


def _parquet_documents(unit: Unit, text_field: str, flag: str) -> Iterator[Document]:
    ((path, name),) = unit.files
    parquet = _parquet_file(Path(path), flag)
    row = sum(parquet.metadata.row_group(g).num_rows for g in range(unit.start))
    batches = parquet.iter_batches(batch_size=1024, row_groups=range(unit.start, unit.stop), columns=[text_field])
    for batch in batches:
        column = batch.column(0)
        if str(column.type) not in ("string", "large_string", "string_view"):
            raise ValueError(
                f"{flag} {path}: column '{text_field}' holds {column.type}, not strings; "
                f"{field_hint(flag, path, 'COLUMN')}"
            )
        for text in column.to_pylist():
            if text:
                yield Document(f"{name}:{row}", text.encode("utf-8"))
            row += 1


def field_hint(flag: str, path, field: str) -> str:
    """How to name another text field: ``--text-field`` (of ``prepare`` and of training alike)."""
    return f"pass --text-field {field}"


def is_heldout(name: str, seed: int, heldout: float) -> bool:
    """Whether a document is held out: a CRC-32 of ``"{seed}:{name}"`` scaled to [0, 1) falls under
    ``heldout``. Fixed by the seed and the name alone, so every worker decides alone."""
    return zlib.crc32(f"{seed}:{name}".encode()) / 2**32 < heldout


def read_documents(spec: str, text_field: str = "text") -> list[Document]:
    """Every document of a small source, in order (tests and tools; training streams units instead).

    Raises:
      ValueError: as `unit_documents`, or a source with no text.
    """
    docs = [doc for unit in plan_units(spec, 1 << 62, text_field) for doc in unit_documents(unit, text_field)]
    if not docs:
        raise ValueError(f"--data {spec}: the corpus holds no text")
    return docs
