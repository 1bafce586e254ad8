"""Sequence parallelism beside tensor parallelism (the ``tp_sp`` and ``fsdp_tp_sp`` rules): the compiled step's
collectives per block, and training steps against the flat one-device float32 reference."""

import functools

import jax
import numpy as np
import pytest
from test_pipeline import _batch as pipeline_batch
from test_pipeline_1f1b import assert_close

from models.config import get_config
from models.spec import describe
from sharding import axes as ax
from sharding import hlo
from sharding import pipeline as pl
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Parallelism
from sharding.rules import get_rules
from train.runtime.optimizer import OptimizerConfig
from train.runtime.step import Trainer

LAYERS, BATCH, LENGTH, STEPS = 2, 8, 32, 6


def _config(*overrides):
    return get_config("test", [f"num_layers={LAYERS}", *overrides])


def _optimizer():
    # eps 1e-3: AdamW's first update is about lr * sign(g) with the default eps, which turns float32 rounding
    # of a near-zero gradient entry into a whole step (test_pipeline_1f1b's `_steps_config` says more).
    return OptimizerConfig(eps=1e-3, warmup=0, decay_steps=10)


def _trainer(config, mesh_spec, rules, pipeline=None, devices=None):
    n = 8 if devices is None else len(devices)
    mesh = make_mesh(parse_mesh(mesh_spec, n), devices)
    return Trainer(config, _optimizer(), Parallelism.of(mesh, rules, pipeline=pipeline))


def _steps(trainer, steps=STEPS):
    """Losses of ``steps`` optimizer steps and the parameters after them (canonical layer order)."""
    state = trainer.init_state(0)
    step = trainer.train_step(BATCH, LENGTH)
    losses = []
    for seed in range(steps):
        state, metrics = step(state, pipeline_batch(BATCH, LENGTH, seed, unmasked=0.9), trainer.signals(False))
        losses.append(float(metrics["loss"]))
    params = jax.tree.map(np.asarray, state["params"])
    if trainer.storage is not None:
        params["layers"] = jax.tree.map(
            lambda w: np.asarray(pl.relayout(w, trainer.storage, None, trainer.config.num_layers)), params["layers"]
        )
    return losses, params


@functools.cache
def _reference():
    """The flat model on one device in float32: losses over `STEPS` steps, parameters after them."""
    return _steps(_trainer(_config(), "data=1", "dp", devices=jax.devices()[:1]))


def test_the_sp_presets_split_the_residual_stream_over_tensor_and_nothing_else():
    for base, sp in (("tp", "tp_sp"), ("fsdp_tp", "fsdp_tp_sp")):
        plain, split = get_rules(base), get_rules(sp)
        assert not plain.sequence_parallel and split.sequence_parallel
        assert split.mesh_axes(ax.ACT_LENGTH) == (ax.CONTEXT, ax.SEQUENCE, ax.TENSOR)
        assert plain.mesh_axes(ax.ACT_LENGTH) == plain.mesh_axes(ax.LENGTH) == split.mesh_axes(ax.LENGTH)
        assert {k: v for k, v in split.table if k != ax.ACT_LENGTH} == {
            k: v for k, v in plain.table if k != ax.ACT_LENGTH
        }


@pytest.mark.parametrize(
    "mesh_spec, strategy",
    [
        ("data=4,tensor=2", None),
        ("data=2,tensor=2,stage=2", "1f1b"),
    ],
)
def test_sp_training_steps_match_the_one_device_reference(mesh_spec, strategy):
    """Losses over 6 steps (1e-5 relative) and the parameters after them (1e-5 of each array's largest
    magnitude) equal the one-device float32 run's, on data=4,tensor=2 and on a 1F1B pipeline over
    data=2,tensor=2,stage=2 (one layer per stage, two microbatches)."""
    ref_losses, ref_params = _reference()
    plan = None
    if strategy is not None:
        layout, _ = pl.plan_layout(LAYERS, 2, 1, None)
        plan = pl.PipelinePlan(layout, 2, schedule=strategy)
    trainer = _trainer(_config(), mesh_spec, "tp_sp", plan)
    assert trainer.par.rules.sequence_parallel
    losses, params = _steps(trainer)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_close(params, ref_params)
    assert ref_losses[-1] < ref_losses[0]  # six steps of training, not six evaluations of one state


