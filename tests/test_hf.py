"""Hugging Face import/export against logits computed by transformers (tests/fixtures/hf, made by its script)."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from _cli_errors import raises_as_cli

from checkpoints import hf
from models.layers import rope_frequencies
from models.transformer import abstract_model, apply
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Parallelism
from sharding.rules import get_rules, tree_shardings

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
DENSE = ("llama_gqa", "llama_tied", "qwen2")
MOE = ("mixtral", "qwen3_moe")
MODELS = DENSE + MOE
MESHES = ("fsdp=8", "fsdp=4,tensor=2", "data=2,tensor=4")
# Three meshes over the two families (each compile costs seconds): expert-parallel with fsdp, with data and
# tensor, and none; tests/test_moe.py checks every expert mesh against one device.
MOE_CASES = (("mixtral", "expert=4,fsdp=2"), ("mixtral", "fsdp=8"), ("qwen3_moe", "data=2,expert=2,tensor=2"))


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
        "llama3",
        500000.0,
        4.0,
        64,
    )
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
@pytest.mark.parametrize("name", DENSE)
def test_imported_logits_equal_transformers(name, mesh_spec):
    config, graphdef, params, par = load(FIXTURES / name, mesh_spec)
    ref = reference(name)
    tokens = ref["tokens"]
    logits = jax.jit(lambda p, t: apply(graphdef, p, t, par=par))(params, tokens)
    # 1e-4 relative to the logits' scale (their largest magnitude, ~8): elementwise ratios of near-zero logits say nothing.
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], rtol=1e-4, atol=1e-4 * np.abs(ref["logits"]).max())


@pytest.mark.parametrize("name, mesh_spec", MOE_CASES)
def test_imported_moe_logits_equal_transformers(name, mesh_spec):
    """Mixtral and Qwen3-MoE (query/key norms, dense and MoE layers alternating, unnormalised top-k weights)
    on meshes with and without expert parallelism. The fixture's two rows are repeated four times so that
    the batch splits over the 8 devices, as the expert layer's per-device dispatch needs."""
    config, graphdef, params, par = load(FIXTURES / name, mesh_spec)
    ref = reference(name)
    tokens = np.tile(ref["tokens"], (4, 1))
    logits = np.asarray(jax.jit(lambda p, t: apply(graphdef, p, t, par=par))(params, tokens))
    scale = np.abs(ref["logits"]).max()
    for rows in np.split(logits, 4):
        np.testing.assert_allclose(rows, ref["logits"], rtol=1e-4, atol=1e-4 * scale)


def test_moe_configs_map_every_field():
    mixtral = hf.config_from_hf(hf.read_hf_config(FIXTURES / "mixtral"))
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.mlp_dim, mixtral.expert_dim) == (4, 2, 48, 48)
    assert mixtral.norm_topk and not mixtral.qk_norm and mixtral.layer_kinds() == (True, True)
    qwen = hf.config_from_hf(hf.read_hf_config(FIXTURES / "qwen3_moe"))
    assert (qwen.num_experts, qwen.experts_per_token, qwen.mlp_dim, qwen.expert_dim) == (6, 2, 64, 16)
    assert qwen.qk_norm and not qwen.norm_topk and not qwen.qkv_bias
    assert qwen.layer_kinds() == (False, True, False, True)  # decoder_sparse_step 2
    dense_first = hf.read_hf_config(FIXTURES / "qwen3_moe") | {"decoder_sparse_step": 1, "mlp_only_layers": [0]}
    assert hf.config_from_hf(dense_first).layer_kinds() == (False, True, True, True)
    odd = hf.read_hf_config(FIXTURES / "qwen3_moe") | {"decoder_sparse_step": 1, "mlp_only_layers": [2]}
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[2\] with decoder_sparse_step=1 places the mixtures"):
        hf.config_from_hf(odd)


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


@pytest.mark.parametrize("name", (*DENSE, "qwen3_moe"))  # Mixtral's: tests/test_moe.py, onto an expert mesh
def test_export_then_import_is_bit_exact(name, tmp_path):
    config, graphdef, params, _ = load(FIXTURES / name, "fsdp=4,tensor=2")
    out = tmp_path / "out"
    # Small files, so the export is sharded with an index.
    files = hf.save_params(
        out, config, params, max_shard_size=20_000, tokenizer=FIXTURES / name / "tokenizer.json", eos_token_id=256
    )
    assert (out / hf.INDEX_FILE) in files and len(list(out.glob("model-*-of-*.safetensors"))) > 1
    again_config, _, again, _ = load(out, "data=2,tensor=4")
    assert again_config == config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", MODELS)
