"""The folders a command writes, checked before any work: ``--run-dir``, the data cache, ``--out``, ``--plot``."""

from __future__ import annotations

import os
from pathlib import Path


def check_writable(folder: Path, flag: str) -> None:
    """Creates ``folder`` if needed and writes (and removes) a probe file in it.

    Raises:
      ValueError: Naming ``flag``, the folder and the system's reason.
    """
    for part in (folder, *folder.parents):  # a file in the way: mkdir would only say "File exists"
        if part.exists():
            if not part.is_dir():
                raise ValueError(
                    f"{flag} {folder}: cannot write there ({part} is a file, not a folder); choose a folder"
                )
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{flag} {folder}: cannot write there ({e.strerror}); choose a writable folder") from None