def _activation_collectives(trainer):
    """``{op: arrays}``: all-gathers and all-reduces of the compiled step whose result is one microbatch's whole
    ``[batch/data, length, embed]`` float32 activations, counted per array (a combined collective's tuple
    holds several) and per execution."""
    text = trainer.compile_train_step(BATCH, LENGTH).as_text()
    whole = f"f32[{BATCH // trainer.par.mesh_shape[ax.DATA]},{LENGTH},{trainer.config.embed_dim}]"
    results = {}
    for line in text.splitlines():
        name, sep, rest = line.strip().removeprefix("ROOT ").partition(" = ")
        if sep:
            results[name.lstrip("%")] = rest.split(" all-")[0]
    counts = {}
    for c in hlo.collectives(text):
        if c.op in ("all-gather", "all-reduce"):
            counts[c.op] = counts.get(c.op, 0) + c.executions * results[c.name].count(whole)
    return counts


def test_sp_turns_each_blocks_all_reduce_into_an_all_gather_and_a_reduce_scatter():
    """On data=4,tensor=2 (2 layers, float32): without sequence parallelism every block ends in an all-reduce
    of its ``[batch/data, length, embed]`` output over tensor, forward and (for its input gradient) backward,
    and nothing is all-gathered. With it each block's input is all-gathered along the length before it
    (forward, and again in the backward pass, the transpose of the reduce-scatter after it): 2 blocks x 2
    passes per layer, plus the loss's input (forward) and the embedding's gradient (backward). XLA's CPU
    backend lowers a reduce-scatter to an all-reduce of the whole array and a slice, so the all-reduces keep
    their count here (a GPU compile shows reduce-scatters, priced as such by the cost model)."""
    config = _config()
    plain = _activation_collectives(_trainer(config, "data=4,tensor=2", "tp"))
    split = _activation_collectives(_trainer(config, "data=4,tensor=2", "tp_sp"))
    per_layer = 2 * 2  # attention and MLP, forward and backward
    assert plain.get("all-gather", 0) == 0
    assert split["all-gather"] == per_layer * LAYERS + 2
    assert split["all-reduce"] == plain["all-reduce"]


