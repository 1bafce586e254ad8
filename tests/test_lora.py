"""Low-rank adapters (`models.lora`): with B zero the adapted model is the base model; the train step's adapter
gradients on sharded meshes equal autodiff of the plain formula ``W + (alpha / r) * A @ B`` on one device;
only the factors are trained (no optimizer state for the base, the base unchanged by a step)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli_errors import raises_as_cli

from models import lora
from models.config import get_config
from models.transformer import abstract_model, apply, init_params, loss_sums
from sharding import costmodel as cm
from sharding.errors import ConfigError
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import UNSHARDED, Parallelism
from sharding.rules import get_rules
from train.data import FIELDS
from train.runtime.optimizer import OptimizerConfig
from train.runtime.step import Trainer
from train.setup import cli

ALL = "q,k,v,o,gate,up,down"
SMALL = {"vocab_size": 256, "num_layers": 2, "embed_dim": 64, "mlp_dim": 128, "head_dim": 16}
DENSE = get_config("test", **SMALL).replace(lora_rank=4, lora_alpha=8.0, lora_targets=ALL)
MOE = get_config("moe-test", num_layers=2).replace(lora_rank=2, lora_alpha=4.0, lora_targets="q,o,gate,up,down")


def _base(tree):
    """The tree without its adapter factors."""
    return {k: _base(v) if isinstance(v, dict) else v for k, v in tree.items() if not lora.is_adapter(k)}


def _random_factors(config, params, seed=1):
    """``params`` with every factor drawn at random (B nonzero, so A has a gradient)."""
    part = lora.trainable(config, params)
    leaves, tree = jax.tree.flatten(part)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    drawn = [0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return lora.with_trainable(config, params, tree.unflatten(drawn))


def _plain_merge(tree, factor):
    """``W + factor * A @ B`` written out with `jnp.tensordot` per stacked slice (the test's own formula)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out[key] = _plain_merge(value, factor)
        elif not lora.is_adapter(key):
            a, b = tree.get(key + "_lora_a"), tree.get(key + "_lora_b")
            if a is None:
                out[key] = value
                continue
            stack = b.ndim - (value.ndim - (a.ndim - 1)) - 1  # leading layers (and experts) dimensions
            flat_a = a.reshape(-1, *a.shape[stack:])
            flat_b = b.reshape(-1, *b.shape[stack:])
            delta = jnp.stack([jnp.tensordot(x, y, axes=1) for x, y in zip(flat_a, flat_b)])
            out[key] = value + factor * delta.reshape(value.shape)
    return out


def _batch(config, rows=8, length=16, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, (rows, length + 1)).astype(np.int32)
    mask = (rng.random((rows, length)) > 0.2).astype(np.float32)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
    values = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "loss_mask": mask,
        "positions": positions,
        "segment_ids": np.ones((rows, length), np.int32),
    }
    return {f: jnp.asarray(values[f]) for f in FIELDS}


def test_zero_b_gives_the_base_models_logits():
    params = init_params(DENSE, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, DENSE.vocab_size, (2, 16)), jnp.int32)
    base = DENSE.replace(lora_rank=0, lora_targets="")
    adapted = jax.jit(lambda p: apply(abstract_model(DENSE)[0], p, tokens, par=UNSHARDED))(params)
    plain = jax.jit(lambda p: apply(abstract_model(base)[0], p, tokens, par=UNSHARDED))(_base(params))
    np.testing.assert_array_equal(np.asarray(adapted), np.asarray(plain))


def test_factors_carry_the_weights_logical_names():
    _, _, names = abstract_model(MOE)
    attention, moe = names["layers"]["attention"], names["layers"]["moe"]
    assert attention["q_lora_a"] == ("layers", "embed", "lora_rank")
    assert attention["q_lora_b"] == ("layers", "lora_rank", "heads", "head_dim")
    assert attention["o_lora_a"] == ("layers", "heads", "head_dim", "lora_rank")
    assert moe["gate_lora_a"] == ("layers", "expert", "expert_embed", "lora_rank")
    assert moe["down_lora_b"] == ("layers", "expert", "lora_rank", "expert_embed")
    assert moe["shared"]["up_lora_b"] == ("layers", "lora_rank", "mlp")
    assert "k_lora_a" not in attention  # not a target


