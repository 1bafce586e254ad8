"""Mixture of experts: the router, dropless grouped products against a dense loop over experts, capacity
drops, expert parallelism against one device, placement of MoE layers, training end to end."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import get_config
from models.moe import MoE, capacity_keep, layer_dispatch, route, router_losses
from models.transformer import Transformer, abstract_model
from sharding import dispatch
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import UNSHARDED, Parallelism
from sharding.rules import get_rules
from train.reports.report import expert_dispatch_of
from train.setup import cli
from train.setup.config import resolve_mesh
from train.setup.flagnames import render

CONFIG = get_config("moe-test")
D = CONFIG.embed_dim


def swiglu(x, gate, up, down):
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def dense_reference(layer: MoE, x):
    """The layer computed plainly in float32: every token through every expert, weighted by its routing."""
    config = layer.config
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ layer.router[...]
    weights, experts, _ = route(logits, config)
    out = jnp.zeros_like(flat)
    for e in range(config.num_experts):
        y = swiglu(flat, layer.gate[...][e], layer.up[...][e], layer.down[...][e])
        combine = jnp.sum(jnp.where(experts == e, weights, 0.0), axis=1)
        out = out + combine[:, None] * y
    if config.shared_experts:
        s = layer.shared
        out = out + swiglu(flat, s.gate[...], s.up[...], s.down[...])
    return out.reshape(x.shape)


@pytest.fixture(scope="module")
def layer_and_input():
    layer = MoE(CONFIG, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 4, D), jnp.float32)
    return layer, x


def test_route_picks_top_k_and_renormalises_by_hand():
    logits = jnp.array([[1.0, 3.0, 2.0, 0.0]])
    config = CONFIG.replace(num_experts=4, experts_per_token=2)
    p = np.exp([1.0, 3.0, 2.0, 0.0]) / np.exp([1.0, 3.0, 2.0, 0.0]).sum()
    weights, experts, probs = route(logits, config)
    np.testing.assert_array_equal(experts, [[1, 2]])
    np.testing.assert_allclose(weights, [[p[1] / (p[1] + p[2]), p[2] / (p[1] + p[2])]], rtol=1e-6)
    weights, _, _ = route(logits, config.replace(norm_topk=False))
    np.testing.assert_allclose(weights, [[p[1], p[2]]], rtol=1e-6)
    s = 1 / (1 + np.exp(-np.array([1.0, 3.0, 2.0, 0.0])))
    weights, experts, probs = route(logits, config.replace(router="sigmoid", routed_scale=2.5))
    np.testing.assert_array_equal(experts, [[1, 2]])
    np.testing.assert_allclose(weights, [[2.5 * s[1] / (s[1] + s[2]), 2.5 * s[2] / (s[1] + s[2])]], rtol=1e-6)
    np.testing.assert_allclose(probs, [s / s.sum()], rtol=1e-6)


def test_router_losses_match_a_hand_computation():
    logits = jnp.array([[2.0, 0.0, 1.0], [0.0, 1.0, 3.0]])
    probs = jax.nn.softmax(logits)
    experts = jnp.array([[0, 2], [2, 1]])
    losses = router_losses(logits, probs, experts, 3)
    fraction = np.array([1, 1, 2]) / 4  # copies routed to experts 0, 1, 2
    mean_prob = np.asarray(probs).mean(axis=0)
    np.testing.assert_allclose(losses["aux"], 3 * np.sum(fraction * mean_prob), rtol=1e-6)
    lse = np.log(np.exp(np.asarray(logits)).sum(axis=1))
    np.testing.assert_allclose(losses["z"], np.mean(lse**2), rtol=1e-6)
    np.testing.assert_array_equal(losses["load"], [1, 1, 2])


def test_max_load_is_the_largest_expert_share_over_the_mean():
    from train.runtime.step import max_load

    balanced = jnp.array([[4.0, 4.0, 4.0, 4.0]])
    assert float(max_load(balanced)) == 1.0
    # layer 1 balanced, layer 2 sends half its copies to expert 0: 8 / mean 4
    assert float(max_load(jnp.array([[4.0, 4.0, 4.0, 4.0], [8.0, 4.0, 2.0, 2.0]]))) == 2.0
    assert float(max_load(jnp.array([[0.0, 0.0, 12.0]]))) == 3.0  # all to one expert: E


def test_dropless_layer_equals_a_dense_loop_over_experts(layer_and_input):
    layer, x = layer_and_input
    graphdef, state = nnx.split(layer)
    out, stats = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, UNSHARDED))(state, x)
    want = jax.jit(lambda state, x: dense_reference(nnx.merge(graphdef, state), x))(state, x)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert float(stats["dropped"]) == 0.0


def test_dropless_gradients_equal_the_dense_loop(layer_and_input):
    layer, x = layer_and_input
    graphdef, state = nnx.split(layer)
    probe = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)

    def loss(state, x, fn):
        return jnp.sum(fn(nnx.merge(graphdef, state), x) * probe)

    got = jax.jit(jax.grad(lambda s, x: loss(s, x, lambda m, x: m(x, UNSHARDED)[0]), argnums=(0, 1)))(state, x)
    want = jax.jit(jax.grad(lambda s, x: loss(s, x, dense_reference), argnums=(0, 1)))(state, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_capacity_drops_the_overflow_and_counts_it():
    experts = jnp.array([[0, 1], [0, 1], [0, 2], [0, 3]])  # expert 0 gets 4 copies
    keep = capacity_keep(experts, 4, 1.0)  # capacity ceil(8 / 4) = 2
    np.testing.assert_array_equal(keep, [[1, 1], [1, 1], [0, 1], [0, 1]])
    layer = MoE(CONFIG.replace(capacity_factor=0.5), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 8, D))
    graphdef, state = nnx.split(layer)
    out, stats = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, UNSHARDED))(state, x)
    _, experts, _ = route(x.reshape(-1, D) @ layer.router[...], layer.config)
    capacity = math.ceil(0.5 * 16 * 2 / 8)
    counts = np.bincount(np.asarray(experts).reshape(-1), minlength=8)
    assert float(stats["dropped"]) == np.sum(np.maximum(counts - capacity, 0)) > 0
    assert out.shape == x.shape and bool(jnp.all(jnp.isfinite(out)))


def _probed_step(graphdef, rows):
    """``(state, x, par) -> ((loss, (y, stats)), (d state, d x))`` of the layer on ``rows`` rows: its outputs
    against a fixed probe plus its router losses, so every output entry and both losses reach the gradients."""
    probe = jnp.cos(jnp.arange(rows * 4 * D, dtype=jnp.float32)).reshape(rows, 4, D)

    def loss(state, x, par):
        y, stats = nnx.merge(graphdef, state)(x, par)
        return jnp.sum(y * probe) + stats["aux"] + stats["z"], (y, stats)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


@pytest.fixture(scope="module")
def one_device_probed(layer_and_input):
    """``rows -> `_probed_step` on one device`` for the first ``rows`` rows, computed once per row count: the
    meshes compared with the same rows share it (its outputs are only read)."""
    layer, x = layer_and_input
    graphdef, state = nnx.split(layer)

    @functools.cache
    def reference(rows):
        step = _probed_step(graphdef, rows)
        return jax.jit(lambda s, x: step(s, x, UNSHARDED))(state, x[:rows])

    return reference


@pytest.mark.parametrize(
    "mesh_spec, rows",
    [
        ("expert=8", 8),
        ("expert=4,fsdp=2", 8),
        ("data=2,expert=2,tensor=2", 8),
        ("expert=4,fsdp=2", 4),
        ("expert=8", 2),
        ("fsdp=8", 2),
    ],
)
def test_expert_parallel_layer_equals_one_device(layer_and_input, one_device_probed, mesh_spec, rows):
    """Outputs, router losses and the gradients of every parameter and of the input equal one device's.
    With fewer rows than the batch axes (evaluation, generation, the layer and `Trainer` APIs) the tokens
    stay whole over the axes that do not divide them: on ``expert=4,fsdp=2`` 4 rows are split over
    ``fsdp`` only and on ``expert=8`` 2 rows over nothing, so each device runs its own experts over all the
    tokens and the partial outputs are summed over ``expert``; on ``fsdp=8`` the experts' weights are
    gathered before the map."""
    layer, x = layer_and_input
    x = x[:rows]
    graphdef, state = nnx.split(layer)
    step = _probed_step(graphdef, rows)
    par = Parallelism.of(make_mesh(parse_mesh(mesh_spec, 8)))
    want = one_device_probed(rows)
    compiled = jax.jit(lambda s, x: step(s, x, par)).lower(state, x).compile()
    got = compiled(state, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    if mesh_spec == "expert=8" and rows == 8:  # the ring: tokens all-gathered over expert, outputs reduce-scattered
        hlo = compiled.as_text()
        assert "all-gather" in hlo and ("reduce-scatter" in hlo or "all-reduce" in hlo)


def per_device_capacity_reference(layer: MoE, x, groups: int):
    """The layer with a capacity computed plainly: one device's tokens (``groups`` equal slices of the
    batch) are one group for the capacity, the router losses over the whole batch."""
    ys, dropped = jax.lax.map(  # one compiled group, run for each
        lambda part: (lambda y, s: (y, s["dropped"]))(*layer(part, UNSHARDED)),
        x.reshape(groups, -1, *x.shape[1:]),
    )
    return ys.reshape(x.shape), dict(layer(x, UNSHARDED)[1], dropped=jnp.sum(dropped))


def test_all_to_all_dispatch_with_a_capacity_equals_one_device_per_group():
    """With a capacity (cf * k = 2 < expert=4) the dispatch is two all-to-alls of fixed buffers (the
    experts' weights gathered over fsdp before them, the batch over fsdp and expert); it drops
    the copies each device's group drops on one device, and its outputs, router losses and gradients
    equal the plain computation."""
    layer = MoE(CONFIG.replace(capacity_factor=1.0), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(4), (8, 8, D), jnp.float32)
    graphdef, state = nnx.split(layer)
    probe = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)

    def loss(state, x, fn):
        y, stats = fn(nnx.merge(graphdef, state), x)
        return jnp.sum(y * probe) + stats["aux"] + stats["z"], (y, stats["dropped"])

    par = Parallelism.of(make_mesh(parse_mesh("expert=4,fsdp=2", 8)))
    want = jax.jit(
        jax.value_and_grad(
            lambda s, x: loss(s, x, lambda m, x: per_device_capacity_reference(m, x, 8)),
            argnums=(0, 1),
            has_aux=True,
        )
    )(state, x)
    step = jax.value_and_grad(lambda s, x: loss(s, x, lambda m, x: m(x, par)), argnums=(0, 1), has_aux=True)
    compiled = jax.jit(step).lower(state, x).compile()
    got = compiled(state, x)
    (_, (_, dropped)), _ = got
    routed = route(x.reshape(8, 8, D) @ layer.router[...], layer.config)[1]
    per_device = [np.bincount(np.asarray(e).reshape(-1), minlength=8) for e in routed]
    assert float(dropped) == sum(np.sum(np.maximum(c - 2, 0)) for c in per_device) > 0  # capacity 2 per group
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert "all-to-all" in compiled.as_text()


@pytest.mark.parametrize(
    "overrides, rows, want",
    [
        ((), 8, dispatch.ALL_TO_ALL),  # cf * k = 2 < expert=4, the batch split over fsdp and expert
        (("batch=data+fsdp",), 8, dispatch.RING),  # rules that keep the tokens whole over expert
        ((), 2, dispatch.RING),  # 2 rows: fsdp=2 splits them, expert does not
    ],
)
def test_layer_dispatch_is_the_one_the_layer_compiles(overrides, rows, want):
    """The record `layer_dispatch` names (what the run report prints) is the one the layer runs: the
    all-to-all in its compiled forward exactly when it says so."""
    config = CONFIG.replace(capacity_factor=1.0)
    par = Parallelism.of(make_mesh(parse_mesh("expert=4,fsdp=2", 8)), get_rules("fsdp_tp", overrides))
    assert layer_dispatch(config, par, (rows, 8)) is want
    assert layer_dispatch(config, UNSHARDED, (rows, 8)) is dispatch.LOCAL
    graphdef, state = nnx.split(MoE(config, rngs=nnx.Rngs(0)))
    x = jnp.ones((rows, 8, D), jnp.float32)
    hlo = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, par)[0]).lower(state, x).compile().as_text()
    assert ("all-to-all" in hlo) == (want is dispatch.ALL_TO_ALL)
    assert "all-gather" in hlo or want is dispatch.ALL_TO_ALL


def test_the_report_prints_the_dispatch_the_run_compiles():
    """The start-up line's dispatch follows the rules and the microbatch (rules keeping the batch whole over
    ``expert`` take the ring, as the layer does) and is local inside pipeline stages, as the cost model
    prices it."""
    base = ["--model", "moe-test", "--batch-size", "16", "--seq-len", "8", "--set"]
    cases = (
        (["capacity_factor=1", "--mesh", "expert=4,fsdp=2"], dispatch.ALL_TO_ALL),
        (["capacity_factor=1", "--mesh", "expert=4,fsdp=2", "--rule", "batch=data+fsdp"], dispatch.RING),
        (["capacity_factor=1", "--mesh", "expert=4,fsdp=2", "--microbatches", "4"], dispatch.RING),  # 4 rows
        (["capacity_factor=0", "--mesh", "stage=2,expert=4"], dispatch.LOCAL),
    )
    for args, want in cases:
        run = resolve_mesh(cli.parse(base + args), 8)
        par = run.parallelism.on(make_mesh(run.parallelism.mesh_shape))
        assert expert_dispatch_of(run, par) is want, args


def test_expert_meshes_split_every_weight_over_all_devices():
    """The weights outside the experts have their embed over fsdp and expert, the experts' weights their
    experts over expert and embed over fsdp: on expert=4,fsdp=2 every device holds 1/8 of moe-test."""
    from sharding.rules import tree_shardings

    mesh = make_mesh(parse_mesh("expert=4,fsdp=2", 8))
    _, abstract, logical = abstract_model(CONFIG)
    shardings, report = tree_shardings(abstract, logical, mesh, Parallelism.of(mesh).rules)
    assert not report.reduced
    held = sum(math.prod(s.shard_shape(a.shape)) for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))
    assert held * 8 == sum(a.size for a in jax.tree.leaves(abstract))
    assert shardings["layers"]["attention"]["q"].spec[1] == ("fsdp", "expert")
    assert tuple(shardings["layers"]["moe"]["gate"].spec)[1:3] == ("expert", "fsdp")


@pytest.mark.parametrize(
    "mesh_spec, counts", [("data=2,fsdp=4", (0, 2, 1, 1, 3, 1, 0, 2)), ("fsdp=2,expert=4", (0, 2, 1, 3, 3, 1, 4, 2))]
)
def test_uneven_counts_give_the_uniform_gradients_and_routing_counts(mesh_spec, counts):
    """Uneven data parallelism (each of the 8 devices its own number of microbatches) of a MoE, on
    ``data=2,fsdp=4`` and with the experts split over ``expert=4`` (each device gathers them once per step
    and runs its own microbatches through all of them): the summed loss and gradients equal the uniform
    step's (on ``expert=4``: the expert-parallel ring), and the router's per-expert counts too (the balancing
    loss is off: it is computed per microbatch, whose grouping the counts change)."""
    from sharding.parallel import Accumulation, UnevenBatch
    from sharding.rules import get_rules
    from train.runtime.optimizer import OptimizerConfig
    from train.runtime.step import Trainer

    rows, seq = 1, 8
    config = CONFIG.replace(router_aux_coef=0.0, num_layers=1, first_dense_layers=0)
    par = Parallelism.of(make_mesh(parse_mesh(mesh_spec, 8)), get_rules("fsdp"), Accumulation(1))
    uniform = Trainer(config, OptimizerConfig(warmup=0, decay_steps=10), par)
    uneven = Trainer(config, uniform.optimizer, par.replace(strategy=UnevenBatch(counts)))
    rng = np.random.default_rng(0)
    b = sum(counts) * rows
    host = {
        "tokens": rng.integers(0, 512, (b, seq)),
        "targets": rng.integers(0, 512, (b, seq)),
        "positions": np.tile(np.arange(seq), (b, 1)),
        "segment_ids": np.ones((b, seq)),
    }
    sharding = uniform.batch_sharding(b, seq)
    batch = {k: jax.device_put(v.astype(np.int32), sharding) for k, v in host.items()}
    batch["loss_mask"] = jax.device_put(np.ones((b, seq), np.float32), sharding)
    params = uniform.init_state(0)["params"]
    got = jax.jit(uneven.gradients)(params, batch)
    want = jax.jit(uniform.gradients)(params, batch)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    assert float(got[1]) == float(want[1])
    for g, w in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]), strict=True):
        np.testing.assert_allclose(np.asarray(g) / float(got[1]), np.asarray(w) / float(want[1]), rtol=1e-5, atol=1e-5)
    assert np.asarray(got[3]["processed"]).tolist() == list(counts)
    for key in ("moe_max_load", "moe_expert_share", "moe_dropped"):
        np.testing.assert_allclose(np.asarray(got[3][key]), np.asarray(want[3][key]), rtol=1e-6)
    assert float(got[3]["moe_aux"]) > 0


PIPELINE_MOE = CONFIG.replace(num_layers=4, first_dense_layers=0, router_aux_coef=1.0, router_z_coef=0.1)
"""An all-MoE model for pipeline stages, its router losses weighted so that they move loss and gradients."""


def _moe_gradients(mesh_spec, strategy=None, pipeline=None):
    """``(loss_sum, weight_sum, grads, metrics)`` of `PIPELINE_MOE`'s step on ``_batch(8, 32)`` (grads in
    canonical layer order; metrics the router statistics)."""
    from test_pipeline_1f1b import _batch

    from sharding import pipeline as pl
    from sharding.rules import get_rules
    from train.runtime.optimizer import OptimizerConfig
    from train.runtime.step import Trainer

    par = Parallelism.of(make_mesh(parse_mesh(mesh_spec, 8)), get_rules("fsdp"), strategy, pipeline=pipeline)
    trainer = Trainer(PIPELINE_MOE, OptimizerConfig(), par)
    loss, weight, grads, metrics = jax.jit(trainer.gradients)(trainer.init_state(0)["params"], _batch(8, 32))
    if trainer.storage is not None:
        layers = jax.tree.map(lambda g: pl.relayout(g, trainer.storage, None, PIPELINE_MOE.num_layers), grads["layers"])
        grads = {**grads, "layers": layers}
    return float(loss), float(weight), grads, metrics


@pytest.fixture(scope="module")
def accumulated_moe():
    """The unpipelined reference: 2 microbatches of gradient accumulation on ``data=8``."""
    from sharding.parallel import Accumulation

    return _moe_gradients("data=8", Accumulation(2))


@pytest.mark.parametrize(
    "mesh_spec, schedule, gather",
    [
        ("stage=2,expert=2,fsdp=2", "1f1b", "once"),
        ("stage=2,fsdp=4", "gpipe", "microbatch"),
        ("stage=2,expert=2,fsdp=2", "zb", "microbatch"),
    ],
)
def test_moe_pipeline_has_the_loss_and_gradients_of_accumulation(accumulated_moe, mesh_spec, schedule, gather):
    """Mixture-of-experts layers inside pipeline stages (uneven split 3,1, 2 microbatches): the summed loss,
    router losses included, and every gradient equal the unpipelined model's with 2 microbatches of gradient
    accumulation. 1F1B on ``stage=2,expert=2,fsdp=2`` (the objective differentiated inside the tick loop,
    experts stored split over ``expert``), GPipe with the weights gathered per microbatch on ``stage=2,fsdp=4``
    (the objective's cotangent from outside the pipeline). The router losses are per microbatch: each
    stage sums its statistics over the devices splitting the microbatch. The step's router metrics (the
    balancing and z-losses, dropped copies, each expert's share of the routed copies) are accumulation's too:
    the stages carry them out of the pipeline beside the objective."""
    from test_pipeline_1f1b import _plan, assert_close

    ref_loss, ref_weight, ref_grads, ref_metrics = accumulated_moe
    plan = _plan(PIPELINE_MOE.num_layers, mesh_spec, (3, 1), 2, schedule, gather=gather)
    loss, weight, grads, metrics = _moe_gradients(mesh_spec, pipeline=plan)
    assert weight == ref_weight
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)
    for key in ("moe_aux", "moe_z", "moe_dropped", "moe_expert_share"):
        np.testing.assert_allclose(np.asarray(metrics[key]), np.asarray(ref_metrics[key]), rtol=1e-5, atol=1e-6)
    assert "moe_max_load" not in metrics  # per layer: the stages sum the layers' loads


def test_placement_of_dense_and_moe_layers():
    config = CONFIG.replace(num_layers=5, first_dense_layers=1, moe_every=2)
    assert config.layer_kinds() == (False, False, True, False, True)
    _, abstract, names = abstract_model(config)
    assert abstract["dense_layers"]["mlp"]["gate"].shape == (3, D, config.mlp_dim)
    assert abstract["layers"]["moe"]["gate"].shape == (2, 8, D, config.expert_dim)
    assert names["layers"]["moe"]["down"] == ("layers", "expert", "mlp", "expert_embed")
    count = sum(math.prod(a.shape) for a in jax.tree.leaves(abstract))
    assert config.num_params == count
    active = config.describe().num_active_params
    assert count - active == 2 * 3 * D * config.expert_dim * (8 - 2)


def test_model_with_interleaved_layers_equals_its_layers_run_in_order():
    """The scan over periods runs layer i of the model in order i, with layer i's parameters."""
    config = CONFIG.replace(num_layers=5, first_dense_layers=1, moe_every=2)
    model = Transformer(config, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (2, 4, D))
    positions = jnp.broadcast_to(jnp.arange(4), (2, 4))
    graphdef, state = nnx.split(model)
    got, stats = jax.jit(
        lambda state, x: nnx.merge(graphdef, state).run_layers_with_stats(x, positions, None, UNSHARDED)
    )(state, x)
    dense_def, dense = nnx.split(model.dense_layers)
    moe_def, moe = nnx.split(model.layers)

    @jax.jit
    def in_order(dense, moe, h):
        aux, counters = [], {False: 0, True: 0}
        for is_moe in config.layer_kinds():
            graphdef, stack = (moe_def, moe) if is_moe else (dense_def, dense)
            block = nnx.merge(graphdef, jax.tree.map(lambda w, i=counters[is_moe]: w[i], stack))
            counters[is_moe] += 1
            h, s = block.forward(h, positions, None, UNSHARDED)
            if s:
                aux.append(s["aux"])
        return h, aux

    h, aux = in_order(dense, moe, x)
    np.testing.assert_allclose(got, h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats["aux"], np.mean(aux), rtol=1e-5)


def test_objective_adds_the_weighted_router_losses():
    config = CONFIG.replace(router_z_coef=1e-3)
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, config.vocab_size)
    mask = jnp.ones((2, 8))
    graphdef, state = nnx.split(model)
    ce, weight, stats = jax.jit(lambda s: nnx.merge(graphdef, s).loss_terms(tokens, tokens, mask, par=UNSHARDED))(state)
    total, _ = jax.jit(lambda s: nnx.merge(graphdef, s).loss_sums(tokens, tokens, mask, par=UNSHARDED))(state)
    want = ce + weight * (config.router_aux_coef * stats["aux"] + 1e-3 * stats["z"])
    np.testing.assert_allclose(total, want, rtol=1e-6)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"experts_per_token": 9}, "--set experts_per_token=9: must be between 1 and num_experts=8"),
        ({"moe_every": 4}, "--set moe_every=4: does not divide"),
        ({"first_dense_layers": 3}, "--set first_dense_layers=3: leaves no mixture-of-experts layer"),
        ({"router": "relu"}, "--set router=relu: choose one of softmax, sigmoid; e.g. --set router=softmax"),
        ({"capacity_factor": -1.0}, "--set capacity_factor=-1.0: must be a finite number >= 0"),
    ],
)
def test_bad_moe_fields_are_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=None) as info:
        CONFIG.replace(**changes)
    assert message in render(info.value)


