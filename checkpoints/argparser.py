"""The argument parser of every entry point: usage errors in one line.

argparse prints a command's whole usage block (dozens of lines for ``python -m train.train``) before a
one-line complaint about one flag, which buries the complaint. `Parser` prints just ``error: ...`` with a
pointer to ``--help``, exit status 2 as argparse's; the usage block stays for ``--help`` and for a bare
invocation (no arguments at all), where it is what the user is after.

It lives here rather than in `train.cli` because ``python -m checkpoints.inspect`` uses it too and the
``checkpoints`` package may not import ``train``; `train.cli` re-exports it for the trainer's commands.
"""

from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose usage errors are one line: ``error: MESSAGE (see PROG --help)``.

    Sub-commands made by ``add_subparsers`` are `Parser` too (argparse builds them with the parent's
    class), so ``python -m train.hf export`` without its arguments shows the export's usage.
    """

    _bare = False

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        self._bare = not args
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        """Prints ``error: message`` (the usage block too for a bare invocation) and exits with status 2.

        Raises:
          SystemExit: Always, with code 2.
        """
        if self._bare:
            self.print_usage(sys.stderr)
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")