_REFERENCE = {}


def _reference_grads(config, params, batch):
    """One device, float32: autodiff of the summed loss through `_plain_merge` of the base model's weights
    (computed once per config: the parametrised meshes share it)."""
    if config in _REFERENCE:
        return _REFERENCE[config]
    base = config.replace(lora_rank=0, lora_targets="")
    graphdef = abstract_model(base)[0]
    inputs = [batch[f] for f in ("tokens", "targets", "loss_mask", "positions", "segment_ids")]

    def loss(part):
        merged = _plain_merge(lora.with_trainable(config, params, part), lora.scale(config))
        total, _ = loss_sums(graphdef, merged, *inputs, par=UNSHARDED)
        return total

    _REFERENCE[config] = jax.jit(jax.grad(loss))(lora.trainable(config, params))
    return _REFERENCE[config]


@pytest.mark.parametrize(
    "config,mesh,rules",
    [(DENSE, "fsdp=8", "fsdp"), (DENSE, "data=2,tensor=4", "fsdp_tp"), (MOE, "expert=4,fsdp=2", "fsdp")],
    ids=["fsdp", "data-tensor", "expert"],
)
def test_adapter_gradients_on_a_mesh_equal_the_plain_formula_on_one_device(config, mesh, rules):
    if config.is_moe:  # dropless routing; no router losses, so the gradient is the cross-entropy's alone
        config = config.replace(router_aux_coef=0.0)
    params = _random_factors(config, init_params(config, jax.random.key(0)))
    batch = _batch(config)
    want = _reference_grads(config, params, batch)
    par = Parallelism.of(make_mesh(parse_mesh(mesh, 8)), get_rules(rules))
    trainer = Trainer(config, OptimizerConfig(decay_steps=8, warmup=1), par)
    placed = jax.device_put(params, trainer.param_shardings)
    sharded = jax.device_put(batch, trainer.batch_sharding(8, 16))
    _, _, grads, _ = jax.jit(lambda p, b: trainer.gradients(p, b))(placed, sharded)
    assert jax.tree.structure(grads) == jax.tree.structure(want)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_a_step_trains_the_factors_alone_and_keeps_no_optimizer_state_for_the_base():
    par = Parallelism.of(make_mesh(parse_mesh("fsdp=8", 8)), get_rules("fsdp"))
    trainer = Trainer(DENSE, OptimizerConfig(decay_steps=8, warmup=1), par)
    state = trainer.init_state(0)
    moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim]
    factors = jax.tree.leaves(lora.trainable(DENSE, state["params"]))
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in factors)  # AdamW's two moments of the factors
    before = jax.tree.map(np.asarray, state["params"])
    batch = jax.device_put(_batch(DENSE), trainer.batch_sharding(8, 16))
    state, metrics = trainer.train_step(8, 16)(state, batch, trainer.signals(False))
    assert bool(metrics["finite"])
    after = jax.tree.map(np.asarray, state["params"])
    for got, ref in zip(jax.tree.leaves(_base(after)), jax.tree.leaves(_base(before))):
        np.testing.assert_array_equal(got, ref)
    b_after = after["layers"]["attention"]["q_lora_b"]
    assert np.abs(b_after).max() > 0  # B left zero: the first step moves it


def test_bad_adapter_fields_are_refused_naming_their_flags():
    with raises_as_cli(ConfigError, r"--lora-targets q,x: a comma-separated list"):
        get_config("test").replace(lora_rank=4, lora_targets="q,x")
    with raises_as_cli(ConfigError, r"--lora-targets q needs adapters of some rank, e.g. --lora-rank 16"):
        get_config("test").replace(lora_targets="q")
    with raises_as_cli(ConfigError, r"--lora-alpha 0.0: must be a finite number > 0"):
        get_config("test").replace(lora_rank=4, lora_alpha=0.0, lora_targets="q")
    width = get_config("test").embed_dim  # a rank past the width used to allocate until memory ran out
    with raises_as_cli(ConfigError, rf"--lora-rank 100000: above the model width {width} .* e.g. --lora-rank 16$"):
        get_config("test").replace(lora_rank=100000, lora_targets="q")
    assert get_config("test").replace(lora_rank=16, lora_targets="q").lora_rank == 16
    assert get_config("test").replace(lora_rank=width, lora_targets="q").lora_rank == width


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe"])
def test_the_parameter_tables_describe_the_built_model_with_its_factors(config):
    """The cost model's parameters (`models.spec`) are the built model's, factors included, as role ``adapter``."""
    built = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(abstract_model(config)[1]))
    assert config.num_params == built
    adapters = [p for p in config.describe().params if p.role == "adapter"]
    factors = jax.tree.leaves(lora.trainable(config, abstract_model(config)[1]))
    assert sum(p.size * p.copies(config.num_layers) for p in adapters) == sum(int(np.prod(a.shape)) for a in factors)


