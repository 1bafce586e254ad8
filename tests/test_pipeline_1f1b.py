"""The 1F1B pipeline schedules, lockstep and fused: their tick tables, equality with the unpipelined stack and
model, memory against GPipe, and no transfer inside a conditional."""

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cached import cached
from _cli_errors import raises_as_cli
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_pipeline import _batch as pipeline_batch

from sharding import pipeline as pl
from sharding.hlo import branch_collectives
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import UNSHARDED, Parallelism
from sharding.pipeline.layout import BACKWARD, FORWARD
from sharding.pipeline.onef1b import run_pipeline_loss
from sharding.rules import get_rules
from train.setup.flagnames import render

RULES = get_rules("fsdp_tp")
ONE_F_ONE_B = ("1f1b", "1f1b-fused", "zb")
"""The schedules run by `run_pipeline_loss`'s tick loop (the loss inside the pipeline)."""


def assert_close(actual, expected, rtol=1e-5):
    """float32 agreement to ``rtol`` of each array's largest magnitude (entries near zero included)."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * float(np.max(np.abs(e)) or 1.0))


# The tick table (no devices) ----------------------------------------------------------------


@pytest.mark.parametrize(
    "stages, microbatches, repeats", [(2, 2, 1), (4, 4, 1), (4, 8, 1), (4, 16, 1), (3, 7, 1), (4, 8, 2), (2, 4, 3)]
)
def test_the_tick_table_is_a_valid_1f1b_schedule(stages, microbatches, repeats):
    ticks = pl.one_f_one_b_ticks(stages, microbatches, repeats)
    last = stages * repeats - 1
    when = {}
    for t in range(ticks.ticks):
        for s in range(stages):
            op, r, i = ticks.op[t, s], ticks.chunk[t, s], ticks.microbatch[t, s]
            if op:
                key = (int(op), int(r) * stages + s, int(i))
                assert key not in when
                when[key] = t
    assert len(when) == 2 * stages * repeats * microbatches  # every (virtual stage, microbatch), both ways
    for i in range(microbatches):
        for v in range(last + 1):
            if v:  # the input left the previous virtual stage at an earlier tick
                assert when[FORWARD, v, i] > when[FORWARD, v - 1, i]
            if v < last:  # the cotangent left the next virtual stage at an earlier tick
                assert when[BACKWARD, v, i] > when[BACKWARD, v + 1, i]
        assert when[BACKWARD, last, i] > when[FORWARD, last, i]
    # slots: no two chunk inputs (cotangents) held at once by a stage share one
    for s in range(stages):
        held, waiting = {}, {}
        for t in range(ticks.ticks):
            for table, slots in ((ticks.arrive, held), (ticks.cotangent_arrive, waiting)):
                if table[t, s] >= 0:
                    assert table[t, s] not in slots
                    slots[int(table[t, s])] = t
            op, slot, c = ticks.op[t, s], int(ticks.slot[t, s]), int(ticks.cotangent_slot[t, s])
            v = int(ticks.chunk[t, s]) * stages + s
            if op == FORWARD:
                assert (slot in held) == (v > 0)
                held[slot] = t
                if v == last:
                    assert c not in waiting
                    waiting[c] = t
            if op == BACKWARD:
                assert held.pop(slot) < t and waiting.pop(c) <= t  # a cotangent may arrive at the start of its tick
    if repeats == 1:
        assert ticks.ticks == 2 * (microbatches + stages - 1)
        live = ticks.live()
        assert live.max() == stages == ticks.slots and live.tolist() == [stages] + [
            stages - s + 1 for s in range(1, stages)
        ]
        # stage s runs S - s forwards before its first backward, then alternates until its forwards run out
        for s in range(stages):
            ops = [op for op in ticks.op[:, s] if op]
            assert ops.index(BACKWARD) == stages - s
            steady = ops[stages - s : -(stages - s)]
            assert all(a != b for a, b in zip(steady, steady[1:]))


def test_interleaved_1f1b_needs_a_multiple_of_the_stages_as_microbatches():
    with raises_as_cli(ValueError, match="--microbatches 6: interleaved 1F1B .* e.g. --microbatches 8"):
        pl.one_f_one_b_ticks(4, 6, 2)


@pytest.mark.parametrize(
    "stages, microbatches, repeats", [(2, 2, 1), (2, 8, 1), (4, 4, 1), (4, 16, 1), (3, 7, 1), (4, 8, 2), (2, 4, 3)]
)
def test_the_fused_tick_table_runs_a_forward_and_a_backward_per_tick_in_dependency_order(stages, microbatches, repeats):
    """Every (virtual stage, microbatch) once each way, after what it needs; ``R*M + (R+1) S - 2`` ticks
    (``M + 2 (S - 1)`` with one chunk, against lockstep's ``2 (M + S - 1)``); stage ``s`` holds at most
    ``(R+1) S - 1 - 2s`` chunk inputs, and the ring slots the table assigns are never shared."""
    from sharding.pipeline.ticks import fused_held_bound, fused_tick_count, fused_ticks

    ticks = fused_ticks(stages, microbatches, repeats)
    last = stages * repeats - 1
    assert (
        ticks.ticks
        == fused_tick_count(stages, microbatches, repeats)
        == repeats * microbatches + (repeats + 1) * stages - 2
    )
    if repeats == 1:
        assert ticks.ticks == microbatches + 2 * (stages - 1) < pl.one_f_one_b_ticks(stages, microbatches).ticks
    when = {}
    for t in range(ticks.ticks):
        for s in range(stages):
            for op, on, chunk, mb in (
                (FORWARD, ticks.forward, ticks.forward_chunk, ticks.forward_microbatch),
                (BACKWARD, ticks.backward, ticks.backward_chunk, ticks.backward_microbatch),
            ):
                if on[t, s]:
                    key = (op, int(chunk[t, s]) * stages + s, int(mb[t, s]))
                    assert key not in when
                    when[key] = t
    assert len(when) == 2 * stages * repeats * microbatches
    for i in range(microbatches):
        for v in range(last + 1):
            if v:
                assert when[FORWARD, v, i] > when[FORWARD, v - 1, i]
            if v < last:
                assert when[BACKWARD, v, i] > when[BACKWARD, v + 1, i]
        assert when[BACKWARD, last, i] >= when[FORWARD, last, i]  # the head's cotangent within the tick
    # steady state: some tick runs a forward and a backward on every stage
    assert any(ticks.forward[t].all() and ticks.backward[t].all() for t in range(ticks.ticks)) == (
        repeats * microbatches >= 2 * stages - 1
    )
    bounds = [fused_held_bound(stages, microbatches, repeats, s) for s in range(stages)]
    assert ticks.live().tolist() == bounds
    assert bounds == [min(repeats * microbatches, (repeats + 1) * stages - 1 - 2 * s) for s in range(stages)]
    assert ticks.slots == max(bounds)
    for s in range(stages):
        held, waiting = {}, {}
        for t in range(ticks.ticks):
            for table, slots in ((ticks.arrive, held), (ticks.cotangent_arrive, waiting)):
                if table[t, s] >= 0:
                    assert table[t, s] not in slots
                    slots[int(table[t, s])] = t
            if ticks.forward[t, s]:
                v = int(ticks.forward_chunk[t, s]) * stages + s
                slot = int(ticks.forward_slot[t, s])
                assert (slot in held) == (v > 0)
                held[slot] = t
                if v == last:
                    c = int(ticks.loss_slot[t, s])
                    assert c not in waiting
                    waiting[c] = t
            if ticks.backward[t, s]:
                slot, c = int(ticks.backward_slot[t, s]), int(ticks.cotangent_slot[t, s])
                assert held.pop(slot) <= t and waiting.pop(c) <= t
        assert not held and not waiting


# The toy stack ----------------------------------------------------------------------------------


def _toy_layer(par, w, h, position):
    h = jnp.tanh(h @ w["a"] + w["b"] + 0.01 * position[:, None])
    return par.constrain(h, ("batch", "act_embed"))


def _toy_head(par, hp, h, target, mask):
    """A small head with parameters: ``sum(mask * ((h @ v) - target)^2)`` and ``sum(mask)``."""
    y = h @ hp["v"] + hp["c"]
    return jnp.sum(mask[:, None] * (y - target[:, None]) ** 2), jnp.sum(mask)


def _toy(
    mesh_spec,
    num_layers,
    stage_layers,
    microbatches,
    batch=16,
    dim=16,
    schedule="1f1b",
    skip_empty=True,
    repeats=1,
    gather="once",
):
    mesh = make_mesh(parse_mesh(mesh_spec, 8))
    rules = pl.pipeline_rules(RULES)
    layout, _ = pl.plan_layout(num_layers, mesh.shape["stage"], repeats, stage_layers)
    plan = pl.PipelinePlan(
        layout,
        microbatches,
        skip_empty=skip_empty,
        schedule=schedule,
        gather=gather,
    )
    (w, hp, x, position, target, mask), (ref_loss, ref_weight), ref_grads = _toy_reference(num_layers, batch, dim)

    def pipelined(w, hp, x):
        loss, weight, applied = run_pipeline_loss(
            _toy_layer,
            _toy_head,
            w,
            hp,
            x,
            (position,),
            (target, mask),
            Parallelism.of(mesh, rules, pipeline=plan),
            names={"a": ("layers", None, "embed"), "b": ("layers", None)},
            head_names={"v": ("embed", None), "c": (None,)},
        )
        return loss, (weight, applied)

    staged = jax.tree.map(lambda a: pl.relayout(jnp.asarray(a), None, layout, num_layers), w)
    staged = jax.device_put(
        staged, {"a": NamedSharding(mesh, P("stage", None, "fsdp")), "b": NamedSharding(mesh, P("stage"))}
    )
    hp_dev = jax.device_put(hp, {"v": NamedSharding(mesh, P("fsdp")), "c": NamedSharding(mesh, P())})
    grad_fn = jax.jit(jax.value_and_grad(pipelined, argnums=(0, 1, 2), has_aux=True))
    (loss, (weight, applied)), grads = grad_fn(staged, hp_dev, x)
    forward_only = jax.jit(pipelined)(staged, hp_dev, x)
    grads = (jax.tree.map(lambda g: pl.relayout(g, layout, None, num_layers), grads[0]), *grads[1:])
    return (
        plan,
        (loss, weight, grads, applied, forward_only),
        (ref_loss, ref_weight, ref_grads),
        grad_fn,
        (staged, hp_dev, x),
    )


@functools.cache
def _toy_reference(num_layers, batch, dim):
    """The toy's inputs (float32 from seed 0: weights ``{"a": [layers, dim, dim], "b": [layers, dim]}``, head
    ``{"v": [dim, 3], "c": [3]}``, ``x`` [batch, dim], positions, targets and mask [batch]) and the sequential
    stack's ``(loss, weight)`` and gradients on one device: they depend on the sizes only, so every schedule,
    mesh and split of those sizes compares with one computation."""
    rng = np.random.default_rng(0)
    w = {
        "a": rng.normal(size=(num_layers, dim, dim)).astype(np.float32) / 4,
        "b": rng.normal(size=(num_layers, dim)).astype(np.float32),
    }
    hp = {"v": rng.normal(size=(dim, 3)).astype(np.float32), "c": rng.normal(size=(3,)).astype(np.float32)}
    x = rng.normal(size=(batch, dim)).astype(np.float32)
    position = jnp.asarray(rng.integers(0, 9, size=(batch,)), jnp.int32)
    target = jnp.asarray(rng.normal(size=(batch,)), jnp.float32)
    mask = jnp.asarray(rng.random(batch) < 0.8, jnp.float32)

    def reference(w, hp, x):
        h = x
        for layer in range(num_layers):
            h = _toy_layer(UNSHARDED, jax.tree.map(lambda a: a[layer], w), h, position)
        return _toy_head(UNSHARDED, hp, h, target, mask)

    grad = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2), has_aux=True))
    return (w, hp, x, position, target, mask), *grad(w, hp, x)


@pytest.mark.parametrize(
    "mesh_spec, num_layers, stage_layers, microbatches, repeats",
    [
        ("stage=2,fsdp=4", 4, (3, 1), 2, 1),  # uneven, M = S
        ("stage=4,fsdp=2", 12, (5, 3, 2, 2), 8, 1),  # uneven, 4 stages, M = 2S
        ("stage=4,data=2", 6, None, 5, 1),  # default split 2,2,1,1 with data parallelism, M not a multiple of S
        ("stage=4,fsdp=2", 12, (5, 3, 2, 2), 4, 2),  # interleaved, uneven chunks 3+2,2+1,1+1,1+1
        ("stage=2,data=2,fsdp=2", 12, None, 4, 3),  # interleaved, 3 chunks per stage, data parallelism
        ("stage=2,fsdp=4", 3, (2, 1), 2, 1),  # K = 2 of K' = 4 slots: the copy and its sums all-reduced
    ],
)
def test_1f1b_matches_the_sequential_stack(mesh_spec, num_layers, stage_layers, microbatches, repeats):
    plan, (loss, weight, grads, applied, forward_only), (ref_loss, ref_weight, ref_grads), _, _ = _toy(
        mesh_spec, num_layers, stage_layers, microbatches, batch=2 * microbatches * 2, repeats=repeats
    )
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(float(weight), float(ref_weight), rtol=1e-6)
    assert_close(grads, ref_grads)
    assert tuple(np.asarray(applied)) == plan.layer_applications()
    np.testing.assert_allclose(float(forward_only[0]), float(ref_loss), rtol=1e-5)  # undifferentiated: forwards only


def test_1f1b_computing_every_slot_matches_too():
    plan, (loss, _, grads, applied, _), (ref_loss, _, ref_grads), _, _ = _toy(
        "stage=2,fsdp=4", 4, (3, 1), 4, skip_empty=False
    )
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_close(grads, ref_grads)
    assert tuple(np.asarray(applied)) == plan.layer_applications() == (plan.ticks * 3,) * 2


@pytest.mark.parametrize(
    "mesh_spec, num_layers, stage_layers, microbatches, repeats, schedule, skip_empty",
    [
        ("stage=2,fsdp=4", 4, (3, 1), 2, 1, "1f1b", True),  # uneven, fsdp
        ("stage=4,fsdp=2", 12, (5, 3, 2, 2), 4, 2, "1f1b-fused", True),  # interleaved, uneven chunks
        ("stage=2,data=2,fsdp=2", 12, None, 4, 3, "1f1b", False),  # 3 chunks, data parallelism, every slot
        ("stage=4,fsdp=2", 12, (5, 3, 2, 2), 8, 1, "zb", True),  # zero bubble: B and W passes gather apart
        ("stage=2,fsdp=4", 4, (3, 1), 4, 1, "zb", False),  # zero bubble, every slot computed and selected
    ],
)
def test_padded_weights_gathered_per_microbatch_match_the_sequential_stack(
    mesh_spec, num_layers, stage_layers, microbatches, repeats, schedule, skip_empty
):
    """The padded ``[stages, slots, ...]`` layout with ``--pipeline-gather microbatch``: each slot's fsdp shards
    gathered where a chunk pass runs it (blocks of one slot), its gradient reduce-scattered there. The head's
    ``v``, split over fsdp, is gathered at each head step and its gradient reduce-scattered there too where
    empty slots are skipped (`HeadWeights`); computing every slot, gathered once."""
    plan, (loss, weight, grads, applied, forward_only), (ref_loss, ref_weight, ref_grads), _, _ = _toy(
        mesh_spec,
        num_layers,
        stage_layers,
        microbatches,
        batch=4 * microbatches,
        repeats=repeats,
        schedule=schedule,
        skip_empty=skip_empty,
        gather="microbatch",
    )
    assert plan.gather == "microbatch"
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(float(weight), float(ref_weight), rtol=1e-6)
    assert_close(grads, ref_grads)
    assert tuple(np.asarray(applied)) == plan.layer_applications()
    np.testing.assert_allclose(float(forward_only[0]), float(ref_loss), rtol=1e-5)


@pytest.mark.parametrize(
    "mesh_spec, num_layers, stage_layers, microbatches, repeats",
    [
        ("stage=4,fsdp=2", 12, (5, 3, 2, 2), 8, 1),  # uneven, 4 stages, M = 2S: steady ticks run both ops
        ("stage=4,fsdp=2", 12, (5, 3, 2, 2), 4, 2),  # interleaved, uneven chunks 3+2,2+1,1+1,1+1
    ],
)
def test_fused_1f1b_matches_the_sequential_stack(mesh_spec, num_layers, stage_layers, microbatches, repeats):
    plan, (loss, weight, grads, applied, forward_only), (ref_loss, ref_weight, ref_grads), _, _ = _toy(
        mesh_spec,
        num_layers,
        stage_layers,
        microbatches,
        batch=2 * microbatches * 2,
        repeats=repeats,
        schedule="1f1b-fused",
    )
    assert plan.schedule == "1f1b-fused" and plan.ticks == repeats * microbatches + (repeats + 1) * 4 - 2
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(float(weight), float(ref_weight), rtol=1e-6)
    assert_close(grads, ref_grads)
    assert tuple(np.asarray(applied)) == plan.layer_applications()
    np.testing.assert_allclose(float(forward_only[0]), float(ref_loss), rtol=1e-5)


# The model ---------------------------------------------------------------------------------------


def _batch(batch, length, seed=0):
    return pipeline_batch(batch, length, seed, unmasked=0.9)


def _trainer(config, mesh_spec, plan, optimizer=None):
    from train.runtime.optimizer import OptimizerConfig
    from train.runtime.step import Trainer

    return Trainer(
        config,
        optimizer or OptimizerConfig(),
        Parallelism.of(make_mesh(parse_mesh(mesh_spec, 8)), RULES, pipeline=plan),
    )


def _plan(num_layers, mesh_spec, stage_layers, microbatches, schedule, repeats=1, gather="once"):
    stages = parse_mesh(mesh_spec, 8)["stage"]
    layout, _ = pl.plan_layout(num_layers, stages, repeats, stage_layers)
    return pl.PipelinePlan(
        layout,
        microbatches,
        schedule=schedule,
        gather=gather,
    )


def _steps(trainer, batches):
    """Losses of ``len(batches)`` optimizer steps and the parameters after the first, canonical layer order."""
    state = trainer.init_state(0)
    step = trainer.train_step(*batches[0]["tokens"].shape)
    losses, first = [], None
    for batch in batches:
        state, metrics = step(state, batch, trainer.signals(False))
        losses.append(float(metrics["loss"]))
        if first is None:
            first = jax.tree.map(np.asarray, state["params"])
    if trainer.storage is not None:
        first = {
            **first,
            "layers": jax.tree.map(
                lambda g: np.asarray(pl.relayout(jnp.asarray(g), trainer.storage, None, trainer.config.num_layers)),
                first["layers"],
            ),
        }
    return losses, first


def _loss_and_grads(trainer, batch):
    state = trainer.init_state(0)
    fn = jax.jit(lambda params, batch: jax.value_and_grad(trainer.loss_sums, has_aux=True)(params, batch))
    (loss, _), grads = fn(state["params"], batch)
    if trainer.storage is not None:
        grads = {
            **grads,
            "layers": jax.tree.map(
                lambda g: pl.relayout(g, trainer.storage, None, trainer.config.num_layers), grads["layers"]
            ),
        }
    return float(loss), grads


@cached
def flat_loss_and_grads(num_layers, tied=False):
    """The unpipelined test model's (``num_layers`` layers, ``fsdp=8``, one microbatch; ``tied``: the output
    projection is the token embedding) loss and gradients on ``_batch(8, 32)``: computed once per layer count
    and shared by every test comparing a pipeline with it."""
    from models.config import get_config

    config = get_config("test", [f"num_layers={num_layers}", f"tie_embeddings={tied}"])
    return _loss_and_grads(_trainer(config, "fsdp=8", None), _batch(8, 32))


CASES = [
    (4, "stage=2,fsdp=4", (3, 1), 2, 1),  # uneven, fsdp
    (6, "stage=4,fsdp=2", (2, 2, 1, 1), 4, 1),  # uneven, 4 stages
    (4, "stage=2,fsdp=2,tensor=2", (3, 1), 2, 1),  # with tensor parallelism inside the stages
    (6, "stage=2,fsdp=4", (4, 2), 2, 2),  # interleaved: chunks 2+2 and 1+1
]


@pytest.mark.parametrize("num_layers, mesh_spec, stage_layers, microbatches, repeats", CASES)
def test_1f1b_model_has_the_loss_and_gradients_of_the_unpipelined_one(
    num_layers, mesh_spec, stage_layers, microbatches, repeats
):
    from models.config import get_config

    config = get_config("test", [f"num_layers={num_layers}"])
    ref_loss, ref_grads = flat_loss_and_grads(num_layers)
    trainer = _trainer(config, mesh_spec, _plan(num_layers, mesh_spec, stage_layers, microbatches, "1f1b", repeats))
    loss, grads = _loss_and_grads(trainer, _batch(8, 32))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)


@pytest.mark.parametrize("tied", [False, True])
def test_the_per_microbatch_gather_over_data_and_fsdp_has_the_unpipelined_loss_and_gradients(tied):
    """Fused 1F1B on 3,1 over stage=2,data=2,fsdp=2 with ``--pipeline-gather microbatch``: the rows are stored
    over stage alone, each row's features over fsdp; each layer's gradient is reduce-scattered over fsdp per
    slot and the stored rows' sums summed over data once after the loop (`Weights._psum_rest`). The embedding
    is the loop's entry (`edges.Entry`): stage 0 gathers its table per microbatch and reduce-scatters its
    gradient there; ``tied``, the same table is the head's output projection too, gathered on the last stage,
    and the two gradients add. Loss (1e-5) and gradients (1e-5) of the flat model."""
    from models.config import get_config

    config = get_config("test", ["num_layers=4", f"tie_embeddings={tied}"])
    ref_loss, ref_grads = flat_loss_and_grads(4, tied)
    mesh_spec = "stage=2,data=2,fsdp=2"
    trainer = _trainer(config, mesh_spec, _plan(4, mesh_spec, (3, 1), 2, "1f1b-fused", gather="microbatch"))
    assert trainer.storage.groups == 1
    loss, grads = _loss_and_grads(trainer, _batch(8, 32))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)


STEPS_LAYERS, STEPS_MESH, STEPS_SPLIT, STEPS_MICROBATCHES = 6, "stage=2,fsdp=4", (4, 2), 2


def _steps_config(remat="none"):
    from models.config import get_config
    from train.runtime.optimizer import OptimizerConfig

    config = get_config("test", [f"num_layers={STEPS_LAYERS}", f"remat={remat}"])
    return config, OptimizerConfig(eps=1e-3, warmup=0, decay_steps=10)


@functools.lru_cache(maxsize=1)
def _flat_steps():
    """The flat model's initial parameters, losses over 6 steps and parameters after the first (computed once)."""
    config, optimizer = _steps_config()
    flat = _trainer(config, "fsdp=8", None, optimizer)
    init = jax.tree.map(np.asarray, flat.init_state(0)["params"])
    return init, *_steps(flat, [_batch(8, 32, seed) for seed in range(6)])


