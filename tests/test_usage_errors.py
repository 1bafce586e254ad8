"""Usage errors of every entry point: exit 2 and one ``error:`` line, argparse's usage block only for ``--help``
and a bare invocation (where the usage is what the user is after)."""

import pytest

from checkpoints import inspect
from checkpoints.argparser import Parser
from train import evaluate, generate, hf, launch, plan, train

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
