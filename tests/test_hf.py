"""Hugging Face import/export against logits computed by transformers (tests/fixtures/hf, made by its script)."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from checkpoints import hf
from models.config import get_config
from models.layers import rope_frequencies
from models.transformer import abstract_model, apply
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Parallelism
from sharding.rules import get_rules, tree_shardings

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MODELS = ("llama_gqa", "llama_tied", "qwen2")
MESHES = ("fsdp=8", "fsdp=4,tensor=2", "data=2,tensor=4")


def reference(name):
    return np.load(FIXTURES / name / "reference.npz")


def load(folder, mesh_spec="fsdp=8", rules="fsdp_tp"):
    """(config, graphdef, params, par) with the folder's tensors placed on ``mesh_spec``."""
    config = hf.config_from_hf(hf.read_hf_config(folder))
    mesh = make_mesh(parse_mesh(mesh_spec, jax.device_count()))
    par = Parallelism.of(mesh, get_rules(rules))
    graphdef, abstract, names = abstract_model(config)
    shardings, _ = tree_shardings(abstract, names, mesh, par.rules)
    targets = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return config, graphdef, hf.load_params(folder, config, targets), par


def test_config_mapping_reads_every_option():
    config = hf.config_from_hf(hf.read_hf_config(FIXTURES / "llama_gqa"))
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.embed_dim) == (4, 2, 12, 32)
    assert (config.rope_type, config.rope_theta, config.rope_factor, config.rope_original_max_positions) == (
        "llama3", 500000.0, 4.0, 64)
    assert not config.tie_embeddings and not config.qkv_bias and config.vocab_size == 264
    assert hf.config_from_hf(hf.read_hf_config(FIXTURES / "llama_tied")).tie_embeddings
    assert hf.config_from_hf(hf.read_hf_config(FIXTURES / "qwen2")).qkv_bias


@pytest.mark.parametrize("name", MODELS)
def test_rope_frequencies_equal_transformers(name):
    config = hf.config_from_hf(hf.read_hf_config(FIXTURES / name))
    np.testing.assert_allclose(rope_frequencies(config), reference(name)["inv_freq"], rtol=1e-6, atol=0)


def test_llama3_rope_scaling_changes_the_frequencies():
    config = hf.config_from_hf(hf.read_hf_config(FIXTURES / "llama_gqa"))
    plain = rope_frequencies(config.replace(rope_type="default"))
    scaled = rope_frequencies(config)
    assert scaled[0] == plain[0]  # short wavelengths kept
    assert scaled[-1] == pytest.approx(plain[-1] / 4)  # long ones divided by the factor
    assert not np.allclose(plain, scaled)


@pytest.mark.parametrize("mesh_spec", MESHES)
@pytest.mark.parametrize("name", MODELS)
def test_imported_logits_equal_transformers(name, mesh_spec):
    config, graphdef, params, par = load(FIXTURES / name, mesh_spec)
    ref = reference(name)
    tokens = ref["tokens"]
    logits = jax.jit(lambda p, t: apply(graphdef, p, t, par=par))(params, tokens)
    # 1e-4 relative to the logits' scale (their largest magnitude, ~8): elementwise ratios of near-zero logits say nothing.
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], rtol=1e-4, atol=1e-4 * np.abs(ref["logits"]).max())


def test_imported_arrays_sit_on_their_shardings():
    _, _, params, par = load(FIXTURES / "llama_gqa", "fsdp=4,tensor=2")
    q = params["layers"]["attention"]["q"]  # [L, D, N, H]: embed over fsdp, heads over tensor
    assert q.shape == (2, 32, 4, 12)
    assert q.sharding.spec == par.spec(("layers", "embed", "heads", "head_dim"), q.shape)
    assert {s.data.shape for s in q.addressable_shards} == {(2, 8, 2, 12)}


def test_wrong_rope_layout_is_caught():
    """Interleaved rotary pairs (i with i+1, Meta's original layout) instead of rotate-half: logits differ."""
    config, graphdef, params, par = load(FIXTURES / "llama_gqa")
    ref = reference("llama_gqa")
    h = config.head_dim
    interleave = np.concatenate([np.arange(0, h, 2), np.arange(1, h, 2)])
    wrong = jax.tree.map(lambda x: x, params)
    for name in ("q", "k"):
        wrong["layers"]["attention"][name] = params["layers"]["attention"][name][..., interleave]
    logits = apply(graphdef, wrong, ref["tokens"], par=par)
    assert not np.allclose(np.asarray(logits), ref["logits"], rtol=1e-2, atol=1e-2)
