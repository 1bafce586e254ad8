"""Adapters out to Hugging Face (`checkpoints.peft`, `models.lora.merged`): a PEFT folder has ``peft``'s key
names, shapes and config, and ``W + (lora_alpha / r) * lora_B @ lora_A`` of its tensors (the formula ``peft``
computes) is the merged export's weight; the merged export read back computes the adapted model's logits.

``peft`` itself (and torch) is not installed here. Its formula is checked against its documented key names,
on a dense fixture and a mixture of experts (per-expert modules); and ``peft`` run once on a committed
adapter folder that meshwork wrote (tests/fixtures/hf/llama_gqa_lora, made by
tests/fixtures/hf/make_peft_fixture.py in a throw-away virtualenv) left its logits there, which meshwork's
logits must equal: with the adapters, and from the merged export read back."""

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file
from test_hf import FIXTURES, load, reference

from checkpoints import hf, peft
from models import lora
from models.config import LORA_TARGETS
from models.transformer import abstract_model, apply
from sharding.parallel import UNSHARDED

PEFT_FIXTURE = FIXTURES / "llama_gqa_lora"
"""A PEFT adapter folder meshwork wrote (`write_peft_fixture`) and ``peft``'s logits for it (``reference.npz``)."""
PEFT_RANK, PEFT_ALPHA = 2, 3.0
"""Its rank and alpha: ``alpha / r`` = 1.5, neither 1 nor ``alpha``, so a scaling by either shows."""


def _adapted(name, rank=2, alpha=4.0):
    """``(config, params)``: the fixture's weights with random factors on every projection (both nonzero, drawn
    from a fixed seed: the same values on every run), on the host."""
    base_config, _, params, _ = load(FIXTURES / name, "fsdp=8")
    config = base_config.replace(lora_rank=rank, lora_alpha=alpha, lora_targets=",".join(LORA_TARGETS))
    part = lora.trainable(config, abstract_model(config)[1])
    rng = np.random.default_rng(0)
    drawn = jax.tree.map(lambda a: (0.2 * rng.standard_normal(a.shape)).astype(np.float32), part)
    return config, lora.with_trainable(config, jax.device_get(params), drawn)


@pytest.mark.parametrize("name,modules", [("llama_gqa", 7), ("mixtral", 4 + 3 * 4)])
def test_peft_folder_is_the_merged_weights_by_peft_formula(name, modules, tmp_path):
    config, params = _adapted(name)
    files = peft.save_adapters(tmp_path / "adapters", config, params, "base")
    spec = json.loads(files[0].read_text())
    assert (spec["peft_type"], spec["r"], spec["lora_alpha"], spec["base_model_name_or_path"]) == (
        "LORA",
        2,
        4.0,
        "base",
    )
    tensors = load_file(str(files[1]))
    merged_config, merged = lora.merged(config, params)
    hf.save_params(tmp_path / "merged", merged_config, merged)
    out = load_file(str(tmp_path / "merged" / "model.safetensors"))
    base = load_file(str(FIXTURES / name / "model.safetensors"))
    adapted = 0
    for key, weight in out.items():
        module = peft.PREFIX + key.removesuffix(".weight")
        want = base[key].astype(np.float32)
        if module + ".lora_A.weight" in tensors:
            a, b = tensors[module + ".lora_A.weight"], tensors[module + ".lora_B.weight"]
            assert a.shape == (2, weight.shape[1]) and b.shape == (weight.shape[0], 2)  # [r, in], [out, r]
            want = want + 2.0 * b @ a
            adapted += 1
        np.testing.assert_allclose(weight, want, rtol=0, atol=1e-6)
    assert adapted == modules * config.num_layers and len(tensors) == 2 * adapted
    assert "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight" in tensors


def test_the_merged_export_computes_the_adapted_models_logits(tmp_path):
    config, params = _adapted("llama_gqa")
    merged_config, merged = lora.merged(config, params)
    hf.save_params(tmp_path / "merged", merged_config, merged)
    _, graphdef, again, _ = load(tmp_path / "merged", "fsdp=8")
    tokens = reference("llama_gqa")["tokens"]
    want = jax.jit(lambda p: apply(abstract_model(config)[0], p, tokens, par=UNSHARDED))(params)
    got = jax.jit(lambda p: apply(graphdef, p, tokens, par=UNSHARDED))(jax.device_get(again))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def write_peft_fixture(folder=PEFT_FIXTURE):
    """Writes meshwork's PEFT export of `_adapted` ("llama_gqa", rank `PEFT_RANK`, alpha `PEFT_ALPHA`) to
    ``folder`` (``adapter_config.json``, ``adapter_model.safetensors``), as ``train.hf export`` does; run by
    tests/fixtures/hf/make_peft_fixture.py before ``peft`` computes its logits for it.

    Returns:
      ``(config, params)`` of the adapted model, on the host.
    """
    config, params = _adapted("llama_gqa", PEFT_RANK, PEFT_ALPHA)
    peft.save_adapters(folder, config, params, "tests/fixtures/hf/llama_gqa")
    return config, params