@pytest.mark.parametrize("schedule, repeats", [("gpipe", 1), ("gpipe", 2), ("1f1b", 1)])
def test_training_steps_match_the_unpipelined_model(schedule, repeats):
    """Losses over 6 steps (1e-4) and the parameters after the first (1e-5) equal the flat model's, for GPipe,
    circular (GPipe with 2 repeats) and 1F1B on the uneven split 4,2 with fsdp.

    AdamW's first update is ``lr * g / (|g| + eps)``: with the default ``eps`` 1e-8 it is about
    ``lr * sign(g)``, which turns float32 rounding of a near-zero gradient entry into an update of up
    to ``lr`` (an ill-conditioned comparison, not a tolerance question); ``eps`` 1e-3 bounds that gain
    by ``lr / eps`` = 3 while entries with ``|g|`` near 1e-3 still move by about ``lr / 2``."""
    plan = _plan(STEPS_LAYERS, STEPS_MESH, STEPS_SPLIT, STEPS_MICROBATCHES, schedule, repeats)
    assert plan.layout.repeats == repeats and plan.one_f_one_b == (schedule == "1f1b")
    _assert_steps_match_the_flat_model(plan)


@pytest.mark.parametrize("repeats", [1, 2])
def test_fused_1f1b_training_steps_match_the_unpipelined_model(repeats):
    """As `test_training_steps_match_the_unpipelined_model`, for fused 1F1B and interleaved fused 1F1B (2
    chunks per stage: 2+2 and 1+1) on the uneven split 4,2 with fsdp."""
    plan = _plan(STEPS_LAYERS, STEPS_MESH, STEPS_SPLIT, STEPS_MICROBATCHES, "1f1b-fused", repeats)
    assert plan.layout.repeats == repeats and plan.one_f_one_b and plan.schedule == "1f1b-fused"
    _assert_steps_match_the_flat_model(plan)


