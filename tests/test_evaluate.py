"""Held-out evaluation of an imported model against a plain one-device computation of the same loss."""

import math

import jax
import numpy as np
import pytest
from test_hf import FIXTURES, load

from models.transformer import apply
from sharding.parallel import UNSHARDED

TEXT = [
    "def add(a, b):\n    return a + b\n" * 6,
    "class Point:\n    x: int = 0\n    y: int = 0\n" * 5,
    "import os\nprint(os.getcwd())\n" * 8,
    "for i in range(10):\n    print(i * i)\n" * 7,
]


@pytest.fixture()
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, text in enumerate(TEXT):
        (folder / f"doc{i}.py").write_text(text)
    return folder


def test_heldout_loss_equals_a_plain_computation(corpus, tmp_path):
    from train.data import load_dataset
    from train.data.tokenizer import HFTokenizer
    from train.evaluate import evaluate
    from train.runtime.inference import LoadedModel

    config, graphdef, params, par = load(FIXTURES / "llama_tied", "fsdp=4,tensor=2")
    tokenizer = HFTokenizer(FIXTURES / "llama_tied" / "tokenizer.json")
    model = LoadedModel(config, graphdef, params, tokenizer, tokenizer.eod_id, None)
    dataset = load_dataset(
        str(corpus), tokenizer, 16, 4, seed=0, heldout=0.5, cache_dir=tmp_path / "cache", log=lambda _: None
    )
    loss, tokens = evaluate(model, par, dataset, 4, 16, 2)

    plain = jax.tree.map(np.asarray, params)  # one device, float32
    total = count = 0.0
    for b in range(2):
        batch = dataset.eval_rows(b, range(4))
        logits = np.asarray(
            apply(graphdef, plain, batch["tokens"], batch["positions"], batch["segment_ids"], par=UNSHARDED), np.float64
        )
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        picked = np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
        total += float(-(picked * batch["loss_mask"]).sum())
        count += float(batch["loss_mask"].sum())
    assert tokens == count
    assert loss == pytest.approx(total / count, rel=1e-5)


def test_cli_prints_loss_and_perplexity(corpus, tmp_path, capsys):
    from train.evaluate import main

    assert (
        main(
            [
                "--hf",
                str(FIXTURES / "qwen2"),
                "--data",
                str(corpus),
                "--seq-len",
                "16",
                "--batch-size",
                "4",
                "--heldout",
                "0.5",
                "--data-cache",
                str(tmp_path / "cache"),
                "--mesh",
                "data=2,tensor=4",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip()
    loss = float(line.split("held-out loss ")[1].split()[0])
    ppl = float(line.split("perplexity ")[1].split()[0])
    assert ppl == pytest.approx(math.exp(loss), rel=1e-3) and "tokens" in line


def test_cli_bad_flag_is_one_line(capsys):
    from train.evaluate import main

    assert main(["--hf", str(FIXTURES / "qwen2"), "--seq-len", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --seq-len 0: must be positive, e.g. 16\n"


def test_an_unwritable_data_cache_is_named_before_the_model_is_read(capsys, tmp_path, monkeypatch):
    """``--data-cache`` under a file ended in "[Errno 20] Not a directory: '.../prepared'" after the model was
    read and compiled, naming no flag; it is checked first, as train.train checks it."""
    import train.evaluate as ev

    monkeypatch.setattr(ev, "load_model", lambda *a: pytest.fail("the model was read before the cache was checked"))
    (tmp_path / "a-file").write_text("not a folder")
    cache = tmp_path / "a-file" / "cache"
    assert ev.main(["--hf", str(FIXTURES / "llama_tied"), "--data-cache", str(cache)]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"error: --data-cache {cache}: cannot write there ({tmp_path / 'a-file'} is a file, not a folder); choose a folder\n"
    )


def test_an_evaluation_that_cannot_fit_is_refused_before_reading_data_and_its_suggestion_runs(
    corpus, tmp_path, capsys, monkeypatch
):
    import train.evaluate as ev
    from train.data.tokenizer import HFTokenizer
    from train.reports.fit import step_peak
    from train.runtime.inference import LoadedModel

    config, graphdef, params, par = load(FIXTURES / "llama_tied", "fsdp=8")
    model = LoadedModel(config, graphdef, params, HFTokenizer(FIXTURES / "llama_tied" / "tokenizer.json"), 0, None)
    monkeypatch.setattr(ev, "device_memory", lambda devices: (None, "unknown"))
    peaks = {t: step_peak(ev.compile_fitting(model, par, 4, t)) for t in (16, 32)}
    assert peaks[32] > peaks[16]  # the test's premise: a shorter sequence needs less
    monkeypatch.setattr(ev, "device_memory", lambda devices: (peaks[16], "a test budget"))
    base = ["--hf", str(FIXTURES / "llama_tied"), "--mesh", "fsdp=8", "--batch-size", "4", "--heldout", "0.5"]
    base += ["--data", str(tmp_path / "missing")]  # never read: the refusal comes first
    assert ev.main([*base, "--seq-len", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --seq-len 64 x --batch-size 4: evaluation cannot fit")
    assert "use --seq-len 16 (its peak is" in err and "more than the" in err and "of a test budget" in err
    base[-1] = str(corpus)
    assert ev.main([*base, "--seq-len", "16", "--data-cache", str(tmp_path / "cache"), "--batches", "1"]) == 0
    assert "held-out loss" in capsys.readouterr().out