def test_a_mixture_of_experts_with_expert_beside_tensor_trains_alike_with_sp():
    """moe-test (a dense layer, then mixtures of experts with a shared expert) on expert=2,tensor=2,data=2:
    with the residual stream split over tensor the experts read their tokens whole along the length (the
    partitioner gathers them before the layer's map) and two steps give the losses and parameters of the same
    mesh without sequence parallelism (1e-5)."""
    config = get_config("moe-test")
    ref_losses, ref_params = _steps(_trainer(config, "data=2,expert=2,tensor=2", "tp"), steps=2)
    losses, params = _steps(_trainer(config, "data=2,expert=2,tensor=2", "tp_sp"), steps=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_close(params, ref_params)


def test_the_cost_model_prices_the_split_residual_stream_as_compiled():
    """What ``remat="dots"`` saves per layer on data=2,tensor=4 with ``tp_sp``, as the compiler allocates it (the
    step's temporaries grow with each layer by its saved activations and its float32 gradient), to the byte:
    512 tokens a device x 416 float32 elements: q (128 / 4 over heads), k and v (128: 2 KV heads stay whole on 4
    devices), gate and up (768 / 4), and the block input and the attention's output projection (256 / 4: the
    residual stream's, split along the length). Without sequence parallelism the same layout prices those two
    whole: 3/4 x 256 x 512 x 4 bytes more per layer."""
    from costmodel_grid import compiled_figures, predicted

    two, four = (("test+num_layers=" + str(n), "data=2,tensor=4", "tp_sp", 16, 64, 1, "dots") for n in (2, 4))
    per_layer = (compiled_figures(four)["temp"] - compiled_figures(two)["temp"]) / 2
    grown = [
        getattr(predicted(four).memory, f) - getattr(predicted(two).memory, f) for f in ("activations", "gradients")
    ]
    assert per_layer == pytest.approx(sum(grown) / 2, rel=1e-3), (per_layer, grown)
    assert grown[0] / 2 == 512 * (128 / 4 + 128 + 768 / 4 + 256 / 4) * 4
    plain = [predicted((case[0], case[1], "tp", *case[3:])).memory.activations for case in (two, four)]
    assert (plain[1] - plain[0]) / 2 - grown[0] / 2 == 512 * 256 * 3 / 4 * 4


def test_the_planner_tries_the_sp_rules_where_tensor_splits_and_prices_them_no_worse():
    """The search's presets for a dense model include ``tp_sp`` and ``fsdp_tp_sp`` on meshes with ``tensor`` > 1
    only (none for a mixture of experts, whose layers' collectives under them are unchecked). Priced for GPUs on
    the 7B at 4,096 tokens on data=2,tensor=4, ``tp_sp`` reduce-scatters 1/4 of the bytes ``tp`` all-reduces for
    its blocks, sends no more over ``tensor`` (ring wire bytes) beside its norms' scale gradients, and holds
    less activation memory."""
    from sharding import costmodel as cm
    from sharding.costmodel.sequence import _SCATTERED
    from sharding.planner import PlanOptions
    from sharding.planner.search import _rules_for

    dense, moe = describe(get_config("7b")), describe(get_config("moe-test"))
    mesh = {a: 1 for a in ax.MESH_AXES}
    options = PlanOptions()
    assert set(_rules_for(dense, {**mesh, ax.DATA: 8}, options)) == {"dp"}
    assert set(_rules_for(dense, {**mesh, ax.DATA: 2, ax.TENSOR: 4}, options)) == {"tp", "tp_sp"}
    assert set(_rules_for(dense, {**mesh, ax.FSDP: 2, ax.TENSOR: 4}, options)) == {"fsdp_tp", "fsdp_tp_sp"}
    assert set(_rules_for(moe, {**mesh, ax.DATA: 2, ax.TENSOR: 4}, options)) == {"tp"}
    layout = {r: cm.Layout({**mesh, ax.DATA: 2, ax.TENSOR: 4}, r, 16, "none") for r in ("tp", "tp_sp")}
    cost = {r: cm.estimate(dense, 64, 4096, layout[r]) for r in layout}
    scattered = sum(c.total_bytes for c in cost["tp"].comms if c.what in _SCATTERED and c.kind == "all-reduce")
    assert scattered > 0 and "reduce-scatter" not in cm.collective_bytes(cost["tp"].comms)
    assert cm.collective_bytes(cost["tp_sp"].comms)["reduce-scatter"] == pytest.approx(scattered / 4)

    def wire(comms):
        return sum(c.wire_bytes() * c.count for c in comms if c.axes == (ax.TENSOR,))

    norms = [c for c in cost["tp_sp"].comms if "norm" in c.what]
    assert norms and wire(cost["tp_sp"].comms) <= wire(cost["tp"].comms) + wire(norms)
    assert cost["tp_sp"].memory.activations < cost["tp"].memory.activations


def test_a_plan_with_sp_renders_as_the_flags_that_rebuild_it():
    """The planner's and the dry run's flags name the preset itself (``--rules tp_sp``), with no ``--rule``
    overrides, also for a pipeline, whose own ``layers -> stage`` the pipeline flags add."""
    from train.setup.flags import rules_flags

    for name in ("tp_sp", "fsdp_tp_sp"):
        assert rules_flags(get_rules(name), False) == (name, [])
        assert rules_flags(pl.pipeline_rules(get_rules(name)), True) == (name, [])
