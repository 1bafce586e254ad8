"""Runs with low-rank adapters on an imported model keep the adapters in their checkpoints and the frozen base
by reference to its folder (`checkpoints.meta.RunMeta.base`): what a checkpoint holds, a resume onto another
layout continuing the run as an uninterrupted one does, and a base folder whose weights changed refused."""

import hashlib
import json
import shutil

import jax
import numpy as np
import pytest
from _cli_errors import raises_as_cli
from test_hf import FIXTURES, rewrite_tensors
from test_hf_runs import common, metrics

from checkpoints import peft
from checkpoints.manager import CheckpointManager, check_base
from checkpoints.meta import RunMeta
from models.lora import is_adapter
from sharding.errors import ConfigError
from train import train

ADAPTERS = ["--lora-rank", "2", "--lora-alpha", "4"]


def _run(corpus, cache, base, run_dir, steps, *extra):
    return train.main(
        [
            *common(corpus, cache),
            *ADAPTERS,
            "--init-from",
            str(base),
            "--steps",
            str(steps),
            "--ckpt-every",
            "2",
            "--decay-steps",
            "3",  # the same schedule for the two-step run as for the three-step ones
            "--run-dir",
            str(run_dir),
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two steps of adapters on a copy of llama_gqa (fsdp=8, a checkpoint at step 2), and three steps straight
    from the same start (the uninterrupted reference)."""
    from test_hf_runs import TEXT

    root = tmp_path_factory.mktemp("lora")
    corpus = root / "corpus"
    corpus.mkdir()
    for i, text in enumerate(TEXT):
        (corpus / f"doc{i}.py").write_text(text)
    base = root / "base"
    shutil.copytree(FIXTURES / "llama_gqa", base)
    cache = root / "cache"
    assert _run(corpus, cache, base, root / "two", 2, "--mesh", "fsdp=8") == 0
    assert _run(corpus, cache, base, root / "straight", 3, "--mesh", "fsdp=8") == 0
    return root, corpus, cache, base


def test_the_checkpoint_holds_the_adapters_and_the_base_by_reference(runs):
    root, _, _, base = runs
    manager = CheckpointManager(root / "two" / "checkpoints", read_only=True)
    try:
        meta = RunMeta.from_json(manager.read_meta(2))
        saved = manager.state_metadata(2)
    finally:
        manager.close()
    assert meta.base == {"folder": str(base), "sha256": peft.weights_digest(base)}
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(saved["params"])[0]]
    assert paths and all(is_adapter(p.rsplit("'", 2)[-2]) for p in paths), paths
    assert len(paths) == 2 * 7  # A and B of the seven projections (each a [layers, ...] stack)
    assert "opt_state" in saved and "step" in saved


def test_a_resume_reads_the_base_from_its_folder_and_continues_as_uninterrupted(runs, tmp_path, monkeypatch):
    """Resumed onto a pipeline (stage=2: the adapters' state and the base re-laid into its storage) with the base
    moved to another folder (passed as ``--init-from``): step 3's loss is the uninterrupted run's (1e-4, the
    pipeline's microbatched sums, as tests/test_hf_runs.py compares a pipeline's first step). The base's weights
    are read for their digest once (the new checkpoint's record and the check of the restored one share it)."""
    root, corpus, cache, base = runs
    run_dir, moved = tmp_path / "two", tmp_path / "moved"
    shutil.copytree(root / "two", run_dir)
    shutil.copytree(base, moved)
    hashed, file_digest = [], hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda f, *args: (hashed.append(f.name), file_digest(f, *args))[1])
    assert _run(corpus, cache, moved, run_dir, 3, "--mesh", "stage=2,fsdp=4", "--microbatches", "2", "--resume") == 0
    assert hashed == [str(moved / "model.safetensors")]
    resumed, straight = metrics(run_dir, "train/loss"), metrics(root / "straight", "train/loss")
    assert resumed[3] == pytest.approx(straight[3], rel=1e-4)
    assert resumed[2] == straight[2]  # the first two steps' records, kept
    meta = json.loads((run_dir / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert meta["base"]["folder"] == str(base)


def test_a_base_folder_with_other_weights_is_refused_naming_it(runs, tmp_path, capsys):
    root, corpus, cache, base = runs
    run_dir, other = tmp_path / "two", tmp_path / "other"
    shutil.copytree(root / "two", run_dir)
    shutil.copytree(base, other)
    rewrite_tensors(other, lambda t: t.update({"lm_head.weight": np.zeros_like(t["lm_head.weight"])}))
    capsys.readouterr()
    assert _run(corpus, cache, other, run_dir, 3, "--mesh", "fsdp=8", "--resume") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert err.startswith(
        f"error: the checkpoint of step 2 in {run_dir / 'checkpoints'} keeps only adapters, trained on the base "
        f"model {base} (weights sha256 {peft.weights_digest(base)[:16]}...); {other} holds other weights (sha256 "
        f"{peft.weights_digest(other)[:16]}...): pass --init-from with the folder of the model the run started from"
    ), err


def test_a_missing_base_folder_is_refused_naming_it(runs, tmp_path):
    root, _, _, base = runs
    meta = RunMeta.from_json({"step": 2, "base": {"folder": str(tmp_path / "gone"), "sha256": "0" * 64}})
    with raises_as_cli(
        ConfigError, rf"^the checkpoint .* base model {tmp_path / 'gone'}; .* is not a folder: put .* pass --init-from "
    ):
        check_base(meta, None, root / "two" / "checkpoints")
    assert check_base(
        RunMeta.from_json({"step": 2, "base": {"folder": str(base), "sha256": peft.weights_digest(base)}}), None, "x"
    ) == str(base)


def test_export_reads_the_base_from_its_folder(runs, tmp_path):
    """``train.hf export --merge-lora`` of the run: the tensors without adapters are the base folder's (bf16
    widened, bit for bit), the adapted ones differ from it (the trained factors)."""
    from safetensors.numpy import load_file

    from train import hf as hf_cli

    root, _, _, base = runs
    out = tmp_path / "merged"
    assert (
        hf_cli.main(
            ["export", str(root / "two"), "--cpu-devices", "8", "--mesh", "fsdp=8", "--out", str(out), "--merge-lora"]
        )
        == 0
    )
    got, want = load_file(str(out / "model.safetensors")), load_file(str(base / "model.safetensors"))
    np.testing.assert_array_equal(
        got["model.embed_tokens.weight"], want["model.embed_tokens.weight"].astype(np.float32)
    )
    q = "model.layers.1.self_attn.q_proj.weight"
    assert np.abs(got[q] - want[q].astype(np.float32)).max() > 1e-4
