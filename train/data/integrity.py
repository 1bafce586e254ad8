"""Whether a prepared folder is intact: every shard file against the token counts and CRC-32s `prepare` wrote.

Checked when a run opens a folder (`train.data.prepared.read_manifest`: a damaged file is named before any
record of it is read, rather than when a step first reads the damaged record) and by
``python -m train.data verify DIR``, which lists every damaged or missing file and exits 1.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import numpy as np

SPLITS = ("train", "heldout")

REPREPARE = "delete the folder and prepare it again (a raw --data source is prepared again on the next run)"

# Shard files found intact, as (path, size, mtime_ns, crc32): a folder is opened by the check before device work
# and again by the run; a file is read again only when it changed.
_INTACT: set[tuple[str, int, int, int]] = set()


def shard_name(split: str, index: int) -> str:
    """The ArrayRecord file of shard ``index`` of ``split`` (``train-00003.array_record``)."""
    return f"{split}-{index:05d}.array_record"


def file_crc32(path: Path) -> int:
    """The CRC-32 (`zlib.crc32`) of a file's bytes, read 1 MiB at a time."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def shard_problems(folder: Path, manifest: dict) -> list[str]:
    """What is wrong with a prepared folder's shards, one line per damaged or missing file (empty: intact):
    each ``.lengths.npy`` must hold the manifest's token count, and each ArrayRecord file the CRC-32
    ``prepare`` wrote (folders prepared before checksums were written are checked by length only)."""
    problems = []
    for shard in manifest["shards"]:
        for split in SPLITS:
            path = folder / shard_name(split, shard["index"])
            lengths = path.with_suffix(".lengths.npy")
            try:
                total = int(np.load(lengths).sum(dtype=np.int64)) if path.is_file() else -1
            except (OSError, ValueError):
                total = -1
            if total != shard[f"{split}_tokens"]:
                problems.append(
                    f"shard {path.name} is missing or damaged ({lengths.name} does not hold "
                    f"{shard[f'{split}_tokens']} tokens)"
                )
                continue
            want = shard.get(f"{split}_crc32")
            if want is None:
                continue
            st = path.stat()
            seen = (str(path), st.st_size, st.st_mtime_ns, want)
            if seen in _INTACT:
                continue
            got = file_crc32(path)
            if got != want:
                problems.append(f"shard {path.name} is damaged (CRC-32 {got:08x}, prepare wrote {want:08x})")
            else:
                _INTACT.add(seen)
    return problems


def verify_command(folder: str) -> int:
    """``python -m train.data verify DIR``: prints one line per damaged or missing file of a prepared folder
    (or that it is intact); returns 0 when intact, 1 when damaged, 2 when ``DIR`` is not a prepared folder."""
    path = Path(folder).expanduser()
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["shards"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(
            f"error: DIR {folder}: not a prepared folder (manifest.json: {e}); give a folder written by "
            "python -m train.data prepare",
            file=sys.stderr,
        )
        return 2
    problems = shard_problems(path, manifest)
    for problem in problems:
        print(f"error: {path}: {problem}", file=sys.stderr)
    files = 2 * len(manifest["shards"])
    if problems:
        print(f"{len(problems)} of {files} shard files damaged or missing; {REPREPARE}", file=sys.stderr)
        return 1
    checked = all(f"{split}_crc32" in shard for shard in manifest["shards"] for split in SPLITS)
    how = "token counts and CRC-32s" if checked else "token counts (prepared before checksums were written)"
    print(f"{path}: {files} shard files intact ({how})")
    return 0
