"""Divergence: a finite loss past --max-loss stops the run like a non-finite one, and the checkpoint made from
the parameters that produced it is set aside, so the last one kept is from before the divergence."""

import math

import pytest
from test_faults import args_for, steps_saved

from train import train
from train.runtime.divergence import DivergenceGuard, auto_max_loss, parse_max_loss


def test_max_loss_values():
    assert parse_max_loss("auto") is None and parse_max_loss("off") == math.inf and parse_max_loss("7.5") == 7.5
    for bad in ("0", "-1", "nan", "inf", "x"):
        with pytest.raises(ValueError, match=f"--max-loss {bad}: must be auto, off or a finite number > 0"):
            parse_max_loss(bad)


def test_the_auto_limit_is_relative_to_the_first_loss_and_the_uniform_guess():
    assert auto_max_loss(5.0, 256) == 10.0
    assert auto_max_loss(1.0, 256) == pytest.approx(1.5 * math.log(256))
    guard = DivergenceGuard(None, 256)
    assert guard.check(1, 5.6) is None and guard.check(2, 11.0) is None
    reason = guard.check(3, 11.3)
    assert "the loss diverged at step 3: 11.3 > --max-loss 11.2 (auto: max(2 x step 1's loss 5.6" in reason
    assert DivergenceGuard(math.inf, 256).check(1, 1e30) is None
    assert DivergenceGuard(3.0, 256).check(1, 3.5).startswith("the loss diverged at step 1: 3.5 > --max-loss 3 (given)")


def test_a_huge_learning_rate_stops_and_keeps_the_checkpoint_from_before(tmp_path, corpus, cache, capsys):
    """Three good steps, then a resume at --lr 30 (on the test model a finite loss of about 17,000 one step
    later; --lr 1e10 gives NaN at once, which the non-finite stop handles)."""
    run_dir = tmp_path / "run"
    assert train.main(args_for(corpus, cache, "--steps", "3", "--ckpt-every", "1", "--run-dir", str(run_dir))) == 0
    capsys.readouterr()
    code = train.main(
        args_for(
            corpus, cache, "--steps", "8", "--ckpt-every", "1", "--lr", "30", "--resume", "--run-dir", str(run_dir)
        )
    )
    err = capsys.readouterr()
    assert code == 1, err.err
    lines = [line for line in err.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "the loss diverged at step " in lines[0], err.err
    assert "Traceback" not in err.err
    bad = int(lines[0].split("the loss diverged at step ")[1].split(":")[0])
    saved = steps_saved(run_dir)
    assert bad >= 5 and max(saved) == bad - 2, (saved, bad)  # bad - 1 holds the parameters that gave the bad loss
    assert [p.name.split(".")[0] for p in (run_dir / "checkpoints").glob("*.diverged-*")] == [str(bad - 1)]
    assert f"the checkpoint of step {bad - 1} holds the parameters whose loss stopped the run" in err.out


def test_bad_max_loss_is_refused_in_one_line(tmp_path, corpus, cache, capsys):
    code = train.main(args_for(corpus, cache, "--max-loss", "nan", "--run-dir", str(tmp_path / "r")))
    err = capsys.readouterr().err
    assert (
        code == 2
        and err.strip() == "error: --max-loss nan: must be auto, off or a finite number > 0, e.g. --max-loss 20"
    ), err
