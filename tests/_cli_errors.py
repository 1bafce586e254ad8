"""A library error read as the command line prints it, for tests that call below ``train``'s entry points.

The library's errors name configuration fields (`sharding.errors.ConfigError`); the entry points print them
with each field spelled as its flag (`train.setup.flagnames.render`). A test that calls a library function (or
`train.setup.cli.parse`, which passes the library's errors on) and checks the text a user would see uses
`raises_as_cli` where it would use ``pytest.raises``, and `as_printed` for a ``log`` whose lines it reads.
"""

from __future__ import annotations

import contextlib
import re

import pytest

from train.setup.flagnames import render


@contextlib.contextmanager
def raises_as_cli(expected, match: str | None = None):
    """``pytest.raises(expected, match=match)``, with ``match`` searched in the message as the command line
    prints it (`train.setup.flagnames.render`) rather than in ``str(error)``."""
    with pytest.raises(expected) as info:
        yield info
    if match is not None:
        text = render(info.value)
        assert re.search(match, text), f"Regex pattern did not match.\n Regex: {match!r}\n Input: {text!r}"


def as_printed(lines: list):
    """A ``log`` that keeps each line as the command line prints it (`train.setup.flagnames.render`)."""
    return lambda line: lines.append(render(line))