def test_the_cost_model_prices_gradients_and_optimizer_state_for_the_factors_alone():
    """7B with rank-16 adapters on all projections, ``fsdp=8``: parameters held as before plus the factors;
    gradients and AdamW's two moments of the factors only (by hand: each factor split over ``fsdp`` where it
    has ``embed``, whole where not), float32."""
    full_config = get_config("7b")
    config = full_config.replace(lora_rank=16, lora_targets=ALL)
    layout = cm.Layout({"fsdp": 8}, "fsdp", 1, "full")
    full, lora_cost = cm.estimate(full_config, 8, 2048, layout), cm.estimate(config, 8, 2048, layout)
    d, f, n, h, r, layers = 4096, 11008, 32, 128, 16, 32
    split = [d * r] * 5 + [r * d] * 2  # A of q,k,v,gate,up and B of o,down have embed: split over fsdp
    whole = [r * n * h] * 3 + [n * h * r, f * r, r * f, r * f]  # B of q,k,v; A of o,down; B of gate,up
    factors = layers * (sum(split) / 8 + sum(whole)) * 4
    assert lora_cost.memory.parameters == pytest.approx(full.memory.parameters + factors, rel=1e-12)
    assert lora_cost.memory.gradients == pytest.approx(factors, rel=1e-12)
    assert lora_cost.memory.optimizer == pytest.approx(2 * factors, rel=1e-12)


def test_lora_alpha_without_adapters_is_refused_and_its_suggestion_accepted():
    """``--lora-alpha`` alone would be ignored (no adapters to scale): refused naming it, as ``--lora-targets``
    is; the command line it suggests parses, and ``lora_rank`` through ``--set`` counts as adapters."""
    with pytest.raises(
        ValueError, match=r"^--lora-alpha 8.0 needs adapters of some rank, e.g. --lora-rank 16 --lora-alpha 8 "
    ):
        cli.parse(["--model", "test", "--lora-alpha", "8"])
    with pytest.raises(ValueError, match=r"^--lora-alpha -3.0 needs adapters .* --lora-rank 16 --lora-alpha 16 "):
        cli.parse(["--model", "test", "--lora-alpha", "-3"])
    assert cli.parse(["--model", "test", "--lora-rank", "16", "--lora-alpha", "8"]).model.lora_alpha == 8.0
    model = cli.parse(["--model", "test", "--set", "lora_rank=4", "--set", "lora_targets=q", "--lora-alpha", "8"]).model
    assert (model.lora_rank, model.lora_alpha) == (4, 8.0)


def _bf16_case(par):
    """Trainers of `DENSE` with a float32 and a bfloat16 frozen base on ``par``, and one batch on its sharding."""
    out = []
    for dtype in ("float32", "bfloat16"):
        out.append(Trainer(DENSE.replace(lora_base_dtype=dtype), OptimizerConfig(decay_steps=8, warmup=1), par))
    return (*out, jax.device_put(_batch(DENSE), out[0].batch_sharding(8, 16)))