def _assert_steps_match_the_flat_model(plan, remat="none", loss_rtol=1e-4):
    """Losses over 6 steps within ``loss_rtol`` and the parameters after the first within 1e-5 of `_flat_steps`
    (the flat model without remat), the pipelined model run with ``remat``."""
    init, ref_losses, ref_params = _flat_steps()
    config, optimizer = _steps_config(remat)
    batches = [_batch(8, 32, seed) for seed in range(6)]
    losses, params = _steps(_trainer(config, STEPS_MESH, plan, optimizer), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
    assert_close(params, ref_params)
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(init)))
    assert moved > 1e-3  # the step moved the parameters far beyond the tolerance
    assert ref_losses[-1] < ref_losses[0]  # six steps of training, not six evaluations of one state


@pytest.mark.parametrize("schedule, repeats", [("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("1f1b-fused", 2), ("zb", 1)])
def test_training_steps_with_the_weights_gathered_per_microbatch_match_the_unpipelined_model(schedule, repeats):
    """As `test_training_steps_match_the_unpipelined_model` (uneven 4,2 with fsdp: the unpadded storage, its
    rows gathered four at a time over fsdp), with ``--pipeline-gather microbatch``: every chunk pass gathers
    its blocks and reduce-scatters their gradients, for GPipe, circular, 1F1B, interleaved fused and zero
    bubble (whose input- and weight-gradient passes each gather the block, the latter reduce-scattering it)."""
    plan = _plan(STEPS_LAYERS, STEPS_MESH, STEPS_SPLIT, STEPS_MICROBATCHES, schedule, repeats, gather="microbatch")
    assert plan.gather == "microbatch" and plan.layout.repeats == repeats
    _assert_steps_match_the_flat_model(plan)


@cached
def _compiled_gradients(
    schedule,
    num_layers=4,
    mesh_spec="stage=2,fsdp=4",
    stage_layers=(3, 1),
    microbatches=16,
    batch=64,
    length=256,
    gather="once",
    block_inputs=True,
    head_streamed=True,
    entry_streamed=True,
    remat="none",
):
    """The compiled gradient step of a test model under ``remat``, compiled once per arguments (the tests share it);
    ``block_inputs`` False: with ``gather`` ``microbatch``, each slot's input saved, as before the ring kept block
    inputs only (`Streamed.block_inputs`); ``head_streamed`` False: with ``gather`` ``microbatch``, the 1F1B
    family's head weights gathered once, as before the head step gathered them (`HeadWeights`);
    ``entry_streamed`` False: the embedding run on the whole batch before the loop, which holds its output ``[M,
    microbatch, ...]`` and that output's cotangent, as before stage 0 ran it per microbatch (`edges.Entry`)."""
    from unittest import mock

    from models import transformer
    from models.config import get_config
    from sharding.pipeline import onef1b
    from sharding.pipeline.weights import Weights

    config = get_config("test", [f"num_layers={num_layers}", f"remat={remat}"])
    plan = _plan(num_layers, mesh_spec, stage_layers, microbatches, schedule, gather=gather)
    trainer = _trainer(config, mesh_spec, plan)
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), trainer.state_params, trainer.param_shardings
    )
    fn = jax.jit(lambda p, b: jax.value_and_grad(trainer.loss_sums, has_aux=True)(p, b))
    every_slot = Weights.stream

    def stream(self, *args, **kwargs):
        return every_slot(self, *args, **{**kwargs, "block_inputs": False})

    head_weights = onef1b.HeadWeights

    def head_once(specs, summed, streamed, stage_dims=None):  # the head's (final norm and projection), not the entry's
        return head_weights(specs, summed, streamed and "norm" not in specs, stage_dims)

    def entry_first(*args, entry_fn, entry_params, entry_names, **kwargs):
        tokens, par = args[4], args[7]
        return onef1b.run_pipeline_loss(*args[:4], entry_fn(par, entry_params, tokens), *args[5:], **kwargs)

    with contextlib.ExitStack() as patches:
        if not entry_streamed:
            patches.enter_context(mock.patch.object(transformer, "run_pipeline_loss", entry_first))
        if not block_inputs:
            patches.enter_context(mock.patch.object(Weights, "stream", stream))
        if not head_streamed:
            patches.enter_context(mock.patch.object(onef1b, "HeadWeights", head_once))
        return trainer, fn.lower(params, trainer.abstract_batch(batch, length)).compile()


def test_1f1b_needs_fewer_temporaries_than_gpipe_and_no_transfer_sits_in_a_conditional():
    """At M = 16 on 2 stages GPipe keeps 16 microbatches' slot inputs, 1F1B a ring of 2 (memory analysis of the
    compiled gradient step: deterministic); the compiled 1F1B program has no collective-permute inside a
    conditional, and every collective inside one is among the devices of one stage."""
    _, gpipe = _compiled_gradients("gpipe")
    trainer, one_f_one_b = _compiled_gradients("1f1b")
    gpipe_temp = gpipe.memory_analysis().temp_size_in_bytes
    temp = one_f_one_b.memory_analysis().temp_size_in_bytes
    print(f"temporaries per device at M=16: gpipe {gpipe_temp:,} B, 1f1b {temp:,} B ({temp / gpipe_temp:.2f}x)")
    # GPipe keeps the slot inputs of all M+S-1 = 17 steps, 1F1B a ring of S = 2 microbatches: at least the 3
    # slots of stage 0 times one microbatch's rows on a device (64 / 16 over fsdp=4: 1 x 256 x 128 float32) for
    # each of the other 15 must be saved. (The head split over stages already took GPipe's whole-batch logits
    # away, so the ratio is no longer the 0.46x it was before that; here 0.60x.)
    saved = (16 + 2 - 1 - 2) * 3 * (64 // 16 // 4) * 256 * 128 * 4
    assert gpipe_temp - temp >= saved, (gpipe_temp, temp, saved)
    found = branch_collectives(one_f_one_b.as_text(), trainer.mesh)
    assert not [c for c in found if c.op == "collective-permute"]
    assert all(c.safe for c in found)


def test_fused_1f1b_temporaries_lie_between_lockstep_and_gpipe_and_no_transfer_sits_in_a_conditional():
    """The compiled gradient step of the case above (M = 16 on 2 stages, memory analysis: deterministic): fused
    1F1B keeps a ring of 3 microbatches (2S - 1) where lockstep keeps 2 and GPipe the slot inputs of all 17
    steps, so its temporaries lie between theirs; no collective-permute sits inside a conditional, and every
    collective inside one is among the devices of one stage."""
    _, gpipe = _compiled_gradients("gpipe")
    _, lockstep = _compiled_gradients("1f1b")
    trainer, fused = _compiled_gradients("1f1b-fused")
    assert trainer.par.pipeline.tick_table().slots == 3
    temps = {
        name: c.memory_analysis().temp_size_in_bytes
        for name, c in (("gpipe", gpipe), ("1f1b", lockstep), ("1f1b-fused", fused))
    }
    print("temporaries per device at M=16:", temps)
    assert temps["1f1b"] < temps["1f1b-fused"] < temps["gpipe"], temps
    found = branch_collectives(fused.as_text(), trainer.mesh)
    assert not [c for c in found if c.op == "collective-permute"]
    assert all(c.safe for c in found)


def test_the_weights_gathered_per_microbatch_need_fewer_temporaries_and_no_transfer_sits_in_a_conditional():
    """1F1B on 6,2 layers over stage=2,fsdp=4 (per microbatch the storage splits each row's features over the 4
    devices: one layer gathered at a time): gathered once, the step holds stage 0's 8-slot working copy and
    its float32 gradient sums; per microbatch, one layer and its gradient, so the compiled temporaries
    (memory analysis: deterministic) are fewer; and fewer again where the ring keeps one input per 4 layers
    instead of each slot's (the backward recomputes the other 3, gathering those layers once more), by at
    least the ring's 12 inputs less the 8 the recomputation holds (the block's input read out of the ring, the
    scan's 3 and their concatenation's 4), within 1% of one input (XLA's packing).
    The head's weights, gathered per head step too (`HeadWeights`), no longer stay whole through the loop
    with whole float32 gradient sums: the temporaries drop by that copy and those sums less the sums of the
    fsdp shards, within 1% of the output projection (XLA's packing), against the head gathered once beside
    layers gathered per microbatch; its whole-size all-gather runs per tick (inside the head's conditional)
    instead of once. The embedding, the loop's entry (`edges.Entry`), runs per microbatch on stage 0: the
    step holds neither the whole batch's stage inputs ``[M, microbatch, length, embed]`` nor their cotangent
    (no such array in the compiled program; against the embedding run before the loop, the temporaries drop
    by at least those two). The gathers and reduce-scatters run inside conditionals the stage's devices all
    take alike: no collective-permute inside one, and every collective inside one is among the devices of one
    stage."""
    from sharding.hlo import collectives

    case = dict(num_layers=8, stage_layers=(6, 2), microbatches=8, batch=64, length=256)
    _, once = _compiled_gradients("1f1b", **case)
    _, every_slot = _compiled_gradients("1f1b", gather="microbatch", block_inputs=False, **case)
    _, head_once = _compiled_gradients("1f1b", gather="microbatch", head_streamed=False, **case)
    _, entry_first = _compiled_gradients("1f1b", gather="microbatch", entry_streamed=False, **case)
    trainer, streamed = _compiled_gradients("1f1b", gather="microbatch", **case)
    assert trainer.par.pipeline.gather == "microbatch"
    assert trainer.state_layout.storage.groups == 1  # rows over stage alone, features over fsdp
    temps = {
        name: c.memory_analysis().temp_size_in_bytes
        for name, c in (
            ("once", once),
            ("every slot", every_slot),
            ("head once", head_once),
            ("entry first", entry_first),
            ("microbatch", streamed),
        )
    }
    print("1f1b temporaries per device:", temps)
    assert temps["microbatch"] < temps["head once"] < temps["every slot"] < temps["once"], temps
    # The stage inputs of all M = 8 microbatches (2 rows x 256 x 128 float32 per device) and their cotangent.
    inputs = f"f32[8,{64 // 8 // 4},256,{trainer.config.embed_dim}]"
    assert inputs in entry_first.as_text() and inputs not in streamed.as_text()
    assert temps["entry first"] - temps["microbatch"] >= 2 * 8 * (64 // 8 // 4) * 256 * trainer.config.embed_dim * 4, (
        temps
    )
    abstract = trainer.state_layout.abstract_params
    head = [abstract["unembed"], abstract["final_norm"]["scale"]]
    whole = sum(w.size * 4 for w in head)  # float32
    assert temps["head once"] - temps["microbatch"] >= 2 * whole - whole / 4 - abstract["unembed"].size * 4 / 100, (
        temps,
        whole,
    )
    unembed = abstract["unembed"].size * 4

    def head_gathers(compiled):
        return [
            c.executions for c in collectives(compiled.as_text()) if c.op == "all-gather" and c.result_bytes == unembed
        ]

    # (the embedding table, [512, 128] as the projection [128, 512], is gathered per tick in both: the entry's)
    ticks = trainer.par.pipeline.ticks
    assert sorted(head_gathers(head_once)) == [1, ticks] and head_gathers(streamed) == [ticks, ticks], (
        head_gathers(head_once),
        head_gathers(streamed),
    )
    # The ring's S = 2 entries keep 2 inputs each instead of 8: 12 of one device's microbatch rows
    # [2, 256, 128] float32 fewer, 8 of them held again by one segment's recomputation (the backward reads the
    # ring in place, `buffers.RingEntry`: the block's input is a buffer of its own, where it was a slice of a
    # copy of the whole entry, 8 inputs without block inputs, 2 with them).
    ring = trainer.par.pipeline.tick_table().slots
    assert ring == 2
    act = (64 // 8 // 4) * 256 * trainer.config.embed_dim * 4
    assert temps["every slot"] - temps["microbatch"] >= (ring * (8 - 2) - 8) * act - act / 100, (temps, act)
    found = branch_collectives(streamed.as_text(), trainer.mesh)
    assert not [c for c in found if c.op == "collective-permute"]
    assert all(c.safe for c in found)


@pytest.mark.parametrize("schedule", ONE_F_ONE_B)
def test_the_tick_loop_updates_its_rings_in_place(schedule):
    """No copy of the ring of saved chunk inputs ``[slots, P, microbatch, length, embed]``, of one of its
    entries, or of the ring of waiting cotangents inside any loop body of the compiled step (6,2 layers over
    stage=2,fsdp=4, the per-microbatch gather, M = 8): every write to a ring reads nothing of it
    (`buffers.store`) and the backward reads its slot inputs out of the ring in place (`buffers.RingEntry`),
    so XLA finds no read of a ring after an in-place update of it and adds no copy of the whole ring per tick
    (before: two per tick, the ring's buffer and a second one live at once)."""
    from sharding.hlo import loop_instructions

    case = dict(num_layers=8, stage_layers=(6, 2), microbatches=8, batch=64, length=256)
    trainer, compiled = _compiled_gradients(schedule, gather="microbatch", **case)
    ticks, embed = trainer.par.pipeline.tick_table(), trainer.config.embed_dim
    act = [64 // 8 // 4, 256, embed]  # one microbatch's rows on a device
    entry = [2, *act]  # a chunk of 6 layers saves 2 block inputs (blocks of 4 layers)
    ring, waiting = [ticks.slots, *entry], [ticks.cotangent_slots, *act]
    text = compiled.as_text()
    assert f"f32[{','.join(map(str, ring))}]" in text  # the ring is there, carried by the tick loop
    copies = [(name, dims) for _, name, dims in loop_instructions(text, "copy") if dims in (ring, entry, waiting)]
    assert not copies, copies


def test_the_per_microbatch_gather_orders_the_schedules_temporaries_below_gathering_once():
    """The compiled gradient step's temporaries (memory analysis: deterministic) on 6,2 layers over
    stage=2,fsdp=4, M = 8: with the per-microbatch gather (one layer and its gradient held at a time) lockstep
    1F1B (a ring of S = 2 microbatches) < fused 1F1B (2S - 1 = 3) < GPipe (every step's), all below 1F1B
    gathering once, below GPipe gathering once; and each per-microbatch all-gather inside the tick loop
    assembles at most one layer (the leaf of one layer, not a block of one row from each of the 4 devices), or
    the head's output projection."""
    from sharding.hlo import collectives

    case = dict(num_layers=8, stage_layers=(6, 2), microbatches=8, batch=64, length=256)
    temps = {
        (schedule, gather): _compiled_gradients(schedule, gather=gather, **case)[1].memory_analysis().temp_size_in_bytes
        for schedule, gather in [
            ("1f1b", "microbatch"),
            ("1f1b-fused", "microbatch"),
            ("gpipe", "microbatch"),
            ("1f1b", "once"),
            ("gpipe", "once"),
        ]
    }
    print("temporaries per device:", temps)
    order = list(temps.values())
    assert order == sorted(order) and len(set(order)) == len(order), temps
    trainer, fused = _compiled_gradients("1f1b-fused", gather="microbatch", **case)
    abstract = trainer.state_layout.abstract_params
    layer = max(x.size // x.shape[0] * 4 for x in jax.tree.leaves(abstract["layers"]))
    head = abstract["unembed"].size * 4  # the head's weights, gathered per head step too (`HeadWeights`)
    gathers = [c for c in collectives(fused.as_text()) if c.op == "all-gather" and c.executions > 1]
    assert gathers and max(c.result_bytes for c in gathers if c.result_bytes != head) <= layer, (gathers, layer)


# Through the CLI -------------------------------------------------------------------------------


def test_dry_run_reports_the_1f1b_schedule(capsys):
    from train import train

    code = train.main(
        [
            "--model",
            "test",
            "--mesh",
            "stage=2,fsdp=4",
            "--stage-layers",
            "3,1",
            "--microbatches",
            "4",
            "--batch-size",
            "16",
            "--seq-len",
            "32",
            "--dry-run",
            "--pipeline-schedule",
            "1f1b",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "pipeline: 1F1B (PipeDream-Flush) over stage=2, 4 microbatches" in out
    assert (
        "a ring of 2 microbatches x 3 slot inputs per device (the other schedules keep 5 x 3); one loop of 10 ticks"
    ) in out
    assert "final norm, output projection and loss: on the last stage inside the pipeline" in out
    # A tick runs a forward or a backward branch, not both: the products inside conditionals are an upper bound,
    # reported apart from those that always run (the layers and the head are all inside branches here).
    outside = re.search(r"compute per device per step: ([\d.]+) (\w)FLOP in matrix products outside conditionals", out)
    inside = re.search(r"conditional branches: at most ([\d.]+) (\w)FLOP more \(every branch counted", out)
    assert outside and inside, out


@pytest.mark.parametrize(
    "args, message",
    [
        (
            [
                "--mesh",
                "stage=2,fsdp=4",
                "--pipeline-schedule",
                "1f1b",
                "--pipeline-repeats",
                "2",
                "--microbatches",
                "3",
            ],
            # 4 would leave 2 sequences per microbatch for fsdp=4: the value named also splits --batch-size 8
            "--microbatches 3: interleaved 1F1B (--pipeline-repeats 2) needs a multiple of the 2 stages; use "
            "--microbatches 2",
        ),
        (["--mesh", "fsdp=8", "--pipeline-schedule", "1f1b"], "--pipeline-schedule 1f1b needs a pipeline"),
        # auto prices GPipe's stages (each with a share of the head); its example fits this 4-layer model
        (
            [
                "--mesh",
                "stage=2,fsdp=4",
                "--pipeline-schedule",
                "1f1b",
                "--stage-layers",
                "auto",
                "--microbatches",
                "2",
            ],
            "--stage-layers auto times the stages for --pipeline-schedule gpipe; with 1f1b give the layers by hand, "
            "e.g. --stage-layers 2,2",
        ),
    ],
)
def test_bad_1f1b_flags_fail_before_compiling_with_the_flags_named(args, message, capsys):
    from train import train

    code = train.main(["--model", "test", "--microbatches", "2", "--batch-size", "8", "--dry-run", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


@pytest.mark.parametrize(
    "microbatches, stages, batch, data_parallel, repeats",
    [(3, 2, 8, 4, 2), (3, 2, 12, 4, 2), (5, 4, 32, 2, 2), (1, 2, 8, 4, 1), (2, 4, 4, 2, 1), (6, 4, 48, 1, 3)],
)
def test_the_microbatches_a_pipeline_error_suggests_pass_it_and_split_the_batch(
    microbatches, stages, batch, data_parallel, repeats
):
    """The suggested ``--microbatches`` (and ``--batch-size`` where none divides it) passes this check and
    the batch check after it (M divides the batch, data x fsdp x expert each microbatch)."""
    with pytest.raises(ValueError) as info:
        pl.check_microbatches(microbatches, stages, batch, data_parallel, repeats)
    hint = re.search(r"use --microbatches (\d+)(?: --batch-size (\d+))?$", render(info.value))
    assert hint, info.value
    m, b = int(hint[1]), int(hint[2] or batch)
    pl.check_microbatches(m, stages, b, data_parallel, repeats)
    assert b % m == 0 and (b // m) % data_parallel == 0, (m, b)


def test_dry_run_reports_interleaved_1f1b(capsys):
    from train import train

    code = train.main(
        [
            "--model",
            "test",
            "--mesh",
            "stage=2,fsdp=4",
            "--microbatches",
            "4",
            "--batch-size",
            "16",
            "--seq-len",
            "32",
            "--dry-run",
            "--pipeline-schedule",
            "1f1b",
            "--pipeline-repeats",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "pipeline: 1F1B (PipeDream-Flush), interleaved, 2 chunks per stage over stage=2" in out
    ticks = pl.one_f_one_b_ticks(2, 4, 2)
    assert f"a ring of {ticks.slots} chunk inputs x 1 slot inputs per device" in out


@pytest.mark.parametrize("repeats", [1, 2])
def test_the_fused_1f1b_plan_round_trips_through_its_flags_and_is_reported(repeats):
    from train.reports.report import schedule_memory_line
    from train.setup.cli import parse
    from train.setup.flags import parallelism_flags

    argv = ["--model", "test", "--mesh", "stage=2,fsdp=4", "--microbatches", "4", "--pipeline-schedule", "1f1b-fused"]
    run = parse(argv + (["--pipeline-repeats", str(repeats)] if repeats > 1 else []))
    plan = run.parallelism.pipeline
    assert plan.one_f_one_b and plan.schedule == "1f1b-fused" and plan.layout.repeats == repeats
    again = parse(["--model", "test", *parallelism_flags(run.parallelism)])
    assert again.parallelism.pipeline == plan
    ticks = 4 * repeats + (repeats + 1) * 2 - 2
    assert (
        f"one loop of {ticks} ticks, each a chunk's forward and a chunk's backward per stage"
        in schedule_memory_line(plan)
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b-fused"])
def test_the_gather_mode_round_trips_through_its_flags_and_is_reported(schedule):
    from train.setup.cli import parse
    from train.setup.flags import parallelism_flags

    argv = ["--model", "test", "--mesh", "stage=2,fsdp=4", "--microbatches", "4", "--pipeline-schedule", schedule]
    assert parse(argv).parallelism.pipeline.gather == "once"
    run = parse([*argv, "--pipeline-gather", "microbatch"])
    plan = run.parallelism.pipeline
    assert plan.gather == "microbatch" and plan.schedule == schedule
    assert "--pipeline-gather" in parallelism_flags(run.parallelism)
    again = parse(["--model", "test", *parallelism_flags(run.parallelism)])
    assert again.parallelism.pipeline == plan


def test_dry_run_reports_the_gather_mode(capsys):
    from train import train

    argv = ["--model", "test", "--mesh", "stage=2,fsdp=4", "--stage-layers", "3,1", "--microbatches", "4"]
    argv += ["--batch-size", "16", "--seq-len", "32", "--dry-run", "--pipeline-gather", "microbatch"]
    code = train.main(argv)
    out = capsys.readouterr().out
    assert code == 0
    assert "weights (--pipeline-gather microbatch): each device" in out
    assert "all-gathers one layer at a time" in out  # each row's features split over the fsdp=4 devices


def test_dry_run_says_when_the_per_microbatch_gather_has_nothing_to_gather(capsys):
    """Without a batch axis that splits the layers (here only tensor beside stage), the per-microbatch mode still
    takes one layer at a time from the stored rows instead of a working copy, and the report says there is no
    gather rather than naming one."""
    from train import train

    argv = ["--model", "test", "--mesh", "stage=2,tensor=4", "--microbatches", "2", "--batch-size", "4"]
    code = train.main([*argv, "--seq-len", "32", "--dry-run", "--pipeline-gather", "microbatch"])
    out = capsys.readouterr().out
    assert code == 0
    assert "takes one layer at a time from the rows it stores" in out and "nothing to all-gather" in out
    assert "all-gathers one layer at a time" not in out


def test_the_gather_mode_needs_a_pipeline(capsys):
    from train import train

    code = train.main(["--model", "test", "--mesh", "fsdp=8", "--pipeline-gather", "microbatch", "--dry-run"])
    err = capsys.readouterr().err
    assert code != 0 and "--pipeline-gather microbatch needs a pipeline" in err and "Traceback" not in err


@pytest.mark.parametrize("repeats", [1, 2])
def test_the_1f1b_plan_round_trips_through_its_flags(repeats):
    from train.setup.cli import parse
    from train.setup.flags import parallelism_flags

    argv = ["--model", "test", "--mesh", "stage=2,fsdp=4", "--microbatches", "4", "--pipeline-schedule", "1f1b"]
    run = parse(argv + (["--pipeline-repeats", str(repeats)] if repeats > 1 else []))
    plan = run.parallelism.pipeline
    assert plan.one_f_one_b and plan.schedule == "1f1b" and plan.layout.repeats == repeats
    again = parse(["--model", "test", *parallelism_flags(run.parallelism)])
    assert again.parallelism.pipeline == plan


@pytest.mark.parametrize("schedule", ONE_F_ONE_B)
def test_the_head_and_table_are_gathered_over_stage_at_each_tick(schedule):
    """With the per-microbatch gather the output head's and the embedding table's weights enter the tick loop
    split over ``stage`` as stored, and each tick all-gathers them over ``stage`` outside the head's
    conditional (`edges.HeadWeights.over_stage`): every all-gather to their ``[embed/fsdp, vocab]`` blocks
    sits in the tick loop's body, none before it, where its output would stay live through the whole loop
    (as when XLA hoisted or the map's input gathered them once)."""
    from sharding.hlo import instructions_of, loop_instructions

    case = dict(num_layers=8, stage_layers=(6, 2), microbatches=8, batch=64, length=256)
    trainer, compiled = _compiled_gradients(schedule, gather="microbatch", **case)
    config, fsdp = trainer.config, trainer.mesh.shape["fsdp"]
    blocks = ([config.embed_dim // fsdp, config.vocab_size], [config.vocab_size, config.embed_dim // fsdp])
    text = compiled.as_text()
    everywhere = [name for _, name, dims in instructions_of(text, "all-gather") if dims in blocks]
    in_loop = [name for _, name, dims in loop_instructions(text, "all-gather") if dims in blocks]
    assert in_loop, everywhere  # the head's and the table's, per tick
    assert sorted(everywhere) == sorted(in_loop), everywhere
