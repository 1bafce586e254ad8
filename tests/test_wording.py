"""Errors that name what the user typed: --step (not --resume-step) on the readers, a run folder that is a file."""

import pytest
from test_faults import args_for

from train import generate, hf, train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus, cache):
    folder = tmp_path_factory.mktemp("run")
    assert train.main(args_for(corpus, cache, "--steps", "2", "--run-dir", str(folder))) == 0
    return folder


@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_missing_step_names_step_not_resume_step(run_dir, tmp_path, capsys, command):
    capsys.readouterr()
    if command == "generate":
        code = generate.main(["--run-dir", str(run_dir), "--step", "999", "--prompt", "a", "--max-new-tokens", "1"])
    else:
        code = hf.main(["export", str(run_dir), "--step", "999", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --step 999: no such checkpoint in ") and "saved steps are 2" in err, err
    assert "--resume-step" not in err


def test_a_run_folder_that_is_a_file_says_so(tmp_path, corpus, cache, capsys):
    (tmp_path / "afile").write_text("not a folder")
    for run in (tmp_path / "afile", tmp_path / "afile" / "run"):
        code = train.main(args_for(corpus, cache, "--steps", "2", "--run-dir", str(run)))
        err = capsys.readouterr().err
        assert code == 2 and err.strip() == (
            f"error: --run-dir {run}: cannot write there ({tmp_path / 'afile'} is a "
            "file, not a folder); choose a folder"
        ), err
