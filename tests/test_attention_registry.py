"""Every record of the attention registry is consistent: its wrapper computes attention, its traits are
what the cost model charges, and config validation and the flags name every kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli_errors import raises_as_cli

from models import attention_registry as registry
from models.attention import layout_shards
from models.attention_kernels import wrapper
from models.attention_reference import reference_attention
from models.config import ModelConfig, get_config
from models.kernels.cudnn_attention import DTYPES, HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, cudnn_attention
from models.kernels.ring_attention import zigzag_permutation
from sharding import costmodel as cm
from sharding.errors import ConfigError
from sharding.mesh import make_mesh, parse_mesh
from sharding.modeldesc import AttentionTraits
from sharding.parallel import CONTIGUOUS, UNSHARDED, ZIGZAG, Parallelism
from sharding.rules import get_rules

RUN_HERE = [record for record in registry.KERNELS if not record.platforms or "cpu" in record.platforms]
"""The kernels that run on this CPU (cuDNN's needs an NVIDIA GPU: `tests/test_cuda_lowering.py` lowers it)."""
CASES = [(record, layout) for record in RUN_HERE for layout in record.layouts]


def _inputs(length=32, batch=2, heads=8, kv_heads=4, head_dim=16):
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(keys[0], (batch, length, heads, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (batch, length, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (batch, length, kv_heads, head_dim), jnp.float32)
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    segments = jnp.asarray(np.repeat(np.arange(2, dtype=np.int32), length // 2)[None].repeat(batch, 0))
    return q, k, v, d_out, segments.at[1].set(0)


def _close(got, want):
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-5 * float(jnp.max(jnp.abs(want)))


@pytest.mark.parametrize("shape", [(1, 512, 4, 4, 16), (2, 512, 4, 2, 16)])
@pytest.mark.parametrize("name", ["reference", "dot_product"])
def test_the_score_sized_arrays_a_backward_holds_are_what_the_compiler_allocates(name, shape):
    """A record's ``backward_scores`` is what XLA allocates for its backward: the gradient of one attention call
    (its output's cotangent made after the forward, segment ids), whose temporaries are that many float32
    score-sized arrays ``[batch, heads, T, S]`` and, beside them, arrays of ``head_dim / S`` of one (1/32 here)."""
    batch, length, heads, kv_heads, head_dim = shape
    attend = wrapper(registry.kernel(name))
    q = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)
    k = jax.ShapeDtypeStruct((batch, length, kv_heads, head_dim), jnp.float32)
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)

    def loss(q, k, v, weights, ids):
        out = attend(q, k, v, ids, causal=True, layout=CONTIGUOUS, par=UNSHARDED)
        return jnp.sum(jnp.sin(out) * weights)  # the cotangent depends on the output, as in a model

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k, q, ids).compile()
    held = compiled.memory_analysis().temp_size_in_bytes / (batch * heads * length * length * 4)
    assert registry.kernel(name).traits.backward_scores <= held < registry.kernel(name).traits.backward_scores + 0.25


@pytest.mark.parametrize(
    "counts",
    [
        {"materialises_scores": True},  # einsum attention holds at least its probabilities in the backward
        {"materialises_scores": True, "saves_scores": True, "backward_scores": 1},
        {"materialises_scores": False, "backward_scores": 2},
        {"materialises_scores": False, "saves_scores": True},
    ],
)
def test_score_counts_that_do_not_fit_the_kernel_are_refused(counts):
    with pytest.raises(ValueError, match="attention x: backward_scores"):
        AttentionTraits("x", **counts)


def test_cudnn_record_states_what_its_kernel_takes():
    """The record's limits (data, read by config validation) are the kernel's (which checks them itself), and a
    model outside them is refused naming the field and a value that is accepted."""
    record = registry.kernel("cudnn")
    assert record.dtypes == ("bfloat16",) and set(record.dtypes) <= set(DTYPES)
    assert (record.head_dim_multiple, record.max_head_dim) == (HEAD_DIM_MULTIPLE, MAX_HEAD_DIM)
    with pytest.raises(
        ConfigError,
        match="attention=cudnn takes bfloat16 only, not dtype=float32; use attention=flash, or dtype=bfloat16 where",
    ):
        get_config("test", ["attention=cudnn"])
    with pytest.raises(
        ConfigError, match="multiple of 8 and at most 256, not head_dim=36; use attention=flash, or head_dim=40"
    ):
        get_config("test", ["attention=cudnn", "dtype=bfloat16", "head_dim=36"])
    get_config("test", ["attention=cudnn", "dtype=bfloat16", "head_dim=40"])
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="cuDNN attention takes float16 or bfloat16 inputs, got float32"):
        cudnn_attention(q, q, q)


def test_names_are_unique_and_the_defaults_name_a_record():
    assert len(set(registry.names())) == len(registry.KERNELS)
    assert registry.kernel(ModelConfig.attention).name == "reference"
    assert all(CONTIGUOUS in record.layouts for record in registry.KERNELS)  # natural order: every kernel


@pytest.mark.parametrize("record", RUN_HERE, ids=lambda r: r.name)
def test_wrapper_on_one_device_matches_the_reference(record):
    q, k, v, _, segments = _inputs()
    got = wrapper(record)(q, k, v, segments, causal=True, layout=CONTIGUOUS, par=UNSHARDED)
    want = reference_attention(q, k, v, causal=True, q_segment_ids=segments, kv_segment_ids=segments)
    assert got.shape == want.shape and got.dtype == q.dtype
    _close(got, want)


@pytest.mark.parametrize("record, layout", CASES, ids=lambda c: getattr(c, "name", c))
def test_wrapper_under_a_split_length_matches_the_reference_with_gradients(record, layout):
    """On data=2,sequence=2,tensor=2 with the fsdp_tp rules (``length`` over ``sequence``; 4 heads and 2 KV
    heads per tensor shard, which all-to-all attention can split over sequence=2), in every
    layout the record accepts; tokens permuted into the layout and the output back."""
    mesh = make_mesh(parse_mesh("data=2,sequence=2,tensor=2", 8))
    par = Parallelism.of(mesh, get_rules("fsdp_tp"), context_layout=layout)
    q, k, v, d_out, segments = _inputs()
    shards = layout_shards(record.name, par)  # USP deals the zigzag chunks over its ring (here 1 device)
    perm = zigzag_permutation(q.shape[1], shards) if layout == ZIGZAG else np.arange(q.shape[1])
    natural = np.argsort(perm)
    run = wrapper(record)

    def sharded(q, k, v):
        out = run(q[:, perm], k[:, perm], v[:, perm], segments[:, perm], causal=True, layout=layout, par=par)
        return jnp.sum(out[:, natural] * d_out), out[:, natural]

    def reference(q, k, v):
        out = reference_attention(q, k, v, causal=True, q_segment_ids=segments, kv_segment_ids=segments)
        return jnp.sum(out * d_out), out

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    (_, got), got_grads = grad(sharded)
    (_, want), want_grads = grad(reference)
    for a, b in zip((got, *got_grads), (want, *want_grads)):
        _close(a, b)


@pytest.mark.parametrize("record", registry.KERNELS, ids=lambda r: r.name)
def test_cost_model_charges_the_records_traits(record):
    """Score-product FLOPs are ``training_factor`` x the forward's over ``key_fraction`` of the keys, and the
    saved activations grow with the keys a query sees exactly when the kernel materialises the scores."""
    config = get_config("test")
    geometry = config.describe().attention
    layout = cm.Layout({"fsdp": 8}, "fsdp", 1, "none", attention=record.name)
    batch, seq = 16, 64
    cost = cm.estimate(config, batch, seq, layout)
    tokens = batch * seq / 8
    traits = record.traits
    want = tokens * config.num_layers * geometry.forward_flops(seq * traits.key_fraction) * traits.training_factor
    assert cost.flops.attention == pytest.approx(want, rel=1e-12)
    longer = cm.estimate(config, batch // 2, 2 * seq, layout)  # the same tokens, twice the keys per query
    if record.traits.materialises_scores:
        assert longer.memory.activations > cost.memory.activations
    else:
        assert longer.memory.activations == pytest.approx(cost.memory.activations, rel=1e-12)


@pytest.mark.parametrize("record", [r for r in registry.KERNELS if r.traits.splits_length], ids=lambda r: r.name)
def test_cost_model_prices_a_length_splitting_kernel_with_its_exchange(record):
    """Over a split length each kernel moves what its ``context_exchange`` says: a ring's collective-permutes,
    an all-to-all's all-to-alls, USP both (its ring over ``context``, its all-to-all over ``sequence``)."""
    mesh = {"fsdp": 2, "context": 2, "sequence": 2} if record.inner_all_to_all else {"fsdp": 4, "sequence": 2}
    cost = cm.estimate(get_config("test"), 16, 64, cm.Layout(mesh, "fsdp", 1, "none", attention=record.name))
    kinds = {c.kind for c in cost.comms if c.what.startswith("attention:")}
    want = {"ring": {"collective-permute"}, "all_to_all": {"all-to-all"}, "usp": {"collective-permute", "all-to-all"}}
    assert kinds == want[record.traits.context_exchange]


@pytest.mark.parametrize("attention", ["reference", "flash"])
def test_cost_model_refuses_a_context_axis_for_a_kernel_that_needs_the_length_naming_it(attention):
    with pytest.raises(ValueError, match=f"attention '{attention}' over context=2: the cost model prices the context"):
        cm.estimate(get_config("test"), 16, 64, cm.Layout({"fsdp": 4, "context": 2}, "fsdp", attention=attention))


def test_cost_model_refuses_an_attention_the_model_lacks_naming_it():
    with pytest.raises(ValueError, match="attention 'bogus' is not an attention of this model"):
        cm.estimate(get_config("test"), 16, 64, cm.Layout({"fsdp": 8}, attention="bogus"))


def test_description_carries_every_records_traits():
    desc = get_config("test").describe()
    assert desc.attention_kernels == tuple(record.traits for record in registry.KERNELS)
    for record in registry.KERNELS:
        assert desc.attention_kernel(record.name) is record.traits


def test_config_validation_names_every_kernel():
    with raises_as_cli(ValueError, match="--set attention=bogus: choose one of " + ", ".join(registry.names())):
        get_config("test").replace(attention="bogus")


def test_the_flags_offer_every_kernel():
    from train.setup.parser import build_parser

    action = next(a for a in build_parser()._actions if "--attention" in a.option_strings)
    assert tuple(action.choices) == registry.names()