RUN = ["--seq-len", "16", "--batch-size", "8", "--log-every", "1", "--no-progress", "--eval-batches", "0"]


@pytest.mark.parametrize(
    "mesh_args",
    [
        ["--mesh", "expert=4,fsdp=2"],
        ["--mesh", "stage=2,expert=2,fsdp=2", "--microbatches", "2", "--set", "first_dense_layers=0"],
    ],
    ids=["expert", "pipeline"],
)
def test_a_moe_model_trains_with_expert_parallelism(tmp_path, corpus, cache, mesh_args):
    """Two steps of moe-test through `train.main`, unpipelined and with pipeline stages: the metrics records
    carry the router statistics (under a pipeline too, but for the per-layer ``moe_max_load``)."""
    from train import train

    run_dir = tmp_path / "run"
    args = ["--model", "moe-test", *mesh_args, "--steps", "2", "--eval-every", "0", *RUN]
    code = train.main([*args, "--data", str(corpus), "--data-cache", str(cache), "--run-dir", str(run_dir)])
    assert code == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train_records] == [1, 2]
    pipelined = "stage=2" in mesh_args[1]
    for r in train_records:  # the router statistics: balancing loss near 1 (uniform), nothing dropped
        assert 0.5 < r["train/moe_aux"] < 4.0 and r["train/moe_z"] > 0 and r["train/moe_dropped"] == 0
        share = r["train/moe_expert_share"]  # per expert over all MoE layers: mean 1, at most the busiest layer's
        assert len(share) == 8 and abs(np.mean(share) - 1.0) < 1e-5 and max(share) > 1.0
        if pipelined:
            assert "train/moe_max_load" not in r
        else:
            assert 1.0 <= r["train/moe_max_load"] <= 8.0  # the busiest expert's share over the mean
            assert max(share) <= r["train/moe_max_load"] + 1e-5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "test", "--mesh", "expert=2,fsdp=4"], "expert=2 needs a mixture-of-experts model"),
        (
            ["--model", "moe-test", "--set", "num_experts=6", "--mesh", "expert=4,fsdp=2"],
            "expert=4 does not divide num_experts=6; e.g. --mesh fsdp=4,expert=2",
        ),
        (["--model", "moe-test", "--set", "experts_per_token=9"], "--set experts_per_token=9"),
        (
            ["--model", "moe-test", "--mesh", "stage=2,fsdp=4", "--microbatches", "2"],
            "pipeline stages run a mixture of experts whose every layer is one",
        ),
    ],
)
def test_bad_expert_input_is_refused_before_device_work(tmp_path, args, message, corpus, cache, capsys):
    from train import train

    code = train.main(
        [
            *args,
            *RUN,
            "--steps",
            "2",
            "--data",
            str(corpus),
            "--data-cache",
            str(cache),
            "--run-dir",
            str(tmp_path / "r"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert "Traceback" not in err


MIXTRAL = CONFIG.replace(first_dense_layers=0, shared_experts=0, num_layers=2, mlp_dim=32, moe_mlp_dim=0)


def test_mixtral_export_then_import_is_bit_exact_on_an_expert_mesh(tmp_path):
    """Random parameters written with transformers' MixtralForCausalLM names, read back onto expert=4,fsdp=2."""
    import json

    from checkpoints import hf
    from models.transformer import init_params
    from sharding.rules import tree_shardings

    params = init_params(MIXTRAL, jax.random.key(5))
    files = hf.save_params(tmp_path / "out", MIXTRAL, params, max_shard_size=200_000)
    assert any(f.name == hf.INDEX_FILE for f in files)
    written = json.loads((tmp_path / "out" / hf.CONFIG_FILE).read_text())
    assert written["architectures"] == ["MixtralForCausalLM"] and written["num_local_experts"] == 8
    names = set(json.loads((tmp_path / "out" / hf.INDEX_FILE).read_text())["weight_map"])
    assert "model.layers.1.block_sparse_moe.gate.weight" in names
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight" in names
    assert len(names) == 3 + 2 * (2 + 4 + 1 + 3 * 8)  # embed, norm, head; per layer: norms, attention, router, experts
    config = hf.config_from_hf(written)
    assert config.architecture() == MIXTRAL.replace(router_aux_coef=written["router_aux_loss_coef"]).architecture()
    mesh = make_mesh(parse_mesh("expert=4,fsdp=2", 8))
    _, abstract, logical = abstract_model(config)
    shardings, _ = tree_shardings(abstract, logical, mesh, Parallelism.of(mesh).rules)
    targets = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    again = hf.load_params(tmp_path / "out", config, targets)
    assert again["layers"]["moe"]["gate"].sharding.spec[1] == "expert"
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_a_moe_without_a_hugging_face_family_is_refused():
    from checkpoints import hf

    with pytest.raises(ValueError, match="shared_experts=1: a mixture of experts is exported as MixtralForCausalLM"):
        hf.config_to_hf(CONFIG.replace(first_dense_layers=0))


def test_qwen3_moe_config_round_trip_and_refusals():
    """A MoE with query/key norms is written as Qwen3-MoE, its dense first layers as mlp_only_layers."""
    from checkpoints import hf

    config = CONFIG.replace(qk_norm=True, shared_experts=0, norm_topk=False)
    written = hf.config_to_hf(config)
    assert written["architectures"] == ["Qwen3MoeForCausalLM"] and written["mlp_only_layers"] == [0]
    assert (written["moe_intermediate_size"], written["intermediate_size"]) == (config.expert_dim, config.mlp_dim)
    assert hf.config_from_hf(written).architecture() == config.architecture()
    with pytest.raises(ValueError, match="shared_experts=1: a mixture of experts is exported as Qwen3MoeForCausalLM"):
        hf.config_to_hf(CONFIG.replace(qk_norm=True))
    interleaved = config.replace(num_layers=5, first_dense_layers=1, moe_every=2)
    with pytest.raises(ValueError, match="first_dense_layers=1: .* needs first_dense_layers a multiple of moe_every"):
        hf.config_to_hf(interleaved)
    assert hf.config_from_hf(
        hf.config_to_hf(interleaved.replace(first_dense_layers=2, num_layers=6))
    ).layer_kinds() == (
        False,
        False,
        False,
        True,
        False,
        True,
    )


def test_dry_run_prices_the_expert_dispatch_as_compiled(capsys):
    """The cost model's arguments, collectives (the ring's all-gathers and reduce-scatters, gradients summed
    over the batch axes but not over ``expert`` for expert weights) and temporaries against the compiled
    step. The temporaries hold the ring's gathered copies: each device computes ``E_p * min(k, E / E_p)``
    routed copies per token of its own (8 here, not k = 2), and XLA:CPU's dense grouped products. Main
    priced k copies per token: 5.50 MiB against 20.96 compiled (0.26x), then 11.89 once the ring held only
    the copies its experts can receive. With a memory between the compiled peak (11.93 MiB) and that peak less
    what only XLA:CPU allocates (1.75 MiB), the dry run says the step fits a GPU, not DOES NOT FIT."""
    import re

    from train import train

    args = ["--model", "moe-test", "--mesh", "expert=8", "--batch-size", "64", "--seq-len", "32", "--dry-run"]
    assert train.main(args + ["--device-memory", "11.5MiB"]) == 0
    out = capsys.readouterr().out
    fit = re.search(
        r"fit: fits a GPU by the cost model: the peak compiled here, ([\d.]+) MiB per device, less the ([\d.]+) MiB "
        r"XLA:CPU allocates for itself .*? is ([\d.]+) MiB, within the 11.50 MiB of --device-memory",
        out,
    )
    assert fit, out
    peak, own, gpu = (float(g) for g in fit.groups())
    assert gpu < 11.5 < peak and abs(peak - own - gpu) < 0.011, (peak, own, gpu)
    assert "8 experts (top-2), 1 per device over expert=8; 165,312 active parameters" in out
    block = out[out.index("cost model (sharding.costmodel, cpu lowering) for this run's layout, every device") :]
    rows = {
        m[1]: (m[2], m[3]) for m in re.finditer(r"^  (\S[\w ()+-]*?)\s{2,}([\d.]+ \w+)\s+([\d.]+ \w+)$", block, re.M)
    }
    for label, tolerance in (
        ("arguments (state + batch)", 0.10),
        ("all-gather", 0.10),
        ("all-reduce", 0.10),
        ("reduce-scatter", 0.10),
        ("temporaries", 0.15),
    ):
        predicted, compiled = (float(cell.split()[0]) for cell in rows[label])
        assert abs(predicted - compiled) <= tolerance * compiled, (label, predicted, compiled)


def test_the_cpu_only_temporaries_of_the_ring_by_hand():
    """What the cost model prices as XLA:CPU's own on ``expert=8`` (no compilation): 64 x 32 tokens are 256 per
    device, the ring computes 8 x min(2, 1) = 8 copies of each (2,048 rows), the dense grouped products hold
    float32 ``[1, rows, 3 D + F]`` (D 64, F 32); with bfloat16 each of the 2 MoE layers' saved routed copies
    (a row of D and seven of F) also gets a float32 copy. A GPU's temporaries are the CPU's without them."""
    from sharding import costmodel as cm

    par = Parallelism.of(make_mesh(parse_mesh("expert=8", 8)))
    dense = 2048 * (3 * 64 + 32) * 4
    for dtype, own in (("float32", dense), ("bfloat16", dense + 2 * 2048 * (64 + 7 * 32) * 4)):
        config = CONFIG.replace(dtype=dtype)
        layout = cm.layout_of(par, config)
        cpu, gpu = (cm.estimate(config, 64, 32, layout, backend=b).memory for b in ("cpu", "gpu"))
        assert cpu.cpu_only == pytest.approx(own, rel=1e-12) and gpu.cpu_only == 0.0  # share 2/3 of 3 layers
        assert cpu.in_flight - cpu.cpu_only == pytest.approx(gpu.in_flight, rel=1e-12)
