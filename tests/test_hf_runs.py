"""Hugging Face folders and run folders: ``--init-from``, ``checkpoints.hf import/export``, and
``--run-dir`` on generate and evaluate (tests/fixtures/hf)."""

import json
from pathlib import Path

import pytest

from test_hf import FIXTURES, load
from train import cli, train

TEXT = ["def add(a, b):\n    return a + b\n" * 12, "class Point:\n    x: int = 0\n    y: int = 0\n" * 10,
        "import os\nprint(os.getcwd())\n" * 16, "for i in range(10):\n    print(i * i)\n" * 14,
        "while True:\n    break\n" * 20, "x = [i for i in range(3)]\n" * 18]
B, T = 8, 32


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(TEXT):
        (folder / f"doc{i}.py").write_text(text)
    return folder


def common(corpus, cache):
    return ["--data", str(corpus), "--data-cache", str(cache), "--seq-len", str(T), "--batch-size", str(B),
            "--heldout", "0.34", "--eval-batches", "1", "--eval-every", "0", "--log-every", "1", "--no-progress",
            "--lr", "1e-2", "--warmup", "0"]


def metrics(run_dir, key):
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if key in r}


def heldout_loss(folder, corpus, cache):
    """The imported model's loss on the first held-out batch (`train.evaluate`, itself checked against a plain
    one-device computation in test_evaluate)."""
    from train.data import load_dataset
    from train.evaluate import evaluate
    from train.inference import LoadedModel
    from train.tokenizer import HFTokenizer

    config, graphdef, params, par = load(folder, "fsdp=8")
    from checkpoints import hf

    tokenizer = HFTokenizer(folder / "tokenizer.json", hf.eod_token(folder))
    dataset = load_dataset(str(corpus), tokenizer, T, B, seed=0, heldout=0.34, cache_dir=cache, log=lambda _: None)
    return evaluate(LoadedModel(config, graphdef, params, tokenizer, None, None), par, dataset, B, T, 1)[0]


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory, small_corpus):
    """``--init-from llama_gqa`` then 5 steps on fsdp=4,tensor=2 (checkpoint every 5)."""
    base = tmp_path_factory.mktemp("runs")
    run_dir, cache = base / "ft", base / "cache"
    args = [*common(small_corpus, cache), "--init-from", str(FIXTURES / "llama_gqa"), "--mesh", "fsdp=4,tensor=2",
            "--steps", "5", "--ckpt-every", "5", "--run-dir", str(run_dir)]
    assert train.main(args) == 0
    return run_dir, cache


def test_init_from_starts_at_the_imported_model_and_five_steps_lower_the_loss(fine_tuned, small_corpus):
    run_dir, cache = fine_tuned
    held_out = metrics(run_dir, "eval/loss")
    assert sorted(held_out) == [0, 5]
    assert held_out[0] == pytest.approx(heldout_loss(FIXTURES / "llama_gqa", small_corpus, cache), rel=1e-4)
    assert held_out[5] < 0.9 * held_out[0]
    losses = metrics(run_dir, "train/loss")
    assert losses[5] < losses[1]


def test_init_from_onto_a_pipeline_gives_the_same_first_step(fine_tuned, small_corpus, tmp_path):
    run_dir, cache = fine_tuned
    args = [*common(small_corpus, cache), "--init-from", str(FIXTURES / "llama_gqa"), "--mesh", "stage=2,fsdp=4",
            "--microbatches", "2", "--steps", "1", "--run-dir", str(tmp_path / "pp")]
    assert train.main(args) == 0
    assert metrics(tmp_path / "pp", "eval/loss")[0] == pytest.approx(metrics(run_dir, "eval/loss")[0], rel=1e-5)
    assert metrics(tmp_path / "pp", "train/loss")[1] == pytest.approx(metrics(run_dir, "train/loss")[1], rel=1e-4)


def test_resume_wins_over_init_from_and_says_so(fine_tuned, small_corpus, tmp_path, capsys):
    import shutil

    run_dir, cache = fine_tuned
    copy = tmp_path / "ft"
    shutil.copytree(run_dir, copy)
    capsys.readouterr()
    args = [*common(small_corpus, cache), "--init-from", str(FIXTURES / "llama_gqa"), "--mesh", "fsdp=8",
            "--steps", "6", "--decay-steps", "5", "--resume", "--run-dir", str(copy)]
    assert train.main(args) == 0
    out = capsys.readouterr().out
    assert "resumed step 5" in out and "is not read (the checkpoint wins)" in out
    assert "initialized from" not in out


def test_init_from_takes_the_tokenizer_and_execution_flags():
    config = cli.parse(["--init-from", str(FIXTURES / "llama_tied"), "--dtype", "bfloat16", "--set", "remat=full",
                        "--set", "num_layers=2"])
    assert (config.model.dtype, config.model.remat, config.model.tie_embeddings) == ("bfloat16", "full", True)
    assert config.data.tokenizer == str(FIXTURES / "llama_tied" / "tokenizer.json")
    assert config.data.eod_token is not None
    assert config.preset == f"hf:{FIXTURES / 'llama_tied'}"
    other = cli.parse(["--init-from", str(FIXTURES / "llama_tied"), "--tokenizer", "x.json"])
    assert other.data.tokenizer == "x.json"


@pytest.mark.parametrize("flags, message", [
    (["--set", "num_layers=4"], "--set num_layers=4: conflicts with"),
    (["--model", "test"], "--model test: conflicts with"),
    (["--set", "vocab_size=300"], "vocab_size=264"),
])
def test_init_from_refuses_a_conflicting_architecture(flags, message, capsys):
    assert train.main(["--init-from", str(FIXTURES / "llama_gqa"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


def test_init_from_a_missing_folder_is_one_line(tmp_path, capsys):
    assert train.main(["--init-from", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no such folder" in err and len(err.splitlines()) == 1
