"""``--config run.toml`` and the run record ``RUN_DIR/config.json``: flags from a file, flags recorded.

A config file is TOML (read with the standard library's `tomllib`; PyYAML is not a dependency, so YAML is
not read). Its keys are the trainer's flag names without the leading dashes, with dashes or underscores
(``seq-len = 128`` or ``seq_len = 128``); values are what the flag takes: a string or number, ``true`` for
a switch (``resume = true``), a list for a repeatable flag (``set = ["num_layers=4"]``). The file becomes
flags placed before the command line's, so argparse checks them exactly as typed flags and a flag on the
command line overrides the file (a repeatable one adds to its list).

Every run (process 0) writes ``RUN_DIR/config.json`` atomically: the command line as typed and every flag's
resolved value. ``--resume --run-dir R`` reads from that record, when no ``--config`` is given, every setting
of the run (the model, tokenizer, data, layout and optimizer, and also its steps, devices, checkpoint,
evaluation and log intervals) but what the command line names, so ``--resume --run-dir R`` alone continues
the run as it was started. The model's flags (`MODEL_FLAGS`) and the layout's
(`train.setup.layout_flags.RECORDED_LAYOUT_FLAGS`) are each taken whole or not at all; the flags of
`NOT_RECORDED` and those the launcher gives each process (`PER_PROCESS`) are never taken.

A resume's record keeps the run's history: ``history`` lists the first command line with its flags, then
each later invocation's command line and the flags it changed (``{"flag": [before, after]}``); ``command``
and ``flags`` are the latest (what the next resume reads).
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from collections.abc import Sequence
from pathlib import Path

from checkpoints.argparser import Parser
from train.setup.layout_flags import RECORDED_LAYOUT_FLAGS

RECORD = "config.json"
"""The run record's name inside the run folder."""
NOT_RECORDED = ("config", "resume", "resume_step", "discard_later", "break_lock", "dry_run")
"""Flags a resume from the record does not take from it: they say what this invocation does."""
MODEL_FLAGS = ("model", "set", "init_from")
"""The model as a whole: a command line that names one of them restates the model, and the record's are not taken."""
PER_PROCESS = ("coordinator", "num_processes", "process_id", "external_coordinator", "run_dir")
"""Flags that say which process of which job this is: a resume takes them from its own command line (the launcher
gives them), never from the record."""


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> the action of every long flag."""
    return {a.dest: a for a in parser._actions if any(o.startswith("--") for o in a.option_strings)}


def to_argv(values: dict, parser: argparse.ArgumentParser, source: str) -> list[str]:
    """The flags that ``values`` (flag name -> value) stand for.

    Raises:
      ValueError: A key that is no flag, or a value of the wrong kind, naming ``source`` and the key.
    """
    actions, argv, seen = _actions(parser), [], {}
    for key, value in values.items():
        dest = key.replace("-", "_")
        if dest in seen:
            raise ValueError(
                f"--config {source}: keys {seen[dest]!r} and {key!r} are the same flag --{dest.replace('_', '-')}; "
                f"keep one of them"
            )
        seen[dest] = key
        if dest == "config":
            raise ValueError(
                f"--config {source}: key {key!r}: a config file cannot name another; copy that file's keys into "
                f"this one"
            )
        action = actions.get(dest)
        if action is None or dest == "help":
            raise ValueError(
                f"--config {source}: unknown key {key!r} (keys are flag names without the dashes, "
                f"e.g. seq-len; python -m train.train --help lists them)"
            )
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ValueError(f"--config {source}: {key} = {value!r}: expected true or false")
            argv += [flag] if value else []
        elif isinstance(action, argparse._AppendAction):
            for item in value if isinstance(value, list) else [value]:
                argv += [flag, str(item)]
        elif value is not None:
            if isinstance(value, (list, dict, bool)):
                listed = isinstance(value, list) and "," in (action.metavar or "")  # e.g. --stage-layers N,N,...
                joined = ",".join(map(str, value)) if listed else ""
                hint = f', e.g. {key} = "{joined}"' if listed else ""
                raise ValueError(f"--config {source}: {key} = {value!r}: expected one value for {flag}{hint}")
            argv += [flag, str(value)]
    return argv


def read_file(path: str) -> dict:
    """The table of a TOML config file (a ``.json`` file, e.g. a run record's ``flags``, is read as JSON).

    Raises:
      ValueError: A file that is missing or does not parse, naming it.
    """
    try:
        text = Path(path).read_bytes()
        if path.endswith(".json"):
            data = json.loads(text)
            if not isinstance(data, dict):  # a list or a number: no flags to read (and no .get to call)
                raise ValueError(
                    f'--config {path}: expected an object of flags, e.g. {{"seq-len": 128}} (or a run\'s config.json)'
                )
            return data.get("flags", data)
        return tomllib.loads(text.decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--config {path}: not a TOML file ({e})") from None


def _named_dests(argv: Sequence[str], parser: argparse.ArgumentParser) -> set[str]:
    """The destinations of the flags ``argv`` names (``--mesh x`` and ``--mesh=x`` alike)."""
    by_option = {o: a.dest for a in parser._actions for o in a.option_strings}
    return {by_option[t.split("=", 1)[0]] for t in argv if t.split("=", 1)[0] in by_option}


def expand(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with ``--config FILE`` (or, for ``--resume --run-dir R`` without it, R's record) expanded into
    flags before the command line's.

    Raises:
      ValueError: As `read_file` and `to_argv`.
    """
    pre = Parser(add_help=False, prog=parser.prog)
    pre.add_argument("--config", default=None)
    pre.add_argument("--run-dir", default=None)
    pre.add_argument("--resume", action="store_true")
    known, _ = pre.parse_known_args(list(argv))
    if known.config is not None:
        return to_argv(read_file(known.config), parser, known.config) + list(argv)
    record = Path(known.run_dir) / RECORD if known.run_dir else None
    if known.resume and record is not None and record.is_file():
        named = _named_dests(argv, parser)
        skipped = {*NOT_RECORDED, *PER_PROCESS, *named}
        for group in (MODEL_FLAGS, RECORDED_LAYOUT_FLAGS):
            if named & set(group):
                skipped |= set(group)
        flags = {k: v for k, v in read_file(str(record)).items() if k.replace("-", "_") not in skipped}
        return to_argv(flags, parser, str(record)) + list(argv)
    return list(argv)


def record_of(argv: Sequence[str], args: argparse.Namespace) -> dict:
    """``{"command": argv, "flags": ...}``: the command line as typed and every flag's resolved value (those of
    `NOT_RECORDED` left out)."""
    flags = {k: v for k, v in vars(args).items() if k not in NOT_RECORDED}
    return {"command": list(argv), "flags": json.loads(json.dumps(flags, default=str))}


def with_history(previous: dict | None, record: dict) -> dict:
    """``record`` (`record_of`) with the run's ``history`` (see the module docstring): ``previous`` (the
    record already in the folder, None for a new run) extended by this invocation's command line and the flags
    it changed."""
    if not isinstance(previous, dict) or not isinstance(previous.get("flags"), dict):
        return {**record, "history": [{"command": record["command"], "flags": record["flags"]}]}
    before, after = previous["flags"], record["flags"]
    changed = {k: [before.get(k), after.get(k)] for k in sorted({*before, *after}) if before.get(k) != after.get(k)}
    history = previous.get("history")
    if not isinstance(history, list):  # a record written before histories were kept: its run opens the list
        history = [{"command": previous.get("command"), "flags": before}]
    return {**record, "history": [*history, {"command": record["command"], "changed": changed}]}


def write_record(run_dir: str, record: dict) -> Path:
    """Writes ``record`` (`record_of`) to ``RUN_DIR/config.json`` atomically (a temporary file renamed over it),
    keeping the history of the record it replaces (`with_history`)."""
    path = Path(run_dir) / RECORD
    try:
        previous = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        previous = None  # an unreadable record: this run's starts the history again
    record = with_history(previous, record)
    tmp = path.with_name(f".{RECORD}.{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    return path