def test_a_bfloat16_base_halves_the_compiled_parameter_bytes_as_priced():
    """``fsdp=8``: the compiled step's arguments (state and batch) shrink by the base's bytes / 2 per device,
    and the cost model prices the parameters' drop the same (its parameters: the base at 2 bytes an element,
    the factors at 4), exactly: both are the shards' sizes."""
    par = Parallelism.of(make_mesh(parse_mesh("fsdp=8", 8)), get_rules("fsdp"))
    f32, bf16, _ = _bf16_case(par)
    params = f32.state_layout.abstract_state()["params"]
    base = jax.tree.leaves(_base(params))
    assert {x.dtype for x in jax.tree.leaves(_base(bf16.state_layout.abstract_state()["params"]))} == {
        jnp.dtype(jnp.bfloat16)
    }
    held = sum(int(np.prod(x.sharding.shard_shape(x.shape))) for x in base) * 4  # float32 base bytes per device
    arguments = [t.compile_train_step(8, 16).memory_analysis().argument_size_in_bytes for t in (f32, bf16)]
    assert arguments[0] - arguments[1] == held // 2
    layout = cm.Layout({"fsdp": 8}, "fsdp", 1, "none")
    priced = [cm.estimate(t.config, 8, 16, layout).memory for t in (f32, bf16)]
    assert priced[0].parameters - priced[1].parameters == pytest.approx(held / 2, rel=1e-12)
    assert (priced[0].gradients, priced[0].optimizer) == (priced[1].gradients, priced[1].optimizer)


def test_a_bfloat16_base_trains_the_adapters_as_the_float32_one():
    """One step on ``fsdp=8`` from the same factors. With the float32 base holding the bfloat16 base's values
    widened, the two compute the same products of the same float32 numbers (each layer widens the weight first):
    loss and adapter gradients equal to 1e-5 (rounding of the fused programs only). With the float32 base's
    own values, the bfloat16 base is that base rounded to 8 significant bits (relative error up to 2^-9 per
    weight), a different model: its loss is within 1e-2 relative of the float32 one and not equal to it."""
    par = Parallelism.of(make_mesh(parse_mesh("fsdp=8", 8)), get_rules("fsdp"))
    f32, bf16, batch = _bf16_case(par)
    state16, state32 = bf16.init_state(0), f32.init_state(0)
    factors = lora.trainable(DENSE, _random_factors(DENSE, state32["params"]))  # B nonzero: A has a gradient
    widened = jax.tree.map(lambda x: x.astype(jnp.float32), _base(state16["params"]))
    fresh = f32.init_state(0)  # its own arrays: each step below donates the state it is given
    same = {**fresh, "params": lora.with_trainable(DENSE, widened, factors)}
    state16 = {**state16, "params": lora.with_trainable(DENSE, state16["params"], jax.tree.map(jnp.copy, factors))}
    state32 = {**state32, "params": lora.with_trainable(DENSE, state32["params"], jax.tree.map(jnp.copy, factors))}
    start = jax.tree.map(np.asarray, lora.trainable(DENSE, state16["params"]))
    after16, m16 = bf16.train_step(8, 16)(state16, batch, bf16.signals(False))
    after_same, m_same = f32.train_step(8, 16)(same, batch, f32.signals(False))
    _, m32 = f32.train_step(8, 16)(state32, batch, f32.signals(False))
    assert float(m16["loss"]) == pytest.approx(float(m_same["loss"]), rel=1e-5)
    assert float(m16["grad_norm"]) == pytest.approx(float(m_same["grad_norm"]), rel=1e-5)
    moved = jax.tree.map(np.asarray, lora.trainable(DENSE, after16["params"]))
    for got, want, before in zip(
        jax.tree.leaves(moved), jax.tree.leaves(lora.trainable(DENSE, after_same["params"])), jax.tree.leaves(start)
    ):
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)
        assert np.abs(got - before).max() > 0  # every factor got a gradient and moved
    assert float(m16["loss"]) == pytest.approx(float(m32["loss"]), rel=1e-2) and float(m16["loss"]) != float(
        m32["loss"]
    )


def test_a_bfloat16_base_without_adapters_is_refused_naming_the_flag():
    with raises_as_cli(ConfigError, r"^--lora-base-dtype bfloat16 needs adapters .*; add --lora-rank 16$"):
        get_config("test").replace(lora_base_dtype="bfloat16")
    held = get_config("test").replace(lora_rank=16, lora_targets="q", lora_base_dtype="bfloat16")
    assert held.lora_base_dtype == "bfloat16"
