"""Usage errors of every entry point: exit 2 and one ``error:`` line, argparse's usage block only for ``--help``
and a bare invocation (where the usage is what the user is after)."""

import pytest

from checkpoints import inspect
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
