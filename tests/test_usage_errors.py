"""Usage errors of every entry point: exit 2 and one ``error:`` line, argparse's usage block only for ``--help``
and a bare invocation (where the usage is what the user is after)."""

import argparse
from pathlib import Path

import pytest

from checkpoints import inspect
from checkpoints.argparser import HelpFormatter, Parser
from train import dpo, evaluate, generate, hf, launch, plan, train
from train.data import prepare
from train.launcher import command
from train.setup import parser as setup_parser

# (entry point's main, argv, text the one line must contain)
CASES = [
    (train.main, ["--rules", "bogus"], "argument --rules: invalid choice: 'bogus'"),
    (train.main, ["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
    (train.main, ["--bogus"], "unrecognized arguments: --bogus"),
    (launch.main, ["--max-restarts", "x"], "argument --max-restarts: invalid int value: 'x'"),
    (plan.main, ["--batch", "x"], "argument --batch: invalid int value: 'x'"),
    (generate.main, ["--run-dir", "r", "--max-new-tokens", "x"], "argument --max-new-tokens: invalid int value"),
    (evaluate.main, ["--zz"], "--run-dir"),
    (hf.main, ["export", "r"], "the following arguments are required: --out"),
    (hf.main, ["import"], None),  # a bare sub-command shows its usage
    (inspect.main, ["d", "--step", "x"], "argument --step: invalid int value: 'x'"),
]


def run(main, argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize("main, argv, message", CASES, ids=[f"{c[0].__module__} {' '.join(c[1])}" for c in CASES])
def test_a_usage_error_is_one_line_without_the_usage_block(main, argv, message, capsys):
    code, err = run(main, argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    if message is None:  # bare: the usage, then the error
        assert lines[0].startswith("usage: python -m train.hf import") and lines[-1].startswith("error:"), err
        return
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0] and "--help" in lines[0], err
    assert "usage:" not in err


@pytest.mark.parametrize(
    "main, prog", [(hf.main, "python -m train.hf"), (inspect.main, "python -m checkpoints.inspect")]
)
def test_a_bare_invocation_keeps_the_usage(main, prog, capsys):
    code, err = run(main, [], capsys)
    assert code == 2 and err.startswith(f"usage: {prog}") and err.strip().splitlines()[-1].startswith("error:"), err


def test_help_keeps_the_usage_block(capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: python -m train.train")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mesh", "stage=2,fsdp=4", "--stage-layers", "-1,5"], "error: --stage-layers -1,5: every stage needs"),
        (["--mesh", "-x"], "error: --mesh '-x': item '-x' is not AXIS=SIZE"),
        (["--stage-layers", "--mesh", "stage=2"], "error: argument --stage-layers: expected one argument"),
    ],
)
def test_a_value_starting_with_a_dash_reaches_the_flags_own_check(argv, message, capsys):
    """argparse takes ``-1,5`` for an option ("expected one argument"); the parser reads it as the flag's value,
    so the flag's own check names what is wrong. A flag with no value before another flag still says so."""
    try:
        code = train.main(["--model", "test", "--cpu-devices", "8", "--dry-run", *argv])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(message) and len(err.strip().splitlines()) == 1, err


def test_a_dash_value_is_joined_to_its_flag_only():
    """``["--stage-layers", "-1,5"]`` parses as ``--stage-layers=-1,5``; a following flag, a store-true flag's
    neighbour and everything after ``--`` stay as given."""
    parser = Parser(prog="p")
    parser.add_argument("--stage-layers")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(["--stage-layers", "-1,5", "--dry-run", "--", "-x"])
    assert (args.stage_layers, args.dry_run, args.rest) == ("-1,5", True, ["-x"])
    assert parser.parse_args(["--stage-layers=-2"]).stage_layers == "-2"


def test_help_lists_every_mesh_axis_and_points_only_to_docs_that_exist(capsys):
    import re
    from pathlib import Path

    from sharding.axes import MESH_AXES

    with pytest.raises(SystemExit):
        train.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert f"mesh axes ({', '.join(MESH_AXES)})" in out and "expert" in MESH_AXES
    assert "README:" not in out
    pages = set(re.findall(r"docs/[\w-]+\.md", out))
    root = Path(__file__).resolve().parents[1]
    assert pages and all((root / page).is_file() for page in pages), pages


