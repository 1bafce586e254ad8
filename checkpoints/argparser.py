"""The argument parser of every entry point: usage errors in one line.

argparse prints a command's whole usage block (dozens of lines for ``python -m train.train``) before a
one-line complaint about one flag, which buries the complaint. `Parser` prints just ``error: ...`` with a
pointer to ``--help``, exit status 2 as argparse's; the usage block stays for ``--help`` and for a bare
invocation (no arguments at all), where it is what the user is after.

Its help shows a flag's default where the flag has one (`HelpFormatter`): every entry point gets the same
``--help`` by building on `Parser`, sub-commands included, and none prints ``(default: None)``.

It lives here rather than in `train.setup.parser` because ``python -m checkpoints.inspect`` uses it too and the
``checkpoints`` package may not import ``train``; `train.setup.parser` builds the trainer's commands on it.

A value that starts with ``-`` (``--stage-layers -1,5``, ``--lr -1e-3``) is the flag's value, not another flag:
argparse itself takes it for an option and stops with "expected one argument" before the value can be checked;
`Parser` reads it as ``--stage-layers=-1,5`` would be, so the flag's own check names what is wrong with it.
"""

from __future__ import annotations

import argparse
import sys


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only where it has one and the help does not already say it: no
    ``(default: None)`` after a required flag or one whose help states its default in words, no
    ``(default: False)`` after a switch, no ``(default: [])`` after a repeatable flag. `Parser`'s formatter,
    so the help of every entry point.

    A description's or epilog's line that starts with two spaces (an example command) is printed whole, not
    wrapped, so it can be copied onto a command line; the other lines are wrapped as argparse wraps them."""

    def _fill_text(self, text, width, indent):
        blocks, prose = [], []
        for line in text.splitlines():
            if not line.startswith("  "):
                prose.append(line)
                continue
            if prose:
                blocks.append(super()._fill_text("\n".join(prose), width, indent))
                prose = []
            blocks.append(indent + line)
        if prose:
            blocks.append(super()._fill_text("\n".join(prose), width, indent))
        return "\n".join(blocks)

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if default is None or default is False or (isinstance(default, list) and not default) or "default" in text:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose usage errors are one line: ``error: MESSAGE (see PROG --help)``, and
    whose help shows defaults through `HelpFormatter` unless ``formatter_class`` says otherwise.

    Sub-commands made by ``add_subparsers`` are `Parser` too (argparse builds them with the parent's
    class), so ``python -m train.hf export`` without its arguments shows the export's usage and its defaults.
    """

    _bare = False

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        self._bare = not args
        return super().parse_known_args(self._dash_values(args), namespace)

    def _dash_values(self, args: list[str]) -> list[str]:
        """``args`` with each flag that takes one value joined to a following value that starts with ``-``
        but is no flag of this parser (``["--stage-layers", "-1,5"]`` -> ``["--stage-layers=-1,5"]``); the
        rest as given, and everything after ``--``."""
        options = {o for a in self._actions for o in a.option_strings}
        one_value = {o for a in self._actions if a.nargs is None for o in a.option_strings}
        out, i = [], 0
        while i < len(args):
            token = args[i]
            if token == "--":
                return out + args[i:]
            value = args[i + 1] if i + 1 < len(args) else ""
            if token in one_value and value.startswith("-") and value not in ("-", "--"):
                if value.split("=", 1)[0] not in options:
                    out.append(f"{token}={value}")
                    i += 2
                    continue
            out.append(token)
            i += 1
        return out

    def error(self, message: str):
        """Prints ``error: message`` (the usage block too for a bare invocation) and exits with status 2.

        Raises:
          SystemExit: Always, with code 2.
        """
        if self._bare:
            self.print_usage(sys.stderr)
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")
