"""Writes ``docs/flags.md``, the reference of every command's flags, from the commands' own parsers.

Run ``python docs/gen_flags.py`` after changing a flag; ``tests/test_docs.py`` regenerates the page in
memory and fails when the file differs, so the reference cannot drift from ``--help``.

Each command module listed in `COMMANDS` exposes ``build_parser() -> argparse.ArgumentParser``; the page
has one section per command (one per subcommand for ``train.hf``) and one table per argument group, with
the flag, its default and its help text as ``--help`` expands it (``%(default)s`` filled in). A module that
takes another command's flags too names its own groups in ``DOCUMENTED_GROUPS`` (the others are documented
under that command).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

COMMANDS = (
    "train.setup.parser",
    "train.launcher.command",
    "train.plan",
    "train.generate",
    "train.evaluate",
    "train.hf",
    "train.dpo",
    "train.data.prepare",
    "checkpoints.inspect",
)
"""Modules whose ``build_parser()`` is documented, in the order of the page."""

OUTPUT = Path(__file__).resolve().parent / "flags.md"
COMMAND = "python docs/gen_flags.py"
"""How to regenerate the page (named by the up-to-date test's failure)."""

HEADER = f"""# Flags

Every flag of every command, generated from the commands' parsers by `{COMMAND}` (do not edit by
hand; `tests/test_docs.py` fails when this page is out of date). `--help` on any command prints the
same text. An empty default means none (the meaning says what happens then). The pages beside this one explain what the flags do together: [training](training.md),
[sharding](sharding.md), [pipelines](pipelines.md), [heterogeneous clusters](heterogeneous.md),
[several processes](multiprocess.md), [Hugging Face](huggingface.md).
"""


def _cell(text: str) -> str:
    """One table cell: pipes escaped, whitespace folded to single spaces."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    """``--name METAVAR`` (or the positional's name), each option string in code."""
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    takes_value = action.nargs != 0
    metavar = ""
    if takes_value:
        if action.metavar is not None:
            metavar = f" {action.metavar}"
        elif action.choices is not None:
            metavar = ""
        else:
            metavar = f" {action.dest.upper()}"
    return ", ".join(f"`{option}{metavar}`" for option in action.option_strings)


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0:  # store_true and the like
        return "off"
    default = action.default
    if default is None or default is argparse.SUPPRESS or default == []:
        return ""
    return f"`{default}`"


def _help(action: argparse.Action, prog: str) -> str:
    """The help text as argparse expands it, then the choices when the flag has them."""
    text = action.help or ""
    if text is argparse.SUPPRESS:
        return ""
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = prog
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    text = text % params
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        text += f" (one of: {', '.join(f'`{c}`' for c in action.choices)})"
    return text


def _epilog(text: str) -> list[str]:
    """The epilog as paragraphs, its example commands (lines that start with two spaces, which ``--help``
    prints whole) in a code block."""
    prose = " ".join(line for line in text.splitlines() if not line.startswith("  "))
    commands = [line.strip() for line in text.splitlines() if line.startswith("  ")]
    lines = ["", " ".join(prose.split())] if prose.strip() else []
    return lines + (["", "```", *commands, "```"] if commands else [])


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse._SubParsersAction]:
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


def _tables(parser: argparse.ArgumentParser, groups: tuple[str, ...] | None = None) -> list[str]:
    """One table per argument group that holds documented actions (``--help`` itself left out), of ``groups``
    (titles) only when given."""
    lines: list[str] = []
    for group in parser._action_groups:
        if groups is not None and group.title not in groups:
            continue
        actions = [
            a
            for a in group._group_actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help is not argparse.SUPPRESS
        ]
        if not actions:
            continue
        lines += ["", f"**{group.title}**", "", "| flag | default | meaning |", "|---|---|---|"]
        lines += [f"| {_cell(_flag(a))} | {_cell(_default(a))} | {_cell(_help(a, parser.prog))} |" for a in actions]
    for group in parser._mutually_exclusive_groups:
        if group.required:
            names = ", ".join(f"`{a.option_strings[0]}`" for a in group._group_actions)
            lines += ["", f"Exactly one of {names} is required."]
    return lines


def _section(parser: argparse.ArgumentParser, level: int, groups: tuple[str, ...] | None = None) -> list[str]:
    lines = ["", f"{'#' * level} `{parser.prog}`"]
    if parser.description:
        lines += ["", " ".join(parser.description.split())]
    lines += _tables(parser, groups)
    if parser.epilog:
        lines += _epilog(parser.epilog)
    for sub in _subparsers(parser):
        helps = {a.dest: a.help for a in sub._choices_actions}
        for name, child in sub.choices.items():
            child_lines = _section(child, level + 1)
            if helps.get(name) and not child.description:
                child_lines[2:2] = ["", helps[name][:1].upper() + helps[name][1:] + "."]
            lines += child_lines
    return lines


def render() -> str:
    """The whole page, as `OUTPUT` should hold it.

    Raises:
      AttributeError: A module of `COMMANDS` without ``build_parser``.
    """
    lines = [HEADER.rstrip("\n")]
    for name in COMMANDS:
        module = importlib.import_module(name)
        lines += _section(module.build_parser(), level=2, groups=getattr(module, "DOCUMENTED_GROUPS", None))
    return "\n".join(lines) + "\n"


def main() -> int:
    OUTPUT.write_text(render(), encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(OUTPUT.parents[1]))  # the repository root, for a checkout that is not installed
    sys.exit(main())