@pytest.fixture(scope="module")
def peft_case(tmp_path_factory):
    """``(config, params, written folder, peft's reference)``: meshwork's adapted model, its adapter folder
    written afresh, and the logits ``peft`` computed from the committed folder."""
    folder = tmp_path_factory.mktemp("adapters")
    config, params = write_peft_fixture(folder)
    return config, params, folder, np.load(PEFT_FIXTURE / "reference.npz")


def _assert_logits_equal(got, want):
    """1e-4 relative to the logits' scale (their largest magnitude), as tests/test_hf.py compares with
    transformers: elementwise ratios of near-zero logits say nothing."""
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_the_committed_adapter_folder_is_meshworks_export(peft_case):
    """``peft``'s logits below are of the committed folder: it must be what meshwork writes today."""
    _, _, folder, _ = peft_case
    assert json.loads((folder / peft.CONFIG_FILE).read_text()) == json.loads(
        (PEFT_FIXTURE / peft.CONFIG_FILE).read_text()
    )
    fresh, committed = load_file(str(folder / peft.WEIGHTS_FILE)), load_file(str(PEFT_FIXTURE / peft.WEIGHTS_FILE))
    assert fresh.keys() == committed.keys()
    for key in fresh:
        np.testing.assert_array_equal(fresh[key], committed[key], err_msg=key)


def test_adapted_logits_equal_peft_loading_meshworks_adapters(peft_case):
    """meshwork's logits with its adapters equal ``PeftModel.from_pretrained(base, folder)``'s (1e-4 of the
    logits' scale), and the adapters matter: the base model's logits are far from them.

    Checked to fail by breaking it once each: with the factors' product scaled by ``alpha`` instead of
    ``alpha / r`` in `models.lora.scale` (this test and the merged one off by 9.0 at worst, on logits of
    scale 7.5); and with ``lora_A``'s input dimensions flattened in the reverse order in
    `checkpoints.peft.adapter_tensors` (the attention output's ``[heads, head_dim]`` head_dim-major) and the
    fixture remade with that export and ``peft``: off by 7.0.
    """
    config, params, _, ref = peft_case
    tokens = ref["tokens"]
    got = jax.jit(lambda p: apply(abstract_model(config)[0], p, tokens, par=UNSHARDED))(params)
    _assert_logits_equal(got, ref["adapted"])
    base = reference("llama_gqa")
    np.testing.assert_array_equal(base["tokens"], tokens)
    assert np.abs(base["logits"] - ref["adapted"]).max() > 100 * 1e-4 * np.abs(ref["adapted"]).max()


def test_merged_export_read_back_equals_peft_merge_and_unload(peft_case, tmp_path):
    """``train.hf export --merge-lora``'s folder (`models.lora.merged`, then `checkpoints.hf.save_params`,
    float32) read back computes ``peft``'s ``merge_and_unload()`` model's logits (1e-4 of their scale)."""
    config, params, _, ref = peft_case
    merged_config, merged = lora.merged(config, params)
    hf.save_params(tmp_path / "merged", merged_config, merged)
    _, graphdef, again, _ = load(tmp_path / "merged", "fsdp=8")
    got = jax.jit(lambda p: apply(graphdef, p, ref["tokens"], par=UNSHARDED))(jax.device_get(again))
    _assert_logits_equal(got, ref["merged"])


def test_a_bfloat16_base_merges_into_a_model_without_adapters():
    """``--merge-lora`` of a run whose base was held in bfloat16: the merged model is a plain one (no adapter
    field left, so it validates: a bfloat16 base without adapters is refused), its weights the float32-base
    merge of the same bfloat16-rounded base."""
    config, params = _adapted("llama_gqa")
    held = config.replace(lora_base_dtype="bfloat16")
    narrow = lora.held_in_dtype(held, params)
    widened = jax.tree.map(lambda x: np.asarray(x, np.float32), narrow)
    merged_config, merged = lora.merged(held, narrow)
    want_config, want = lora.merged(config, widened)
    assert merged_config == want_config and merged_config.lora_base_dtype == "float32"
    jax.tree.map(lambda g, w: np.testing.assert_allclose(np.float32(g), w, rtol=0, atol=1e-6), merged, want)


def test_a_folder_s_weights_digest_is_read_once_until_a_file_changes(tmp_path, monkeypatch):
    """A resume of adapters on a base by reference records the base's digest and checks the restored one's:
    the folder's bytes are read once a process, and again when a file is rewritten (another digest)."""
    import hashlib
    import shutil

    from test_hf import rewrite_tensors

    base = tmp_path / "base"
    shutil.copytree(FIXTURES / "llama_gqa", base)
    hashed, file_digest = [], hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda f, *args: (hashed.append(f.name), file_digest(f, *args))[1])
    first = peft.weights_digest(base)
    assert peft.weights_digest(base) == first and peft.weights_digest(str(base)) == first
    assert hashed == [str(base / "model.safetensors")]
    rewrite_tensors(base, lambda t: t.update({"lm_head.weight": np.zeros_like(t["lm_head.weight"])}))
    assert peft.weights_digest(base) != first and len(hashed) == 2
