"""Hugging Face folders and run folders: ``--init-from``, ``checkpoints.hf import/export``, and
``--run-dir`` on generate and evaluate (tests/fixtures/hf)."""

import json
import os
from pathlib import Path

import pytest
from test_hf import FIXTURES, load

from train import train
from train.setup import cli

TEXT = [
    "def add(a, b):\n    return a + b\n" * 12,
    "class Point:\n    x: int = 0\n    y: int = 0\n" * 10,
    "import os\nprint(os.getcwd())\n" * 16,
    "for i in range(10):\n    print(i * i)\n" * 14,
    "while True:\n    break\n" * 20,
    "x = [i for i in range(3)]\n" * 18,
]
B, T = 8, 32


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(TEXT):
        (folder / f"doc{i}.py").write_text(text)
    return folder


def common(corpus, cache):
    return [
        "--data",
        str(corpus),
        "--data-cache",
        str(cache),
        "--seq-len",
        str(T),
        "--batch-size",
        str(B),
        "--heldout",
        "0.34",
        "--eval-batches",
        "1",
        "--eval-every",
        "0",
        "--log-every",
        "1",
        "--no-progress",
        "--lr",
        "1e-2",
        "--warmup",
        "0",
    ]


def metrics(run_dir, key):
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if key in r}


def heldout_loss(folder, corpus, cache):
    """The imported model's loss on the first held-out batch (`train.evaluate`, itself checked against a plain
    one-device computation in test_evaluate)."""
    from train.data import load_dataset
    from train.data.tokenizer import HFTokenizer
    from train.evaluate import evaluate
    from train.runtime.inference import LoadedModel

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
    args = [
        *common(small_corpus, cache),
        "--init-from",
        str(FIXTURES / "llama_gqa"),
        "--mesh",
        "fsdp=4,tensor=2",
        "--steps",
        "5",
        "--ckpt-every",
        "5",
        "--run-dir",
        str(run_dir),
    ]
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
    args = [
        *common(small_corpus, cache),
        "--init-from",
        str(FIXTURES / "llama_gqa"),
        "--mesh",
        "stage=2,fsdp=4",
        "--microbatches",
        "2",
        "--steps",
        "1",
        "--run-dir",
        str(tmp_path / "pp"),
    ]
    assert train.main(args) == 0
    assert metrics(tmp_path / "pp", "eval/loss")[0] == pytest.approx(metrics(run_dir, "eval/loss")[0], rel=1e-5)
    assert metrics(tmp_path / "pp", "train/loss")[1] == pytest.approx(metrics(run_dir, "train/loss")[1], rel=1e-4)


def test_resume_wins_over_init_from_and_says_so(fine_tuned, small_corpus, tmp_path, capsys):
    import shutil

    run_dir, cache = fine_tuned
    copy = tmp_path / "ft"
    shutil.copytree(run_dir, copy)
    capsys.readouterr()
    args = [
        *common(small_corpus, cache),
        "--init-from",
        str(FIXTURES / "llama_gqa"),
        "--mesh",
        "fsdp=8",
        "--steps",
        "6",
        "--decay-steps",
        "5",
        "--resume",
        "--run-dir",
        str(copy),
    ]
    assert train.main(args) == 0
    out = capsys.readouterr().out
    assert "resumed step 5" in out and "is not read (the checkpoint wins)" in out
    assert "initialized from" not in out


