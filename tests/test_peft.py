"""Adapters out to Hugging Face (`checkpoints.peft`, `models.lora.merged`): a PEFT folder has ``peft``'s key
names, shapes and config, and ``W + (lora_alpha / r) * lora_B @ lora_A`` of its tensors (the formula ``peft``
computes) is the merged export's weight; the merged export read back computes the adapted model's logits.

``peft`` itself (and torch) is not installed here: the format is checked against its documented key names
and formula, on a dense fixture and a mixture of experts (per-expert modules)."""

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


def _adapted(name, rank=2, alpha=4.0):
    """``(config, params)``: the fixture's weights with random factors on every projection, on the host."""
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
