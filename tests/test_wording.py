"""Errors that name what the user typed: --step (not --resume-step) on the readers, a run folder that is a file;
what an export of a bytes-tokenizer run writes."""

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


def test_export_of_a_bytes_tokenizer_run_writes_an_equivalent_tokenizer(run_dir, tmp_path):
    import json

    from tokenizers import Tokenizer

    out = tmp_path / "out"
    assert hf.main(["export", str(run_dir), "--out", str(out)]) == 0
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "é\tx"
    assert tok.encode(text, add_special_tokens=False).ids == list(text.encode())
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == tok.token_to_id("<|endoftext|>") == 256
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"


@pytest.mark.parametrize("where", ["missing folder", "a folder", "no permission"])
def test_a_plot_that_cannot_be_written_is_refused_before_planning(tmp_path, capsys, monkeypatch, where):
    from train import plan

    monkeypatch.setattr(plan, "report", lambda *a: pytest.fail("planned although --plot cannot be written"))
    png, message = {
        "missing folder": (
            tmp_path / "no" / "plan.png",
            f"--plot {tmp_path / 'no' / 'plan.png'}: no folder {tmp_path / 'no'}; create it or give a path in an "
            "existing folder",
        ),
        "a folder": (tmp_path, f"--plot {tmp_path}: a folder; give a file name in it, e.g. --plot {tmp_path}/plan.png"),
        "no permission": ("/proc/plan.png", "--plot /proc: cannot write there ("),  # not even root writes in /proc
    }[where]
    code = plan.main(["--model", "1b", "--cluster", "h100:8", "--batch", "64", "--seq-len", "2048", "--plot", str(png)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1, err


def test_a_binary_prompt_file_names_the_file_and_the_byte(tmp_path, capsys):
    prompts = tmp_path / "prompts.bin"
    prompts.write_bytes(b"ok\n\xff\xfe\x00")
    code = generate.main(["--run-dir", str(tmp_path), "--prompt-file", str(prompts), "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == (
        f"error: --prompt-file {prompts}: not UTF-8 text (byte 3 is 0xff); give a text file of prompts, one a line"
    ), err