def test_init_from_fine_tunes_on_chat_data_with_the_assistant_only_loss(tmp_path):
    """An imported model whose folder has a chat template fine-tunes on chat JSONL: the cache's preparation is
    rendered with that template and masked, the first step's loss is the imported model's cross-entropy on the
    assistant's tokens alone (a plain computation from its logits, which differs from the all-token loss), and
    the held-out loss falls. Same mesh, shapes and schedule as the resume run above (its compilations are
    reused)."""
    import jax
    import numpy as np
    from test_chat import FIXTURES as CHAT_FIXTURES
    from test_chat import write_chat
    from test_hf import copy_fixture

    from checkpoints import hf
    from models.transformer import apply
    from train.data import load_dataset
    from train.data.tokenizer import HFTokenizer

    folder = copy_fixture(tmp_path)
    (folder / "tokenizer_config.json").write_bytes((CHAT_FIXTURES / "chatml" / "tokenizer_config.json").read_bytes())
    write_chat(tmp_path / "chat.jsonl", n=30)
    cache, run_dir = tmp_path / "cache", tmp_path / "chat-run"
    args = [
        *common(tmp_path / "chat.jsonl", cache),
        "--init-from",
        str(folder),
        "--mesh",
        "fsdp=8",
        "--steps",
        "3",
        "--decay-steps",
        "5",
    ]
    assert train.main([*args, "--run-dir", str(run_dir)]) == 0
    (manifest,) = [json.loads(p.read_text()) for p in (cache / "prepared").glob("*/manifest.json")]
    assert manifest["loss_mask"] and manifest["chat_template"] == str(folder / "tokenizer_config.json")

    tokenizer = HFTokenizer(folder / "tokenizer.json", hf.eod_token(folder))
    data = load_dataset(
        str(tmp_path / "chat.jsonl"), tokenizer, T, B, seed=0, heldout=0.34, cache_dir=cache, log=lambda _: None
    )
    batch = data.train_rows(0, range(B))  # step 1's batch
    config, graphdef, params, par = load(folder, "fsdp=8")
    forward = jax.jit(lambda p, t, pos, seg: apply(graphdef, p, t, pos, seg, par=par))
    logits = np.asarray(forward(params, batch["tokens"], batch["positions"], batch["segment_ids"]), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    assistant = batch["loss_mask"] > 0
    every = batch["tokens"] != tokenizer.eod_id
    assert 0 < assistant.sum() < 0.7 * every.sum()  # the user's and the template's tokens carry no loss
    masked, unmasked = nll[assistant].mean(), nll[every].mean()
    assert abs(masked - unmasked) > 0.01 * masked  # 100x the tolerance below: it tells the two apart
    losses = metrics(run_dir, "train/loss")
    assert losses[1] == pytest.approx(masked, rel=1e-4)
    held_out = metrics(run_dir, "eval/loss")
    assert sorted(held_out) == [0, 3] and held_out[3] < held_out[0]


def test_init_from_takes_the_tokenizer_and_execution_flags():
    config = cli.parse(
        [
            "--init-from",
            str(FIXTURES / "llama_tied"),
            "--dtype",
            "bfloat16",
            "--set",
            "remat=full",
            "--set",
            "num_layers=2",
        ]
    )
    assert (config.model.dtype, config.model.remat, config.model.tie_embeddings) == ("bfloat16", "full", True)
    assert config.data.tokenizer == str(FIXTURES / "llama_tied" / "tokenizer.json")
    assert config.data.eod_token is not None
    assert config.preset == f"hf:{FIXTURES / 'llama_tied'}"
    other = cli.parse(["--init-from", str(FIXTURES / "llama_tied"), "--tokenizer", "x.json"])
    assert other.data.tokenizer == "x.json"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--set", "num_layers=4"], "--set num_layers=4: conflicts with"),
        (["--model", "test"], "--model test: conflicts with"),
        (["--set", "vocab_size=300"], "vocab_size=264"),
    ],
)
def test_init_from_refuses_a_conflicting_architecture(flags, message, capsys):
    assert train.main(["--init-from", str(FIXTURES / "llama_gqa"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


def test_init_from_a_missing_folder_is_one_line(tmp_path, capsys):
    assert train.main(["--init-from", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no such folder" in err and len(err.splitlines()) == 1


def test_init_from_a_file_is_named_a_file_with_the_folder_it_is_in(capsys):
    """A model's config.json or weights given as --init-from were refused as "no such folder", though they exist;
    the message says it is a file and names the model folder it is in, which is accepted."""
    folder = FIXTURES / "llama_gqa"
    for name in ("config.json", "model.safetensors"):
        assert train.main(["--init-from", str(folder / name), "--dry-run"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"error: {folder / name}: a file, not a folder; give a Hugging Face model folder (config.json and "
            f"*.safetensors), e.g. the one it is in, {folder}"
        )
    assert cli.parse(["--init-from", err.rsplit(", ", 1)[1]]).model.num_layers  # the folder named is accepted


def test_init_from_pickled_weights_is_refused_before_the_data_is_read(tmp_path, capsys):
    from test_hf import copy_fixture

    folder = copy_fixture(tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    cache = tmp_path / "cache"
    argv = [
        "--init-from",
        str(folder),
        "--data",
        "stdlib",
        "--data-cache",
        str(cache),
        "--run-dir",
        str(tmp_path / "r"),
    ]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {folder}: only pickled weights (pytorch_model.bin)") and len(err.splitlines()) == 1
    assert not cache.exists() and not (tmp_path / "r").exists()  # nothing tokenized, nothing written


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """``train.hf import llama_gqa`` onto fsdp=4,tensor=2."""
    from train import hf as hf_cli

    run_dir = tmp_path_factory.mktemp("imported") / "run"
    assert (
        hf_cli.main(["import", str(FIXTURES / "llama_gqa"), "--run-dir", str(run_dir), "--mesh", "fsdp=4,tensor=2"])
        == 0
    )
    return run_dir


def test_export_onto_pipeline_stages_is_refused_as_export_with_a_mesh_that_exports(imported, tmp_path, capsys):
    """train.hf export --mesh stage=2,... was refused for "generation and evaluation"; it names export, and the
    mesh it suggests exports."""
    from train import hf as hf_cli

    argv = ["export", str(imported), "--out", str(tmp_path / "out"), "--cpu-devices", "8"]
    assert hf_cli.main([*argv, "--mesh", "stage=2,fsdp=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --mesh stage=2,fsdp=4: export runs without pipeline stages; e.g. --mesh fsdp=8"
    assert hf_cli.main([*argv, "--mesh", err.rsplit("--mesh ", 1)[1]]) == 0


def test_import_then_export_of_a_run_folder_is_bit_exact(imported, tmp_path):
    import ml_dtypes  # noqa: F401  (bfloat16 for numpy)
    import numpy as np
    from safetensors.numpy import load_file

    from train import hf as hf_cli

    out = tmp_path / "out"
    assert (
        hf_cli.main(
            [
                "export",
                str(imported),
                "--out",
                str(out),
                "--dtype",
                "bfloat16",
                "--mesh",
                "data=2,tensor=4",
                "--max-shard-size",
                "20kB",
            ]
        )
        == 0
    )
    original = load_file(str(FIXTURES / "llama_gqa" / "model.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    exported = {}
    for file in set(index.values()):
        exported.update(load_file(str(out / file)))
    assert sorted(exported) == sorted(original)
    for name, value in original.items():
        assert exported[name].dtype == value.dtype and np.array_equal(exported[name], value), name
    assert (out / "tokenizer.json").read_bytes() == (FIXTURES / "llama_gqa" / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 256
    from tokenizers import Tokenizer

    eos_text = Tokenizer.from_file(str(out / "tokenizer.json")).id_to_token(256)
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_text,
    }
    mask = os.umask(0)
    os.umask(mask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert set(modes.values()) == {0o666 & ~mask}, modes  # safetensors itself writes 0600


def test_import_refuses_a_run_folder_with_checkpoints_and_export_a_missing_run(imported, tmp_path, capsys):
    from train import hf as hf_cli

    assert hf_cli.main(["import", str(FIXTURES / "llama_gqa"), "--run-dir", str(imported)]) == 2
    assert hf_cli.main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert hf_cli.main(["export", str(imported), "--step", "7", "--out", str(tmp_path / "o")]) == 2
    errs = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errs) == 3
    assert "already holds checkpoints" in errs[0] and "no checkpoints/ folder" in errs[1] and "7" in errs[2]
    assert errs[0].endswith("; choose another --run-dir (nothing was overwritten)"), errs[0]  # import has no --resume


def test_generate_and_evaluate_from_a_run_folder_equal_the_hf_folder(imported, small_corpus, tmp_path, capsys):
    from train import evaluate, generate

    common = [
        "--data",
        str(small_corpus),
        "--data-cache",
        str(tmp_path / "cache"),
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--heldout",
        "0.34",
        "--mesh",
        "data=2,tensor=4",
    ]
    assert evaluate.main(["--run-dir", str(imported), "--step", "0", *common]) == 0
    assert evaluate.main(["--hf", str(FIXTURES / "llama_gqa"), *common]) == 0
    prompt = ["--prompt", "def add(", "--max-new-tokens", "6"]
    assert generate.main(["--run-dir", str(imported), *prompt]) == 0
    assert generate.main(["--hf", str(FIXTURES / "llama_gqa"), *prompt]) == 0
    lines = capsys.readouterr().out.splitlines()
    held = [line for line in lines if line.startswith("held-out loss")]
    assert len(held) == 2 and held[0] == held[1]
    texts = [line for line in lines if not line.startswith("held-out loss")]
    assert len(texts) == 2 and texts[0] == texts[1] and texts[0].startswith("def add(")


def test_export_takes_the_run_folder_as_run_or_as_run_dir(tmp_path, capsys):
    """import, generate and evaluate name the run folder --run-dir; export took it only as its first argument
    and refused --run-dir as an unrecognized argument."""
    from train import hf as hf_cli

    missing, out = str(tmp_path / "nope"), str(tmp_path / "o")
    assert hf_cli.main(["export", "--run-dir", missing, "--out", out]) == 2
    assert hf_cli.main(["export", "--out", out]) == 2
    assert hf_cli.main(["export", missing, "--run-dir", str(tmp_path / "other"), "--out", out]) == 2
    errs = capsys.readouterr().err.splitlines()
    assert len(errs) == 3 and f"--run-dir {missing}: no checkpoints/ folder" in errs[0], errs
    assert errs[1:] == [
        f"error: export: {n} run folder{s}; give one, e.g. python -m train.hf export runs/a --out hf/a"
        for n, s in (("no", ""), ("two", "s"))
    ]


def test_a_file_given_for_a_run_or_export_folder_is_named_a_file(tmp_path, capsys):
    """A file as the run folder or as --out was refused as "no checkpoints/ folder" or "not an empty folder"."""
    from train import hf as hf_cli

    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    assert hf_cli.main(["export", str(a_file), "--out", str(tmp_path / "o")]) == 2
    assert hf_cli.main(["export", str(tmp_path / "run"), "--out", str(a_file)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --run-dir {a_file}: a file, not a folder; give a folder written by train.train or train.hf import",
        f"error: --out {a_file}: a file; give a new folder",
    ]