def test_exported_folder_matches_the_fixture(name, tmp_path):
    from safetensors import safe_open

    config, _, params, _ = load(FIXTURES / name)
    out = tmp_path / "out"
    hf.save_params(
        out, config, params, dtype="bfloat16", tokenizer=FIXTURES / name / "tokenizer.json", eos_token_id=256
    )

    def tensors(folder):
        with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
            return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape(), f.get_tensor(k)) for k in f.keys()}

    ours, theirs = tensors(out), tensors(FIXTURES / name)
    assert ours.keys() == theirs.keys()
    for key, (dtype, shape, value) in theirs.items():
        assert ours[key][:2] == (dtype, shape)
        assert np.array_equal(ours[key][2], value), key  # bfloat16 -> float32 -> bfloat16 is exact
    mine, fixture = (json.loads((f / "config.json").read_text()) for f in (out, FIXTURES / name))
    fields = (
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_parameters",
        "eos_token_id",
        "dtype",
    )
    assert {k: mine[k] for k in fields} == {k: fixture[k] for k in fields}
    moe_fields = (
        "num_experts_per_tok",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "moe_intermediate_size",
    )
    assert {k: mine.get(k) for k in moe_fields if k in fixture} == {k: fixture[k] for k in moe_fields if k in fixture}
    # transformers 5 writes num_local_experts for both; Qwen3-MoE's published configs (and our export) say num_experts
    assert mine.get("num_experts", mine.get("num_local_experts")) == fixture.get("num_local_experts")
    assert mine["head_dim"] == (fixture.get("head_dim") or config.embed_dim // config.num_heads)
    assert (out / "tokenizer.json").read_bytes() == (FIXTURES / name / "tokenizer.json").read_bytes()


def copy_fixture(tmp_path, name="llama_gqa"):
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    return folder


def rewrite_tensors(folder, change):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def edit_config(folder, **fields):
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))


def one_line(excinfo):
    return "\n" not in str(excinfo.value)


def test_missing_tensor_names_tensor_and_file(tmp_path):
    folder = copy_fixture(tmp_path)
    rewrite_tensors(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ValueError, match=r"model\.safetensors: tensor model\.layers\.1\.mlp\.up_proj\.weight is missing"
    ) as e:
        load(folder)
    assert one_line(e)


def test_misshapen_tensor_names_tensor_file_and_shapes(tmp_path):
    folder = copy_fixture(tmp_path)
    rewrite_tensors(
        folder, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((20, 32), np.float32)})
    )
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor model\.layers\.0\.self_attn\.k_proj\.weight has "
        r"shape \[20, 32\], config\.json implies \[24, 32\]",
    ) as e:
        load(folder)
    assert one_line(e)


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            r"architectures \['GPT2LMHeadModel'\] not supported; meshwork reads "
            r"LlamaForCausalLM",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
            "rope type 'yarn' is not supported",
        ),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 16}, "sliding_window=16 is in effect"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
    ],
)
def test_unsupported_config_is_refused_naming_the_field(tmp_path, fields, message):
    folder = copy_fixture(tmp_path)
    edit_config(folder, **fields)
    with pytest.raises(ValueError, match=message) as e:
        load(folder)
    assert one_line(e)


def test_qwen2_sliding_window_in_effect_is_refused(tmp_path):
    folder = copy_fixture(tmp_path, "qwen2")
    edit_config(folder, use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match="sliding-window attention is in effect"):
        load(folder)


def test_mistral_without_sliding_window_loads(tmp_path):
    folder = copy_fixture(tmp_path)
    edit_config(folder, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    assert load(folder)[0].rope_type == "llama3"


def test_pickled_weights_only_are_refused_with_why_and_how(tmp_path):
    folder = copy_fixture(tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(
        ValueError,
        match=r"only pickled weights \(pytorch_model\.bin\).*unpickling runs code.*"
        r"save_pretrained\(.*safe_serialization=True\)",
    ) as e:
        load(folder)
    assert one_line(e)


def test_not_a_folder(tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        hf.read_hf_config(tmp_path / "nothing")


def test_export_refuses_a_non_empty_folder_and_unknown_dtype(tmp_path):
    config, _, params, _ = load(FIXTURES / "llama_tied")
    (tmp_path / "x").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        hf.save_params(tmp_path, config, params)
    with raises_as_cli(ValueError, match="--dtype int8: choose one of float32, bfloat16"):
        hf.save_params(tmp_path / "new", config, params, dtype="int8")
