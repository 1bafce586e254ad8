"""The LM: logical names, parameter count, masking, and sharded forward passes equal to one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli_errors import raises_as_cli
from _codegen import compile_default

from models.attention_reference import attention_mask, reference_attention
from models.config import PRESETS, get_config, parse_overrides
from models.spec import describe
from models.transformer import abstract_model, apply, init_params
from sharding import axes as ax
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import UNSHARDED, Parallelism
from sharding.rules import get_rules, tree_shardings

CONFIG = get_config("test")


@pytest.fixture(scope="module")
def model():
    graphdef, abstract, names = abstract_model(CONFIG)
    params = jax.jit(lambda k: init_params(CONFIG, k))(jax.random.key(0))
    return graphdef, params, names


def make_batch(batch=8, length=32, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CONFIG.vocab_size, (batch, length)).astype(np.int32)
    # Two packed documents per row, split at a random point.
    cut = rng.integers(1, length, batch)
    index = np.arange(length)
    segment_ids = np.where(index[None] < cut[:, None], 1, 2).astype(np.int32)
    positions = np.where(segment_ids == 1, index[None], index[None] - cut[:, None]).astype(np.int32)
    return tokens, positions, segment_ids


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_parameter_has_one_logical_name_per_dimension(preset):
    _, abstract, names = abstract_model(PRESETS[preset])
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    name_leaves = treedef.flatten_up_to(names)
    assert len(leaves) == len(name_leaves) > 0
    for leaf, leaf_names in zip(leaves, name_leaves):
        assert len(leaf_names) == leaf.ndim
        assert all(n in ax.LOGICAL_AXES for n in leaf_names)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_matches_the_formula(preset, tied):
    config = PRESETS[preset].replace(tie_embeddings=tied)
    _, abstract, _ = abstract_model(config)
    assert sum(x.size for x in jax.tree.leaves(abstract)) == config.num_params


def _flat(tree, prefix=()):
    """A nested dict as ``{"a/b/c": leaf}``."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, prefix + (key,)))
        else:
            out["/".join(prefix + (key,))] = value
    return out


@pytest.mark.parametrize("preset, tied", [("test", False), ("small", True), ("7b", False)])
def test_description_lists_the_built_parameters(preset, tied):
    """`models.spec.describe` against the built model: the same paths, shapes and logical names
    (stacked parameters with their leading ``[layers]``)."""
    config = PRESETS[preset].replace(tie_embeddings=tied)
    _, abstract, names = abstract_model(config)
    shapes, axes = _flat(abstract), _flat(names)
    built = {path: (leaf.shape, axes[path]) for path, leaf in shapes.items()}
    layers = config.num_layers
    described = {
        p.path: ((layers,) + p.shape, (ax.LAYERS,) + p.axes) if p.per_layer else (p.shape, p.axes)
        for p in describe(config).params
    }
    assert described == built


def test_7b_preset_is_llama2_sized():
    assert abs(PRESETS["7b"].num_params - 6.74e9) / 6.74e9 < 0.005


def test_set_overrides_are_typed_and_checked():
    assert parse_overrides(["num_layers=8", "tie_embeddings=true", "rope_theta=5e5"]) == {
        "num_layers": 8,
        "tie_embeddings": True,
        "rope_theta": 5e5,
    }
    with pytest.raises(ValueError, match="unknown field 'layers'"):
        parse_overrides(["layers=8"])
    with pytest.raises(ValueError, match="num_heads=4 is not a multiple of num_kv_heads=3"):
        get_config("test", ["num_kv_heads=3"])


def naive_attention(q, k, v, segment_ids):
    b, t, n, h = q.shape
    group = n // k.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        for head in range(n):
            kh = head // group
            for i in range(t):
                allowed = [j for j in range(i + 1) if segment_ids[bi, j] == segment_ids[bi, i]]
                logits = np.array([q[bi, i, head] @ k[bi, j, kh] for j in allowed]) / np.sqrt(h)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[bi, i, head] = sum(pj * v[bi, j, kh] for pj, j in zip(p, allowed))
    return out


