"""--profile-steps A:B writes a jax.profiler trace (TensorBoard's xplane.pb, Perfetto's trace.json.gz) under
RUN_DIR/profile; bad ranges are refused naming the flag."""

import pytest
from test_faults import args_for

from train import train
from train.runtime.profile import parse_profile_steps


def test_a_three_step_run_writes_the_trace_of_its_chosen_steps(tmp_path, corpus, cache, capsys):
    run_dir = tmp_path / "run"
    code = train.main(args_for(corpus, cache, "--steps", "3", "--profile-steps", "2:3", "--run-dir", str(run_dir)))
    out = capsys.readouterr().out
    assert code == 0
    files = [p.name for p in (run_dir / "profile").rglob("*") if p.is_file()]
    assert any(f.endswith(".xplane.pb") for f in files) and any(f.endswith(".trace.json.gz") for f in files), files
    assert "profiling steps 2..3 into " in out and "wrote the profile to " in out


def test_no_flag_no_trace(tmp_path, corpus, cache):
    run_dir = tmp_path / "run"
    assert train.main(args_for(corpus, cache, "--steps", "2", "--run-dir", str(run_dir))) == 0
    assert not (run_dir / "profile").exists()


def test_profile_steps_values():
    assert parse_profile_steps(None, 10) is None
    assert parse_profile_steps("5:8", 10) == (5, 8) and parse_profile_steps("4", 10) == (4, 4)
    for bad in ("0:3", "5:4", "a:b", "3:", ":3"):
        with pytest.raises(ValueError, match=f"--profile-steps {bad}: expected A:B with 1 <= A <= B"):
            parse_profile_steps(bad, 10)
    with pytest.raises(ValueError, match="--profile-steps 12:14: starts after --steps 10"):
        parse_profile_steps("12:14", 10)