# every command under train/ and checkpoints/: (module run by python -m, its main, its parser's builder, argv
# before --help)
HELP_COMMANDS = [
    ("train.train", train.main, setup_parser.build_parser, []),
    ("train.launch", launch.main, command.build_parser, []),
    ("train.plan", plan.main, plan.build_parser, []),
    ("train.generate", generate.main, generate.build_parser, []),
    ("train.evaluate", evaluate.main, evaluate.build_parser, []),
    ("train.hf", hf.main, hf.build_parser, ["import"]),
    ("train.hf", hf.main, hf.build_parser, ["export"]),
    ("train.dpo", dpo.main, dpo.build_parser, []),
    ("train.data", prepare.main, prepare.build_parser, ["prepare"]),
    ("train.data", prepare.main, prepare.build_parser, ["verify"]),
    ("checkpoints.inspect", inspect.main, inspect.build_parser, []),
]


def _parsers(parser):
    """``parser`` and its sub-commands' parsers."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def test_every_command_is_in_the_help_list():
    """A module run as ``python -m`` (one with a ``__main__`` block) under train/ or checkpoints/ is in
    `HELP_COMMANDS`, so the help test below covers it."""
    root = Path(__file__).resolve().parents[1]
    found = set()
    for package in ("train", "checkpoints"):
        for path in (root / package).rglob("*.py"):
            if '__name__ == "__main__"' in path.read_text(encoding="utf-8"):
                found.add(".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__main__"))
    assert found == {c[0] for c in HELP_COMMANDS}


@pytest.mark.parametrize(
    "module, main, build, argv", HELP_COMMANDS, ids=[" ".join([c[0], *c[3], "--help"]) for c in HELP_COMMANDS]
)
def test_help_shows_real_defaults_and_never_none(module, main, build, argv, capsys):
    """``--help`` exits 0 and prints no ``(default: None)`` (nor ``[]`` or ``False``); every parser, sub-commands
    included, formats with `HelpFormatter`, so each optional flag with a real default shows it (argparse's
    ``(default: X)`` or the help's own words)."""
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith(" ".join(["usage: python -m", module, *argv])), out
    for empty in ("(default: None)", "(default: [])", "(default: False)"):
        assert empty not in out, out
    for p in _parsers(build()):
        formatter = p._get_formatter()
        assert isinstance(formatter, HelpFormatter), p.prog
        for action in p._actions:
            none = action.default is None or action.default is False or action.default is argparse.SUPPRESS
            if action.option_strings and not none and action.default != []:
                assert "default" in formatter._get_help_string(action), (p.prog, action.option_strings)


@pytest.mark.parametrize("command", ["evaluate", "generate", "hf import", "dpo", "train"])
def test_a_tokenizer_file_that_does_not_load_is_one_line(command, tmp_path, capsys):
    """A ``--tokenizer`` that is not a tokenizer.json ended in a traceback (``Exception: expected value at line 1
    column 1``) from looking up the end-of-document token before the tokenizer was loaded; each command now
    prints the loader's one line naming the flag."""
    folder = Path(__file__).resolve().parent / "fixtures" / "hf" / "llama_gqa"
    junk = tmp_path / "tokenizer.json"
    junk.write_text("junk")
    argv = {
        "evaluate": (evaluate.main, ["--hf", str(folder)]),
        "generate": (generate.main, ["--hf", str(folder), "--prompt", "hi"]),
        "hf import": (hf.main, ["import", str(folder), "--run-dir", str(tmp_path / "run")]),
        "dpo": (dpo.main, ["--init-from", str(folder), "--data", str(junk)]),
        "train": (train.main, ["--init-from", str(folder), "--dry-run", "--cpu-devices", "8"]),
    }
    main, flags = argv[command]
    assert main([*flags, "--tokenizer", str(junk)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: --tokenizer {junk}: cannot load it as a tokenizer.json (") and err.count("\n") == 1
    ), err
