"""Lines a training process must not print: a filter on its standard output at the file descriptor, so that
what JAX's runtime and gloo write from C++ is filtered too (gloo's connection line, once per device group).
"""

from __future__ import annotations

import os
import re
import sys
import threading

GLOO_CONNECTED = (
    b"[Gloo] Rank ",
    (b" is connected to ", b" peer ranks. ", b"Expected number of connected peer ranks is : "),
)
"""gloo's connection line, ``[Gloo] Rank R is connected to P peer ranks. Expected number of connected peer
ranks is : P``, as its opening and the fixed pieces after it (numbers and the newline between), written to
standard output for each group of devices that first exchanges data."""


class LineFilter:
    """Passes every byte written to a file descriptor through, in order, except the lines of one C++ message.

    gloo, as bundled in jaxlib, prints ``[Gloo] Rank R is connected to P peer ranks. Expected number of
    connected peer ranks is : P`` for each group of devices that first exchanges data (a dozen per process in
    the two-process example of docs/multiprocess.md), from C++ straight to file descriptor 1, and has no
    switch to silence it (``GLOO_LOG_LEVEL`` does not reach it). The lines come while the run compiles and
    runs its first collectives, not only inside ``jax.distributed.initialize``, so the filter stays for the
    life of the process: ``fd`` is pointed at a pipe, and a daemon thread copies what arrives to the
    original descriptor. Several gloo threads write their lines at once, piece by piece, so the pieces of
    two lines interleave (``[Gloo] Rank [Gloo] Rank 00 is connected to  is connected to 11 ...``): a line
    cannot be matched whole. The filter therefore reads a *burst*: from an ``opening``, it drops the fixed
    ``pieces``, numbers, further openings and newlines until it has seen as many newlines as openings; any
    other byte inside a burst is passed on. Outside a burst everything passes at once (a prompt, a progress
    bar's carriage return); only a piece cut by the end of what the pipe gave so far waits for the next read.

    `close` (at exit, and before `os._exit`) points ``fd`` back at the original and copies what is left
    in the pipe. What a C++ abort of the process leaves in the pipe is lost: a line at most, as the thread
    copies what it reads at once.

    Args:
      fd: The descriptor (1: standard output).
      opening: What each line to drop begins with (``b"[Gloo] Rank "``).
      pieces: The fixed text after the opening, between the numbers.
    """

    def __init__(self, fd: int, opening: bytes, pieces: tuple[bytes, ...]):
        self.fd, self.opening = fd, opening
        self._fixed = (opening, *pieces, b"\n")
        self._token = re.compile(b"|".join(re.escape(t) for t in self._fixed) + rb"|\d+")
        self._open = 0  # lines of the current burst not yet ended by their newline
        self._saved: int | None = None
        self._read: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> LineFilter:
        """Points ``fd`` at the pipe and starts the copying thread; returns self."""
        sys.stdout.flush()
        self._saved = os.dup(self.fd)
        self._read, write = os.pipe()
        os.dup2(write, self.fd)
        os.close(write)
        self._thread = threading.Thread(target=self._copy, name="line-filter", daemon=True)
        self._thread.start()
        return self

    def _copy(self) -> None:
        held = b""
        while True:
            try:
                chunk = os.read(self._read, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            out, held = self.filter(held + chunk, final=False)
            self._write(out)
        self._write(self.filter(held, final=True)[0])

    def filter(self, text: bytes, final: bool) -> tuple[bytes, bytes]:
        """``(what to pass on, what to hold for the next read)`` of ``text``; with ``final`` nothing is held."""
        out, i, n = bytearray(), 0, len(text)
        while i < n:
            if not self._open:
                j = text.find(self.opening, i)
                if j < 0:
                    k = next(
                        (
                            n - k
                            for k in range(min(len(self.opening) - 1, n - i), 0, -1)
                            if text.endswith(self.opening[:k])
                        ),
                        n,
                    )  # an end that may become the opening
                    out += text[i:k]
                    return (bytes(out), text[k:]) if not final else (bytes(out + text[k:]), b"")
                out += text[i:j]
                i, self._open = j + len(self.opening), 1
                continue
            rest = text[i:]
            m = self._token.match(text, i)
            if not final and (
                (m and m.end() == n) or any(t.startswith(rest) for t in self._fixed if len(t) > len(rest))
            ):
                return bytes(out), rest  # a piece (or number) cut by the end of this read
            if m:
                token = m.group()
                self._open += token == self.opening
                self._open -= token == b"\n"
                i = m.end()
            else:  # something else inside a burst: pass it on
                out += text[i : i + 1]
                i += 1
        return bytes(out), b""

    def _write(self, data: bytes) -> None:
        while data:
            try:
                data = data[os.write(self._saved, data) :]
            except OSError:  # the reader of our output is gone; nothing left to do with it
                return

    def close(self, timeout: float = 2.0) -> None:
        """Points ``fd`` back at the original descriptor and copies what the pipe still holds (waits at most
        ``timeout`` seconds: a child process may still hold the pipe open)."""
        if self._thread is None:
            return
        thread, self._thread = self._thread, None
        try:
            sys.stdout.flush()
        except (OSError, ValueError):  # closed or broken: nothing of Python's own to pass on
            pass
        os.dup2(self._saved, self.fd)  # closes this process's last write end of the pipe: the thread reads to its end
        thread.join(timeout)
        if not thread.is_alive():  # else a child still holds the pipe; the process is ending anyway
            os.close(self._read)
            os.close(self._saved)


_FILTERS: list[LineFilter] = []


def drop_output_lines(opening: bytes, pieces: tuple[bytes, ...]) -> LineFilter:
    """Drops standard output's lines of one C++ message (`LineFilter`: ``opening``, then ``pieces`` between
    numbers) for the rest of the process; the filter is closed at exit (and by `close_output_filters` before
    `os._exit`)."""
    import atexit

    if not _FILTERS:
        atexit.register(close_output_filters)
    line_filter = LineFilter(1, opening, pieces).start()
    _FILTERS.append(line_filter)
    return line_filter


def close_output_filters() -> None:
    """Closes every `drop_output_lines` filter, copying what they hold (call before `os._exit`)."""
    while _FILTERS:
        _FILTERS.pop().close()
