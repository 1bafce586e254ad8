"""Orbax's own messages into a file of the run folder instead of the terminal.

Orbax logs through absl's Python logger (``logging.getLogger("absl")``), from its background threads too: a
save that fails on a full disk logs the same error with a full traceback from every thread that touched it
(hundreds of lines) before the run's own one-line error. `capture` sends the logger's records, at every
level and with their tracebacks, to ``RUN_DIR/library.log`` (``library-P.log`` for process P > 0) and no
longer to the terminal; `note` is the clause a handled failure's message ends with, saying where they are.

After a failed save, TensorStore's completion callbacks still try to reach the event loop Orbax has closed;
each raises ``RuntimeError('Event loop is closed')``, which the C++ caller reports as unraisable
(`sys.unraisablehook`, a bare traceback on stderr). While captured, those go to the same file; any other
exception reaches the hook that was installed.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOGGERS = ("absl",)
"""The loggers captured (Orbax logs through absl's)."""

_state: dict = {}


class _QuietFileHandler(logging.FileHandler):
    """A file handler that drops a record it cannot write (the disk that failed the save may be the log's
    too) instead of printing a "Logging error" traceback for each."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


def log_file(run_dir: str | Path, process_index: int = 0) -> Path:
    """``RUN_DIR/library.log`` (``library-P.log`` for process P > 0)."""
    return Path(run_dir) / ("library.log" if process_index == 0 else f"library-{process_index}.log")


def capture(run_dir: str | Path, process_index: int = 0) -> Path:
    """Sends the records of `LOGGERS` to `log_file` (appended, with time, level, thread and traceback) and
    not to the terminal, for the rest of the process (a second call moves them to the new file). Returns the
    file."""
    release()
    path = log_file(run_dir, process_index)
    handler = _QuietFileHandler(path, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s"))
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.propagate = False
    previous = sys.unraisablehook

    def hook(unraisable):
        value = unraisable.exc_value
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            logging.getLogger(LOGGERS[0]).error(
                "a callback after its event loop closed",
                exc_info=(unraisable.exc_type, value, unraisable.exc_traceback),
            )
            return
        previous(unraisable)

    sys.unraisablehook = hook
    _state.update(handler=handler, path=path, hook=(previous, hook))
    return path


def release() -> None:
    """Undoes `capture` (records reach the terminal again)."""
    handler = _state.pop("handler", None)
    _state.pop("path", None)
    previous, hook = _state.pop("hook", (None, None))
    if sys.unraisablehook is hook:
        sys.unraisablehook = previous
    if handler is None:
        return
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.removeHandler(handler)
        logger.propagate = True
    handler.close()


def note() -> str:
    """``"; Orbax's own messages are in PATH"`` while captured and once something was written there, else empty
    (for the end of an error: a failure Orbax's threads did not report on points to no file)."""
    path = _state.get("path")
    handler = _state.get("handler")
    if handler is not None:
        handler.flush()
    written = path is not None and path.exists() and path.stat().st_size > 0
    return f"; Orbax's own messages are in {path}" if written else ""