def test_reference_attention_matches_a_loop_with_gqa_and_segments():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 9, 4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 9, 2, 8)).astype(np.float32)
    v = rng.standard_normal((2, 9, 2, 8)).astype(np.float32)
    seg = np.array([[1] * 4 + [2] * 5, [1] * 9], np.int32)
    with jax.default_matmul_precision("highest"):
        got = reference_attention(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg)
    np.testing.assert_allclose(np.asarray(got), naive_attention(q, k, v, seg), rtol=1e-5, atol=1e-6)


def _plain_attention(q, k, v, allowed, scale):
    """The textbook formula, differentiated by JAX: einsum, where, softmax, einsum (float32). A query with no
    key gets zeros: its masked row, filled with a finite value, softmaxes to uniform weights, zeroed after."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) * scale
    weights = jax.nn.softmax(jnp.where(allowed[:, None], logits, -1e30), axis=-1)
    weights = weights * allowed.any(-1)[:, None, :, None]
    return jnp.einsum("BNTS,BSNH->BTNH", weights, v)


# (q length, kv length, heads, kv heads, causal, segment ids, a fully masked query row, scale)
_ATTENTION_CASES = {
    "causal": (9, 9, 2, 2, True, False, False, None),
    "causal-gqa-segments": (9, 9, 4, 2, True, True, False, None),
    "masked-row-gqa-scale": (7, 11, 6, 2, False, True, True, 0.3),
    "causal-fewer-keys": (9, 6, 4, 1, True, False, False, None),  # the first 3 queries see no key
}


def _attention_case(name, dtype):
    t, s, n, kv, causal, segments, masked_row, scale = _ATTENTION_CASES[name]
    rng = np.random.default_rng(len(name))
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((2, t, n, 8), (2, s, kv, 8), (2, s, kv, 8)))
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    cotangent = rng.standard_normal((2, t, n, 8)).astype(np.float32)
    kwargs = {"causal": causal, "sm_scale": scale}
    allowed = attention_mask(t, s, causal)
    if segments:
        q_ids = np.where(np.arange(t) < t // 2, 1, 2)[None].repeat(2, 0).astype(np.int32)
        kv_ids = np.where(np.arange(s) < s // 2, 1, 2)[None].repeat(2, 0).astype(np.int32)
        kwargs.update(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
        allowed = attention_mask(t, s, causal, q_ids, kv_ids)
    if masked_row:
        mask = np.ones((2, t, s), bool)
        mask[1, 2] = False  # row 2 of the second sequence attends nothing
        kwargs["mask"] = mask
        allowed = allowed & mask
    return (q, k, v), cotangent, kwargs, jnp.broadcast_to(allowed, (2, t, s)), scale or 8**-0.5


def _grads(attend, inputs, cotangent):
    """The output and the gradients of ``sum(attend(q, k, v) * cotangent)`` in q, k, v, jitted."""
    loss = lambda *x: jnp.sum(attend(*x).astype(jnp.float32) * cotangent)  # noqa: E731
    return jax.jit(lambda *x: (attend(*x), jax.grad(loss, argnums=(0, 1, 2))(*x)))(*inputs)


@pytest.mark.parametrize("name", sorted(_ATTENTION_CASES))
def test_reference_attention_gradients_match_autodiff_of_the_plain_formula(name):
    """The custom backward (probabilities recomputed from the saved log-sum-exp) gives the output and the q, k, v
    gradients of JAX's autodiff through the plain formula, float32, at 1e-5: causal, segment ids, grouped-query
    heads, a query with no key (zeros out, no gradient), a custom scale and fewer keys than queries."""
    inputs, cotangent, kwargs, allowed, scale = _attention_case(name, jnp.float32)
    with jax.default_matmul_precision("highest"):
        out, grads = _grads(lambda q, k, v: reference_attention(q, k, v, **kwargs), inputs, cotangent)
        want_out, want = _grads(lambda q, k, v: _plain_attention(q, k, v, allowed, scale), inputs, cotangent)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    for got, expected, what in zip(grads, want, "qkv"):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5, err_msg=f"d{what}")
    if name.startswith("masked-row"):  # the query with no key: zero output and zero query gradient
        assert not np.any(np.asarray(out)[1, 2]) and not np.any(np.asarray(grads[0])[1, 2])


@pytest.mark.parametrize("name", ["causal-gqa-segments", "masked-row-gqa-scale"])
def test_reference_attention_gradients_in_bfloat16(name):
    """bfloat16 inputs: the gradients come back in bfloat16 and agree with the float32 plain formula on the same
    (bfloat16) values to 1% of the largest (here within 0.6%; autodiff of the plain formula in bfloat16: 0.8%)."""
    inputs, cotangent, kwargs, allowed, scale = _attention_case(name, jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        out, grads = _grads(lambda q, k, v: reference_attention(q, k, v, **kwargs), inputs, cotangent)
        wide = [x.astype(jnp.float32) for x in inputs]
        want_out, want = _grads(lambda q, k, v: _plain_attention(q, k, v, allowed, scale), wide, cotangent)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    for got, expected in zip((out, *grads), (want_out, *want)):
        expected = np.asarray(expected)
        np.testing.assert_allclose(np.asarray(got, np.float32), expected, rtol=0, atol=1e-2 * np.abs(expected).max())


def test_future_tokens_and_other_documents_do_not_leak(model):
    graphdef, params, _ = model
    tokens, positions, segment_ids = make_batch(batch=1, length=24)
    segment_ids[:] = np.where(np.arange(24) < 10, 1, 2)
    positions[:] = np.where(np.arange(24) < 10, np.arange(24), np.arange(24) - 10)
    base = np.asarray(apply(graphdef, params, tokens, positions, segment_ids, par=UNSHARDED))
    changed = tokens.copy()
    changed[0, 5] = (changed[0, 5] + 1) % CONFIG.vocab_size  # inside document 1
    out = np.asarray(apply(graphdef, params, changed, positions, segment_ids, par=UNSHARDED))
    np.testing.assert_array_equal(out[0, :5], base[0, :5])  # causal: earlier positions unchanged
    np.testing.assert_array_equal(out[0, 10:], base[0, 10:])  # document 2 unchanged
    assert np.abs(out[0, 5:10] - base[0, 5:10]).max() > 1e-3  # and the change does reach doc 1


@pytest.mark.parametrize("mesh_spec", ["data=8", "fsdp=8", "fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2"])
def test_sharded_forward_equals_one_device(model, mesh_spec):
    graphdef, params, names = model
    tokens, positions, segment_ids = make_batch()
    reference = np.asarray(jax.jit(lambda p: apply(graphdef, p, tokens, positions, segment_ids, par=UNSHARDED))(params))

    mesh = make_mesh(parse_mesh(mesh_spec, 8))
    rules = get_rules("fsdp_tp")
    shardings, _ = tree_shardings(params, names, mesh, rules)
    sharded_params = jax.device_put(params, shardings)

    @jax.jit
    def forward(p):
        return apply(graphdef, p, tokens, positions, segment_ids, par=Parallelism.of(mesh, rules))

    logits = forward(sharded_params)
    assert len(logits.sharding.device_set) == 8
    scale = np.abs(reference).max()
    np.testing.assert_allclose(np.asarray(logits), reference, rtol=0, atol=1e-5 * scale)


def test_remat_policies_give_the_same_gradients(model):
    _, params, _ = model
    tokens, positions, segment_ids = make_batch(batch=2, length=16)

    def grads(remat):
        graphdef, _, _ = abstract_model(CONFIG.replace(remat=remat))
        loss = lambda p: jnp.mean(apply(graphdef, p, tokens, positions, segment_ids, par=UNSHARDED) ** 2)
        # float32 rounding of a default build: the recomputed and the saved forward round alike there
        return compile_default(jax.grad(loss), params)

    base = grads("none")
    for policy in ("full", "dots"):
        for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(grads(policy))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)


def test_bfloat16_compute_keeps_float32_parameters_and_logits(model):
    _, params, _ = model
    tokens, positions, segment_ids = make_batch(batch=2, length=16)
    graphdef32, _, _ = abstract_model(CONFIG)
    graphdef16, abstract16, _ = abstract_model(CONFIG.replace(dtype="bfloat16"))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(abstract16))
    out32 = np.asarray(apply(graphdef32, params, tokens, positions, segment_ids, par=UNSHARDED))
    out16 = apply(graphdef16, params, tokens, positions, segment_ids, par=UNSHARDED)
    assert out16.dtype == jnp.float32
    assert np.abs(np.asarray(out16) - out32).max() <= 5e-2 * np.abs(out32).max()


@pytest.mark.parametrize(
    "heads, kv_heads, mesh_spec",
    [(4, 2, "fsdp=4,tensor=2"), (4, 2, "fsdp=2,tensor=4"), (4, 1, "data=2,fsdp=2,tensor=2"), (4, 4, "data=8")],
)
def test_flash_attention_in_the_model_matches_reference_with_gradients(heads, kv_heads, mesh_spec):
    config = get_config("test", [f"num_heads={heads}", f"num_kv_heads={kv_heads}", "num_layers=2"])
    graphdef_ref, _, names = abstract_model(config)
    graphdef_flash, _, _ = abstract_model(config.replace(attention="flash"))
    params = jax.jit(lambda k: init_params(config, k))(jax.random.key(1))
    tokens, positions, segment_ids = make_batch(length=40)

    def loss(graphdef, p, par=UNSHARDED):
        return jnp.mean(apply(graphdef, p, tokens, positions, segment_ids, par=par) ** 2)

    want_loss, want_grads = jax.jit(jax.value_and_grad(lambda p: loss(graphdef_ref, p)))(params)
    mesh = make_mesh(parse_mesh(mesh_spec, 8))
    rules = get_rules("fsdp_tp")
    shardings, _ = tree_shardings(params, names, mesh, rules)

    @jax.jit
    def sharded(p):
        return jax.value_and_grad(lambda p: loss(graphdef_flash, p, Parallelism.of(mesh, rules)))(p)

    got_loss, got_grads = sharded(jax.device_put(params, shardings))
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * np.abs(np.asarray(b)).max())


@pytest.mark.parametrize("mesh_spec", ["fsdp=4,tensor=2", "data=8"])
def test_jax_dot_product_attention_in_the_model_matches_reference_with_gradients(mesh_spec):
    """``--attention dot_product`` (jax.nn.dot_product_attention, the GPU baseline) computes the same model."""
    config = get_config("test", ["num_layers=2"])
    graphdef_ref, _, names = abstract_model(config)
    graphdef_jax, _, _ = abstract_model(config.replace(attention="dot_product"))
    params = jax.jit(lambda k: init_params(config, k))(jax.random.key(1))
    tokens, positions, segment_ids = make_batch(length=40)

    def loss(graphdef, p, par=UNSHARDED):
        return jnp.mean(apply(graphdef, p, tokens, positions, segment_ids, par=par) ** 2)

    want_loss, want_grads = jax.jit(jax.value_and_grad(lambda p: loss(graphdef_ref, p)))(params)
    mesh, rules = make_mesh(parse_mesh(mesh_spec, 8)), get_rules("fsdp_tp")
    shardings, _ = tree_shardings(params, names, mesh, rules)

    @jax.jit
    def sharded(p):
        return jax.value_and_grad(lambda p: loss(graphdef_jax, p, Parallelism.of(mesh, rules)))(p)

    got_loss, got_grads = sharded(jax.device_put(params, shardings))
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * np.abs(np.asarray(b)).max())


def test_hugging_face_options_are_settable_and_checked():
    from models.config import config_differences

    config = get_config("test", ["rope_type=llama3", "rope_factor=8", "qkv_bias=true", "head_dim=24"])
    assert (config.rope_type, config.rope_factor, config.qkv_bias, config.head_dim) == ("llama3", 8.0, True, 24)
    _, abstract, _ = abstract_model(config)
    assert sum(x.size for x in jax.tree.leaves(abstract)) == config.num_params
    qwen3 = get_config("test", ["qk_norm=true"])  # query/key norms: two [head_dim] scales per layer
    _, abstract, _ = abstract_model(qwen3)
    assert abstract["layers"]["attention"]["q_norm"].shape == (qwen3.num_layers, qwen3.head_dim)
    assert sum(x.size for x in jax.tree.leaves(abstract)) == qwen3.num_params == CONFIG.num_params + 4 * 2 * 32
    with raises_as_cli(
        ValueError, match="--set rope_type=yarn: choose one of default, llama3; e.g. --set rope_type=default"
    ):
        get_config("test", ["rope_type=yarn"])
    with pytest.raises(ValueError, match="rope_low_freq_factor=4.0 with rope_high_freq_factor=1.0"):
        get_config("test", ["rope_type=llama3", "rope_low_freq_factor=4", "rope_high_freq_factor=1"])
    # metadata saved before these fields existed: missing fields count as their defaults
    old = {k: v for k, v in CONFIG.architecture().items() if not k.startswith("rope_") or k == "rope_theta"}
    old.pop("qkv_bias")
    assert config_differences(old, CONFIG) == {}
    assert config_differences(old, CONFIG.replace(qkv_bias=True)) == {"qkv_bias": (False, True)}


@pytest.mark.parametrize("mesh_spec", ["data=2,fsdp=2,tensor=2", "fsdp=8"])
def test_the_embedding_lookup_moves_rows_or_the_table_never_the_whole_batch(mesh_spec):
    """From a table whose ``embed`` is split over ``fsdp``, with the batch split over ``data`` too, XLA gathered
    the whole batch's activations (and their gradient) on every device and warned of an "involuntary full
    rematerialization"; the lookup reads the table gathered there instead (`sharding.vocab.lookup_gathers_table`),
    and on ``fsdp`` alone still moves the looked-up rows. Values and gradient equal one device's.

    A 520-row table: a program no other test compiles, so it is compiled here (a cached one logs nothing). Alone,
    only the ``tensor`` case reproduces the warning (``data=4,fsdp=2`` and ``data=2,fsdp=4`` show it in the whole
    step: `tests/test_costmodel.py` checks the grid's compilations for it)."""
    from costmodel_grid import xla_log_while
    from flax import nnx

    from models.layers import Embed
    from sharding import hlo

    par = Parallelism.of(make_mesh(parse_mesh(mesh_spec, 8)), get_rules("fsdp_tp"))
    graph, params = nnx.split(Embed(520, 128, rngs=nnx.Rngs(0)))
    table = par.sharding((ax.VOCAB, ax.EMBED), (520, 128))
    tokens = np.random.default_rng(0).integers(0, 520, (8, 16)).astype(np.int32)
    tokens_in = jax.device_put(tokens, par.sharding((ax.BATCH, ax.LENGTH), (8, 16)))

    weight = np.random.default_rng(1).normal(size=(128, 64)).astype(np.float32) / 8

    def loss(params, tokens, par):  # the lookup, then a product with an FSDP weight, as a first layer does
        x = nnx.merge(graph, params)(tokens, jnp.float32, par)
        w = par.constrain(jnp.asarray(weight), (ax.EMBED, ax.MLP))
        return jnp.sum(jnp.sin(jnp.einsum("BTD,DF->BTF", x, w)))

    step = jax.jit(jax.value_and_grad(lambda p, t: loss(p, t, par)))
    sharded = jax.tree.map(lambda x: jax.device_put(x, table), params)
    compiled, log = xla_log_while(lambda: step.lower(sharded, tokens_in).compile())
    assert "rematerialization" not in log, log
    got, grads = compiled(sharded, tokens_in)
    want, want_grads = jax.value_and_grad(lambda p: loss(p, tokens, UNSHARDED))(params)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    gathers = [c.result_bytes for c in hlo.collectives(compiled.as_text()) if c.op == "all-gather"]
    assert 8 * 16 * 128 * 4 not in gathers, gathers  # never the whole batch's looked-up rows (float32)
    if mesh_spec == "fsdp=8":
        assert 520 * 128 * 4 not in gathers, gathers  # the rows move by one all-to-all; the table stays split
