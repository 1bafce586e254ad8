"""Pipeline parallelism over the ``stage`` axis: layouts, equality with the unpipelined model, work, memory,
checkpoints across stage layouts, and refused flags."""

import functools
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cached import cached
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import get_config
from models.transformer import init_params
from sharding import pipeline as pl
from sharding.hlo import branch_collectives
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import UNSHARDED, Accumulation, Parallelism
from sharding.pipeline.schedule import run_pipeline
from sharding.pipeline.storage import StageStorage, layout_from_meta, stack_table, storage_for, storage_spec
from sharding.rules import get_rules
from train import train
from train.reports import report
from train.runtime.optimizer import OptimizerConfig
from train.runtime.step import Trainer

RULES = get_rules("fsdp_tp")


def assert_close(actual, expected, rtol=1e-5):
    """float32 agreement to ``rtol`` of each array's largest magnitude (entries near zero included)."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * float(np.max(np.abs(e)) or 1.0))


# Layouts (no devices) ---------------------------------------------------------------


def test_the_pure_pipeline_modules_import_without_jax():
    """The package, its layouts, tick tables, storage and relayout import with JAX blocked (a planner or a
    checkpoint reader needs no accelerator stack); the schedule modules, which run JAX, do not."""
    block = "import sys; sys.modules['jax'] = None; "
    pure = (
        "import sharding.pipeline, sharding.pipeline.layout, sharding.pipeline.ticks, sharding.pipeline.storage, "
        "sharding.pipeline.relayout"
    )
    subprocess.run([sys.executable, "-c", block + pure], check=True, cwd=Path(__file__).parents[1])
    for schedule in ("program", "schedule", "onef1b"):
        run = subprocess.run(
            [sys.executable, "-c", f"{block}import sharding.pipeline.{schedule}"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parents[1],
            check=False,
        )
        assert run.returncode != 0 and "jax" in run.stderr, (schedule, run.stderr)


def test_uneven_layout_places_layers_in_order_and_pads_the_smaller_stages():
    layout, note = pl.plan_layout(12, 4, 1, (5, 3, 2, 2))
    assert note is None and layout.schedule == "gpipe"
    assert layout.stage_layers == (5, 3, 2, 2) and layout.slots == 5 and layout.padding == (0, 2, 3, 3)
    table = layout.layer_table()
    assert table.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, -1, -1], [8, 9, -1, -1, -1], [10, 11, -1, -1, -1]]
    assert layout.stage_ranges(1) == [(5, 8)]
    assert pl.StageLayout.from_meta(json.loads(json.dumps(layout.to_meta()))) == layout


def test_circular_layout_gives_each_stage_non_adjacent_chunks():
    layout, _ = pl.plan_layout(12, 4, 2, (5, 3, 2, 2))  # per stage, split over 2 repeats
    assert layout.chunks == ((3, 2, 1, 1), (2, 1, 1, 1)) and layout.schedule == "circular"
    assert layout.stage_ranges(0) == [(0, 3), (7, 9)]
    per_chunk, _ = pl.plan_layout(12, 4, 2, (3, 2, 1, 1, 2, 1, 1, 1))  # per chunk, in pipeline order
    assert per_chunk == layout


def test_default_split_is_even_where_it_can_be_and_says_how_it_split_otherwise():
    even, note = pl.plan_layout(32, 4)
    assert even.stage_layers == (8, 8, 8, 8) and note is None
    uneven, note = pl.plan_layout(6, 4)
    assert uneven.stage_layers == (2, 2, 1, 1)
    assert "6 layers do not split evenly over 4 stages; split as 2,2,1,1" in note


def test_bubble_fraction_shrinks_with_repeats_and_microbatches():
    gpipe = pl.PipelinePlan(pl.plan_layout(32, 4)[0], 16)
    circular = pl.PipelinePlan(pl.plan_layout(32, 4, 2)[0], 16)
    assert gpipe.bubble_fraction == pytest.approx(3 / 19) and gpipe.steps == 19
    assert circular.bubble_fraction == pytest.approx(3 / 35)


def test_relayout_round_trips_through_the_canonical_order():
    canonical = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)
    src, _ = pl.plan_layout(12, 4, 1, (5, 3, 2, 2))
    dst, _ = pl.plan_layout(12, 2, 2, None)
    staged = pl.relayout(jnp.asarray(canonical), None, src, 12)
    assert staged.shape == (4, 5, 3) and float(staged[1, 3].sum()) == 0.0  # an empty slot is zero
    moved = pl.relayout(staged, src, dst, 12)
    np.testing.assert_array_equal(pl.relayout(moved, dst, None, 12), canonical)


def _simulated_working_copy(storage):
    """Each stage's working copy as the gather builds it (`_Weights._take_slots`), simulated in NumPy."""
    p, layout, groups = storage.placement, storage.layout, storage.groups
    blocks = p.row_table.reshape(layout.stages, groups, p.per_device)
    work = np.full((layout.stages, layout.repeats * p.chunk_slots), -2, np.int32)
    for s in range(layout.stages):
        for g in range(groups):
            local = list(blocks[s, g])
            for d, send in enumerate(p.sends):
                if send is not None:
                    src, h = divmod((s * groups + g - d) % (layout.stages * groups), groups)
                    local += [blocks[src, h][i] for i in send[src, h]]
            work[s, g::groups] = [local[i] if i >= 0 else -1 for i in p.local_index[s, g]]
    return work


@pytest.mark.parametrize(
    "num_layers, stages, repeats, split, groups",
    [
        (32, 4, 1, (10, 10, 6, 6), 2),
        (12, 4, 2, (5, 3, 2, 2), 2),
        (4, 2, 1, (3, 1), 4),
        (12, 4, 1, (9, 1, 1, 1), 2),
        (7, 2, 1, (5, 2), 4),
        (8, 2, 2, None, 4),
    ],
)
def test_unpadded_storage_holds_each_layer_once_and_gathers_every_stages_slots(
    num_layers, stages, repeats, split, groups
):
    layout, _ = pl.plan_layout(num_layers, stages, repeats, split)
    storage = StageStorage(layout, groups)
    p = storage.placement
    stored = p.row_table[p.row_table >= 0]
    assert sorted(stored.tolist()) == list(range(num_layers))  # each layer exactly once, no padded slots
    assert p.per_device == -(-num_layers // (stages * groups))  # ceil(L / devices) rows per device
    assert storage.rows == stages * groups * p.per_device
    table = layout.layer_table().reshape(stages, repeats, layout.chunk_slots)
    expected = np.full((stages, repeats, p.chunk_slots), -1, np.int32)
    expected[:, :, : layout.chunk_slots] = table
    np.testing.assert_array_equal(_simulated_working_copy(storage), expected.reshape(stages, -1))


def test_the_7b_split_moves_one_row_per_device_between_stages():
    layout, _ = pl.plan_layout(32, 4, 1, (10, 10, 6, 6))
    p = StageStorage(layout, 2).placement
    assert p.per_device == 4 and p.received == 1  # stages 0 and 1 keep 8 of their 10 layers; 2 more each arrive
    assert sum(send is not None for send in p.sends) == 1  # in one ppermute (2 stages on, the same g)


def test_an_old_padded_layout_and_the_unpadded_storage_round_trip_through_the_canonical_order():
    canonical = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)
    layout, _ = pl.plan_layout(12, 4, 1, (5, 3, 2, 2))
    storage = StageStorage(layout, 2)
    padded = pl.relayout(jnp.asarray(canonical), None, layout, 12)
    rows = pl.relayout(padded, layout, storage, 12)
    assert rows.shape == (storage.rows, 3)
    np.testing.assert_array_equal(pl.relayout(rows, storage, None, 12), canonical)
    assert layout_from_meta(storage.to_meta()) == storage
    assert layout_from_meta(layout.to_meta()) == layout  # checkpoints saved before: the padded layout


def test_inspect_names_the_leading_dimension_a_checkpoint_stores():
    """`checkpoints.inspect` reads a pipelined checkpoint's layout from its metadata: unpadded rows (their
    count, the stage's devices they spread over), or the padded ``[stage, slot, ...]`` of older ones."""
    from checkpoints.inspect import stage_layout_line

    layout, _ = pl.plan_layout(12, 4, 1, (5, 3, 2, 2))
    storage = StageStorage(layout, 2)
    assert stage_layout_line(storage.to_meta()) == (
        f"5,3,2,2 (1 chunk per stage); layer arrays are [rows, ...]: {storage.rows} rows over stage=4 x 2 devices "
        "(unpadded), re-laid on resume"
    )
    assert storage.rows == 16  # 4 stages x 2 devices x ceil(12 / 8) = 2 rows
    assert stage_layout_line(layout.to_meta()) == (
        "5,3,2,2 (1 chunk per stage); layer arrays are [stage, slot, ...] (padded), re-laid on resume"
    )


# The pipeline on a toy layer (sharding only) ----------------------------------------------


def _toy_layer(par, w, h, position):
    h = jnp.tanh(h @ w["a"] + w["b"] + 0.01 * position[:, None])
    return par.constrain(h, ("batch", "act_embed"))


def _toy(mesh_spec, num_layers, stage_layers, repeats, microbatches, batch=16, dim=16, unpadded=True):
    """Loss, gradients and layer applications of the pipelined toy, and the sequential reference's
    (``unpadded``: the stack in the `StageStorage`, else in the padded layout)."""
    mesh = make_mesh(parse_mesh(mesh_spec, 8))
    rules = pl.pipeline_rules(RULES)
    layout, _ = pl.plan_layout(num_layers, mesh.shape["stage"], repeats, stage_layers)
    plan = pl.PipelinePlan(layout, microbatches)
    (w, x, position), (ref_loss, ref_grads) = _toy_reference(num_layers, batch, dim)
    names = {"a": ("layers", None, "embed"), "b": ("layers", None)}
    par = Parallelism.of(mesh, rules, pipeline=plan)

    def pipelined(w, x):
        y, applied = run_pipeline(_toy_layer, w, x, (position,), par, names=names)
        return jnp.sum(y**2), applied

    if unpadded:
        store = storage_for(layout, list(names.values()), rules, dict(mesh.shape))
        axes = ("fsdp",) if mesh.shape["fsdp"] > 1 else ()
        specs = {
            k: storage_spec(par.spec(n, (store.rows, *w[k].shape[1:])), store.rows, dict(mesh.shape), axes)
            for k, n in names.items()
        }
    else:
        store = layout
        specs = {"a": P("stage", None, "fsdp"), "b": P("stage")}
    staged = jax.tree.map(lambda a: pl.relayout(jnp.asarray(a), None, store, num_layers), w)
    staged = jax.device_put(staged, {k: NamedSharding(mesh, spec) for k, spec in specs.items()})
    (loss, applied), grads = jax.jit(jax.value_and_grad(pipelined, argnums=(0, 1), has_aux=True))(staged, x)
    grads = (jax.tree.map(lambda g: pl.relayout(g, store, None, num_layers), grads[0]), grads[1])
    return plan, (loss, grads, applied), (ref_loss, ref_grads)


@functools.cache
def _toy_reference(num_layers, batch, dim):
    """The toy's inputs (weights ``{"a": [layers, dim, dim], "b": [layers, dim]}``, ``x`` [batch, dim],
    positions [batch]; float32 from seed 0) and the sequential stack's loss and gradients on one device: they
    depend on the sizes only, so the pipelines of every mesh and split compare with one computation."""
    rng = np.random.default_rng(0)
    w = {
        "a": rng.normal(size=(num_layers, dim, dim)).astype(np.float32) / 4,
        "b": rng.normal(size=(num_layers, dim)).astype(np.float32),
    }
    x = rng.normal(size=(batch, dim)).astype(np.float32)
    position = jnp.asarray(rng.integers(0, 9, size=(batch,)), jnp.int32)

    def reference(w, x):
        h = x
        for layer in range(num_layers):
            h = _toy_layer(UNSHARDED, jax.tree.map(lambda a: a[layer], w), h, position)
        return jnp.sum(h**2)

    return (w, x, position), jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(w, x)


@pytest.mark.parametrize(
    "mesh_spec, num_layers, stage_layers, repeats, microbatches, unpadded",
    [
        ("stage=2,fsdp=4", 4, (3, 1), 1, 2, True),  # uneven GPipe
        ("stage=4,fsdp=2", 12, (5, 3, 2, 2), 1, 4, True),  # uneven GPipe, 4 stages, a row moved between stages
        ("stage=4,fsdp=2", 12, (5, 3, 2, 2), 2, 4, True),  # uneven circular
        ("stage=4,fsdp=2", 6, None, 1, 4, True),  # default split 2,2,1,1
        ("stage=2,data=2,fsdp=2", 8, None, 2, 4, True),  # even circular with data parallelism
        ("stage=4,tensor=2", 7, (4, 1, 1, 1), 1, 4, True),  # no fsdp: rows over stage only, three moved
        ("stage=2,fsdp=4", 7, (5, 2), 1, 4, True),  # a row moved to another g (no spare row at its own)
        ("stage=2,fsdp=4", 4, None, 2, 4, True),  # circular, K = 1 of K' = 2: the real slots all-reduced
        ("stage=4,fsdp=2", 12, (5, 3, 2, 2), 2, 4, False),  # the padded [stage, slot, ...] layout still runs
        ("stage=2,data=2,fsdp=2", 8, None, 2, 4, False),
    ],
)
def test_pipeline_matches_the_sequential_stack(mesh_spec, num_layers, stage_layers, repeats, microbatches, unpadded):
    plan, (loss, grads, applied), (ref_loss, ref_grads) = _toy(
        mesh_spec, num_layers, stage_layers, repeats, microbatches, unpadded=unpadded
    )
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_close(grads, ref_grads)
    assert tuple(np.asarray(applied)) == plan.layer_applications()


def test_a_stage_with_fewer_layers_applies_fewer_layers():
    plan, (_, _, applied), _ = _toy("stage=2,fsdp=4", 4, (3, 1), 1, 4)
    # 4 microbatches through 3 and 1 layers: the empty slots of stage 1 (and bubble steps) are skipped.
    assert np.asarray(applied).tolist() == [12, 4]
    assert plan.layout.slots * plan.steps > 4


def test_restore_relayout_moves_rows_between_stages_without_gathering():
    mesh = make_mesh(parse_mesh("stage=4,fsdp=2", 8))
    dst, _ = pl.plan_layout(8, 4, 1, (3, 3, 1, 1))
    cases = [
        (None, (8, 6, 4), P("stage", None, "fsdp")),  # canonical, rows split over stage
        (pl.plan_layout(8, 2)[0], (2, 4, 6, 4), P(None, None, None, "fsdp")),  # stage=2 layout: not split
        (pl.plan_layout(8, 4, 2)[0], (4, 2, 6, 4), P("stage")),
    ]  # circular layout, split
    for src, shape, spec in cases:
        x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        target = NamedSharding(mesh, P("stage", None, None, "fsdp"))
        fn = jax.jit(lambda a, src=src: pl.relayout_on_mesh([a], src, dst, 8, mesh)[0], out_shardings=target)
        arg = jax.device_put(x, NamedSharding(mesh, spec))
        np.testing.assert_array_equal(np.asarray(fn(arg)), np.asarray(pl.relayout(jnp.asarray(x), src, dst, 8)))
        if spec[0] == "stage":
            text = fn.lower(arg).compile().as_text()
            assert "all-gather" not in text and "collective-permute" in text


def test_a_collective_permute_inside_a_skipped_slot_is_detected():
    """A conditional that stages take differently holding a transfer between stages is flagged unsafe.

    (The pipeline no longer leaves the partitioner a reason to put one there: weights arrive gathered;
    the program here builds one on purpose and is compiled, never run.)"""
    mesh = make_mesh(parse_mesh("stage=2,fsdp=2,tensor=2", 8))

    def stage_program(x):
        stage = jax.lax.axis_index("stage")
        send = lambda x: jax.lax.ppermute(x, "stage", [(0, 1), (1, 0)])  # noqa: E731
        return jax.lax.cond(stage == 0, send, lambda x: x, x)

    program = jax.shard_map(stage_program, mesh=mesh, in_specs=P("stage"), out_specs=P("stage"), axis_names={"stage"})
    text = jax.jit(program).lower(jnp.zeros((2, 16))).compile().as_text()
    found = branch_collectives(text, mesh)
    assert any(c.op == "collective-permute" and not c.safe for c in found)


def test_device_groups_read_every_replica_group_format():
    """Listed and iota groups (jax 0.10), and the mesh-axes form jax 0.12 prints, give the same groups."""
    from sharding.hlo import device_groups

    mesh = "mesh['data'=1,'stage'=2,'fsdp'=2,'sequence'=2,'tensor'=1]"
    assert device_groups(f"x), replica_groups={mesh} {{'sequence'}}, dimensions={{1}}") == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    assert device_groups(f"x), replica_groups={mesh} {{'stage','sequence'}}") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert device_groups("x), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert device_groups("x), replica_groups={{0,2},{1,3}}, dimensions={0}") == [[0, 2], [1, 3]]


# The model ---------------------------------------------------------------------------------------


def _batch(batch, length, seed=0, unmasked=1.0):
    """A packed batch (documents of ~20 tokens); ``unmasked``: the share of positions the loss counts."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 512, (batch, length)).astype(np.int32)
    segments = np.cumsum(rng.random((batch, length)) < 0.05, axis=1).astype(np.int32)
    starts = np.concatenate([np.ones((batch, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    index = np.arange(length)[None].repeat(batch, 0)
    positions = (index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)).astype(np.int32)
    return {
        "tokens": tokens,
        "targets": np.roll(tokens, -1, 1),
        "positions": positions,
        "segment_ids": segments,
        "loss_mask": (rng.random((batch, length)) < unmasked).astype(np.float32),
    }


def _loss_and_grads(trainer, batch, compiled=None):
    """Loss and gradients (layers in canonical order) of ``trainer``'s model at its initial parameters;
    ``compiled``: the gradient step already compiled for ``trainer`` at ``batch``'s shapes, run instead of
    compiling the same program again."""
    state = trainer.init_state(0)
    if compiled is not None:
        shapes = trainer.abstract_batch(*batch["tokens"].shape)
        batch = {k: jax.device_put(v, shapes[k].sharding) for k, v in batch.items()}
        (loss, _), grads = compiled(state["params"], batch)
    else:

        def fn(params, batch):
            return jax.value_and_grad(trainer.loss_sums, has_aux=True)(params, batch)

        (loss, _), grads = jax.jit(fn)(state["params"], batch)
    layers = jax.tree.map(lambda g: pl.relayout(g, trainer.storage, None, trainer.config.num_layers), grads["layers"])
    return float(loss), {**grads, "layers": layers}


def _trainer(config, mesh_spec, plan=None, microbatches=1):
    return Trainer(
        config,
        OptimizerConfig(),
        Parallelism.of(make_mesh(parse_mesh(mesh_spec, 8)), RULES, Accumulation(microbatches), pipeline=plan),
    )


@pytest.mark.parametrize(
    "num_layers, mesh_spec, stage_layers, repeats, microbatches",
    [
        (4, "stage=2,fsdp=4", (3, 1), 1, 2),  # GPipe, uneven, stage=2
        (12, "stage=4,fsdp=2", (5, 3, 2, 2), 2, 4),  # circular, uneven, stage=4
    ],
)
def test_the_pipelined_model_has_the_loss_and_gradients_of_the_unpipelined_one(
    num_layers, mesh_spec, stage_layers, repeats, microbatches
):
    ref_loss, ref_grads = _flat_loss_and_grads(num_layers)
    trainer, compiled = _compiled_gradients(num_layers, mesh_spec, stage_layers, repeats, microbatches, 8, 32)
    loss, grads = _loss_and_grads(trainer, _batch(8, 32), compiled)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)


@functools.cache
def _compiled_gradients(num_layers, mesh_spec, stage_layers, repeats, microbatches, batch, length):
    """The pipelined test model's trainer and its gradient step (``loss_sums`` and its gradients), compiled
    once for a ``[batch, length]`` batch and shared by the tests that run it or read its compiled program."""
    config = get_config("test", [f"num_layers={num_layers}"])
    layout, _ = pl.plan_layout(num_layers, parse_mesh(mesh_spec, 8)["stage"], repeats, stage_layers)
    trainer = _trainer(config, mesh_spec, pl.PipelinePlan(layout, microbatches))
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), trainer.state_params, trainer.param_shardings
    )
    grad_fn = jax.jit(lambda p, b: jax.value_and_grad(trainer.loss_sums, has_aux=True)(p, b))
    return trainer, grad_fn.lower(params, trainer.abstract_batch(batch, length)).compile()


@cached
def _flat_loss_and_grads(num_layers=4):
    """The unpipelined test model's (``num_layers`` layers) loss and gradients on ``_batch(8, 32)`` (computed
    once per layer count and module)."""
    return _loss_and_grads(_trainer(get_config("test", [f"num_layers={num_layers}"]), "fsdp=8"), _batch(8, 32))


@pytest.mark.parametrize(
    "attention, mesh_spec, schedule",
    [
        ("flash", "stage=2,fsdp=2,tensor=2", "gpipe"),  # heads split over tensor inside the stage program
        ("ring", "stage=2,fsdp=2,sequence=2", "gpipe"),  # keys and values around the sequence ring inside a stage
        ("ulysses", "stage=2,fsdp=2,sequence=2", "gpipe"),  # all-to-all over sequence inside a stage
        ("flash", "stage=2,fsdp=2,tensor=2", "1f1b"),  # the kernels inside 1F1B's forward and backward ticks
        ("flash", "stage=2,fsdp=2,tensor=2", "zb"),  # the kernel's backward inside zero bubble's input gradient
        ("ring", "stage=2,fsdp=2,sequence=2", "1f1b"),
    ],
)
def test_attention_kernels_inside_stages_match_the_flat_reference_attention(attention, mesh_spec, schedule):
    """Each kernel's map opens over the axes the stage program leaves automatic; loss and gradients equal
    the unpipelined model's with plain attention, for GPipe, 1F1B and zero bubble. As at start-up
    (`train.setup.strategy_setup.check_compiled`), a transfer inside a skipped slot (ring's) makes the pipeline
    compute every slot instead."""
    from train.setup.strategy_setup import check_compiled as checked_pipeline

    batch = _batch(8, 32)
    ref_loss, ref_grads = _flat_loss_and_grads()
    layout, _ = pl.plan_layout(4, 2, 1, (3, 1))
    trainer = _trainer(
        get_config("test", [f"attention={attention}"]),
        mesh_spec,
        pl.PipelinePlan(layout, 2, schedule=schedule),
    )
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), trainer.state_params, trainer.param_shardings
    )
    grad_fn = jax.jit(lambda p, b: jax.value_and_grad(trainer.loss_sums, has_aux=True)(p, b))
    compiled = grad_fn.lower(params, trainer.abstract_batch(8, 32)).compile()
    checked, note = checked_pipeline(trainer.par, compiled.as_text())
    assert (note is not None) == (attention == "ring"), note
    if note:
        assert "collective-permute" in note and not checked.pipeline.skip_empty
        trainer, compiled = Trainer(trainer.config, OptimizerConfig(), checked), None
    # the checked program is the one run where the check kept the plan: not compiled a second time
    loss, grads = _loss_and_grads(trainer, batch, compiled)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)


def test_flash_inside_a_map_manual_over_the_batch_axes_opens_its_own_over_tensor_only():
    """The kernel's map nested in one manual over data and fsdp (heads split over tensor, no segment ids):
    values and gradients equal the one-device reference attention."""
    from models.attention_kernels import sharded_flash_attention
    from models.attention_reference import reference_attention

    mesh = make_mesh(parse_mesh("data=2,fsdp=2,tensor=2", 8))
    par = Parallelism.of(mesh, RULES)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (4, 64, 4, 32))
    k, v = (jax.random.normal(key, (4, 64, 2, 32)) for key in keys[1:])
    batch = P(("data", "fsdp"))
    run = jax.shard_map(
        lambda q, k, v: sharded_flash_attention(q, k, v, None, par=par.inside(("data", "fsdp"))),
        mesh=mesh,
        in_specs=batch,
        out_specs=batch,
        axis_names={"data", "fsdp"},
    )
    out, grads = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(run(q, k, v) ** 2), argnums=(0, 1, 2)))(q, k, v)
    ref, ref_grads = jax.value_and_grad(lambda q, k, v: jnp.sum(reference_attention(q, k, v) ** 2), argnums=(0, 1, 2))(
        q, k, v
    )
    np.testing.assert_allclose(float(out), float(ref), rtol=1e-5)
    assert_close(grads, ref_grads)


def test_layer_weights_are_gathered_once_per_step_and_their_gradients_reduced_once():
    """Outside the pipeline's loops: the rows stored for another stage sent once, each layer weight
    all-gathered once (the stage's working copy), each layer gradient reduce-scattered once and the moved rows'
    gradients sent back once; only the stage-to-stage activation transfers run per step of the loop."""
    from sharding.hlo import collectives

    config = get_config("test", ["num_layers=12"])
    layout, _ = pl.plan_layout(12, 4, 1, (5, 3, 2, 2))
    trainer = _trainer(config, "stage=4,fsdp=2", pl.PipelinePlan(layout, 4))
    placement = trainer.storage.placement
    assert placement.received == 1  # stage 0 keeps 4 of its 5 layers; the fifth arrives from another stage
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), trainer.state_params, trainer.param_shardings
    )
    grad_fn = jax.jit(lambda p, b: jax.value_and_grad(trainer.loss_sums, has_aux=True)(p, b))
    text = grad_fn.lower(params, trainer.abstract_batch(16, 32)).compile().as_text()
    found = collectives(text)
    in_loops = sorted({c.op for c in found if c.executions > 1})
    assert in_loops == ["collective-permute"], in_loops

    layer_leaves = jax.tree.leaves(trainer.abstract_params["layers"])
    per_layer = sum(x.size // x.shape[0] * x.dtype.itemsize for x in layer_leaves)
    other = sum(
        x.size * x.dtype.itemsize
        for k, v in trainer.abstract_params.items()
        if k != "layers"
        for x in jax.tree.leaves(v)
    )
    working = layout.repeats * placement.chunk_slots  # slots of the working copy (6: 5 rounded up to fsdp=2)
    gathered = sum(c.total_bytes for c in found if c.op == "all-gather")
    assert working * per_layer <= gathered <= 1.2 * (working * per_layer + other)
    # An integer permute moves token ids to the devices that look them up (under a pipeline the embedding
    # reads its table as the rules lay it out, sharding.vocab); the rows' permutes move floating-point weights.
    integer = {m.group(1).lstrip("%") for m in re.finditer(r"(\S+) = \(?[su]\d+\[", text)}
    once = [c for c in found if c.op == "collective-permute" and c.executions == 1]
    assert sum(c.name.lstrip("%") in integer for c in once) <= 1, [c.name for c in once]
    moved = sum(c.total_bytes for c in once if c.name.lstrip("%") not in integer)
    assert moved == 2 * placement.received * per_layer  # there and back, once each
    scattered = [c for c in found if c.op == "reduce-scatter"]
    assert len(scattered) == len(layer_leaves)  # one per layer parameter, each once per step
    assert sum(c.total_bytes for c in scattered) == working * per_layer // 2  # each device's fsdp=2 piece


def test_the_head_runs_on_a_stages_share_of_the_rows_not_on_every_stage(monkeypatch):
    """Final norm, output projection and loss on 1/S of each device's rows: the compiled step's FLOPs
    (``cost_analysis``, deterministic; the head sits outside the pipeline's loops, so it is counted whole)
    drop by (1 - 1/S) of the head's products against the same step with the head replicated over stage."""
    import models.transformer
    import sharding.pipeline.onef1b

    config = get_config("test", ["num_layers=4"])
    batch, length = 8, 32

    def flops(compiled):
        analysis = compiled.cost_analysis()
        return float((analysis[0] if isinstance(analysis, (list, tuple)) else analysis)["flops"])

    # the step as the rules build it: the one the loss-and-gradients test runs (compiled once for both)
    split = flops(_compiled_gradients(4, "stage=2,fsdp=4", (3, 1), 1, 2, batch, length)[1])
    monkeypatch.setattr(models.transformer, "head_parallelism", lambda par: par)
    monkeypatch.setattr(sharding.pipeline.onef1b, "head_parallelism", lambda par: par)  # the loss's head
    # not through the cache: the patched head is another program
    replicated = flops(_compiled_gradients.__wrapped__(4, "stage=2,fsdp=4", (3, 1), 1, 2, batch, length)[1])
    rows = batch // 4  # per device over fsdp=4, before the split over stage=2
    head = 3 * 2 * rows * length * config.embed_dim * config.vocab_size  # logits forward, and both backward products
    assert replicated - split == pytest.approx(head / 2, rel=0.05), (replicated, split, head)


@pytest.mark.parametrize(
    ("mesh", "batch", "where"),
    [
        ("stage=2,fsdp=4", 16, "rows split over fsdp+stage, 2 of"),
        ("stage=2,tensor=4", 3, "computed by every stage (batch 3"),
    ],
)
def test_the_reports_head_line_says_where_the_head_runs_also_for_rows_nothing_splits(mesh, batch, where):
    """A batch that no batch axis divides (3 rows on stage=2,tensor=4) has the empty spec ``P()``: the report
    used to index its first entry and end the run's start-up in an IndexError."""
    from types import SimpleNamespace

    layout, _ = pl.plan_layout(4, 2)
    par = Parallelism(parse_mesh(mesh, 8), get_rules("fsdp_tp"), pipeline=pl.PipelinePlan(layout, batch))
    assert where in report.head_line(SimpleNamespace(par=par), batch)


@functools.cache
def _canonical_init_params():
    """The 6-layer test model's parameters in canonical order from key 3 (both layouts compare with it; only read)."""
    return jax.jit(lambda k: init_params(get_config("test", ["num_layers=6"]), k))(jax.random.key(3))


@pytest.mark.parametrize("unpadded", [True, False])
def test_initial_parameters_do_not_depend_on_the_layout(unpadded):
    config = get_config("test", ["num_layers=6"])
    layout, _ = pl.plan_layout(6, 4)
    layout = StageStorage(layout, 2) if unpadded else layout
    key = jax.random.key(3)
    staged = jax.jit(lambda k: init_params(config, k, stack_table(layout, 6)))(key)
    canonical = _canonical_init_params()
    relaid = jax.tree.map(lambda x: pl.relayout(x, None, layout, 6), canonical["layers"])
    for a, b in zip(jax.tree.leaves(staged["layers"]), jax.tree.leaves(relaid), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(staged["embed"]["embedding"]), np.asarray(canonical["embed"]["embedding"]))


@pytest.mark.parametrize("num_layers, stage_layers, repeats", [(16, (7, 5, 2, 2), 1), (16, (6, 6, 2, 2), 2)])
def test_the_state_of_an_uneven_split_is_spread_evenly_over_every_device(num_layers, stage_layers, repeats):
    """Persistent bytes per device (the compiled step's arguments less the batch) are the state over the
    devices: no stage holds the largest stage's slots, and the optimizer state follows the parameters."""
    config = get_config("test", [f"num_layers={num_layers}"])
    layout, _ = pl.plan_layout(num_layers, 4, repeats, stage_layers)
    trainer = _trainer(config, "stage=4,fsdp=2", pl.PipelinePlan(layout, 4))
    memory = report.stage_memory(trainer)
    per_layer = (2 * 128 * 4 * 32 + 2 * 128 * 2 * 32 + 3 * 128 * 384 + 2 * 128) * 4  # bytes of one layer
    assert memory["row_bytes"] == per_layer and memory["per_device"] == 2  # 16 whole layers over 8 devices
    state = trainer.abstract_state()  # parameters and AdamW's moments (laid out as their parameters)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    local = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))
    compiled = trainer.compile_train_step(8, 32)
    batch = trainer.abstract_batch(8, 32)
    batch_bytes = sum(x.size * x.dtype.itemsize for x in batch.values()) // 2  # batch split over fsdp=2 only
    signal_bytes = 4  # one int32 stop flag per device
    arguments = compiled.memory_analysis().argument_size_in_bytes - batch_bytes - signal_bytes
    assert arguments == local
    assert state_bytes / 8 <= arguments <= 1.1 * state_bytes / 8
    assert all(c.safe for c in branch_collectives(compiled.as_text(), trainer.mesh))


def _layer_leaf(path) -> bool:
    return any(getattr(key, "key", None) == "layers" for key in path)


def _canonical(state, layout, num_layers):
    """The state's leaves in canonical order (layer stacks re-laid from ``layout``), as NumPy arrays."""
    return [
        np.asarray(pl.relayout(x, layout, None, num_layers) if _layer_leaf(path) else x)
        for path, x in jax.tree_util.tree_leaves_with_path(state)
    ]


def _distinct(state, shardings):
    """``state`` with every float leaf moved off its initial values (the AdamW moments are zero at step 0)."""

    def move(path, x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        key = jax.random.fold_in(jax.random.key(7), len(jax.tree_util.keystr(path)))
        return x + jax.random.normal(key, x.shape, x.dtype)

    return jax.jit(lambda s: jax.tree_util.tree_map_with_path(move, s), out_shardings=shardings)(state)


@pytest.mark.parametrize("saved", ["padded", "unpadded"])
def test_a_pipelined_checkpoint_restores_onto_other_meshes_and_layouts(tmp_path, saved):
    """A checkpoint of the padded ``[stage, slot, ...]`` layout (saved before the unpadded storage) or of the
    unpadded storage restores onto the storage of another stage split and mesh, onto the per-microbatch
    gather's storage (rows over stage alone, features over fsdp), and onto a flat mesh, with every value
    (parameters and AdamW moments) in place."""
    from checkpoints.manager import CheckpointManager, restore_state
    from checkpoints.meta import RunMeta

    config = get_config("test", ["num_layers=6"])
    layout, _ = pl.plan_layout(6, 4, 1, (3, 1, 1, 1))
    source = _trainer(config, "stage=4,fsdp=2", pl.PipelinePlan(layout, 4))
    stored = layout if saved == "padded" else source.storage
    shardings = source._layout_state(stored)[3]
    state = _distinct(jax.jit(lambda: source._init_fn(0, stored), out_shardings=shardings)(), shardings)
    meta = RunMeta(
        model=config.to_dict(),
        preset="test",
        mesh={"stage": 4, "fsdp": 2},
        rules={},
        data={},
        tokenizer={},
        pipeline=stored.to_meta(),
    )
    manager = CheckpointManager(tmp_path / "ckpt", async_save=False)
    manager.save(1, state, meta.to_json())
    expected = _canonical(state, stored, 6)
    targets = [
        _trainer(config, "stage=2,fsdp=4", pl.PipelinePlan(pl.plan_layout(6, 2, 1, (4, 2))[0], 4)),
        _trainer(config, "stage=2,data=2,fsdp=2", pl.PipelinePlan(pl.plan_layout(6, 2, 2)[0], 4)),
        _trainer(config, "stage=2,fsdp=4", pl.PipelinePlan(pl.plan_layout(6, 2, 1, (4, 2))[0], 4, gather="microbatch")),
        _trainer(config, "fsdp=8"),
    ]
    try:
        for target in targets:
            restored, restored_meta = restore_state(manager, target, 1)
            assert restored_meta.pipeline == stored.to_meta()
            for got, want in zip(_canonical(restored, target.storage, 6), expected, strict=True):
                np.testing.assert_array_equal(got, want)
            assert [x.sharding for x in jax.tree.leaves(restored)] == jax.tree.leaves(target.state_shardings)
    finally:
        manager.close()


# Through the CLI -------------------------------------------------------------------------------

SMALL = [
    "--model",
    "test",
    "--seq-len",
    "64",
    "--batch-size",
    "8",
    "--no-progress",
    "--eval-batches",
    "0",
    "--log-every",
    "1",
    "--warmup",
    "1",
    "--eval-every",
    "0",
    "--decay-steps",
    "8",
]


def _run(args, corpus, cache):
    return train.main([*SMALL, "--data", str(corpus), "--data-cache", str(cache), *args])


def _losses(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r}


def test_dry_run_reports_bubble_layers_padding_and_branch_collectives(capsys):
    code = train.main(
        [
            "--model",
            "test",
            "--mesh",
            "stage=2,fsdp=4",
            "--stage-layers",
            "3,1",
            "--microbatches",
            "2",
            "--batch-size",
            "8",
            "--seq-len",
            "32",
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "bubble (S-1)/(R*M+S-1) = 1/3 = 33.3% of 3 steps" in out
    assert "layer parameters stored unpadded: 8 rows (4 empty) split over stage x 4 devices" in out
    assert "the stages with fewer layers than 3 hold no padding" in out
    assert "layers,embed,mlp" in out and "(('stage', 'fsdp'), None)" in out
    assert "collectives inside skipped-slot branches:" in out and "all among devices of one stage" in out
    assert "final norm, output projection and loss: rows split over fsdp+stage, 1 of the batch's 8 per device" in out
    assert "compute per device per step:" in out
    # compiled once, at start-up's check: the dry run's line reports that time, not the cache's near-zero
    startup = float(out.split("compiled the train step in ")[1].split(" s")[0])
    assert f"compiled one train step (batch 8 x 32) in {startup:.1f} s (at start-up, above;" in out


def test_a_checkpoint_resumes_across_stage_layouts_with_the_same_next_loss(tmp_path, corpus, cache):
    layers = ["--set", "num_layers=6"]
    staged = ["--mesh", "stage=4,fsdp=2", "--stage-layers", "2,2,1,1", "--microbatches", "4", *layers]
    flat = ["--mesh", "fsdp=8", *layers]
    a, b = tmp_path / "a", tmp_path / "b"
    assert _run([*staged, "--steps", "3", "--ckpt-every", "2", "--run-dir", str(a)], corpus, cache) == 0
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "3")  # b resumes from step 2, saved on stage=4
    lines = (b / "metrics.jsonl").read_text().splitlines()
    (b / "metrics.jsonl").write_text("".join(f"{x}\n" for x in lines if json.loads(x).get("step", 0) <= 2))
    assert _run([*flat, "--steps", "3", "--resume", "--run-dir", str(b)], corpus, cache) == 0
    np.testing.assert_allclose(_losses(b)[3], _losses(a)[3], rtol=1e-5)

    c = tmp_path / "c"
    shutil.copytree(b, c)  # c resumes from step 3, saved on stage=1, onto stage=4
    assert _run([*staged, "--steps", "4", "--resume", "--run-dir", str(c)], corpus, cache) == 0
    assert _run([*flat, "--steps", "4", "--resume", "--run-dir", str(b)], corpus, cache) == 0
    np.testing.assert_allclose(_losses(c)[4], _losses(b)[4], rtol=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--mesh", "stage=8", "--microbatches", "8"],
            "--mesh stage=8: the model has 4 layers, fewer than the 8 stages",
        ),
        (
            ["--mesh", "stage=2,fsdp=4", "--stage-layers", "3,2", "--microbatches", "2"],
            "--stage-layers 3,2 sums to 5, but the model has 4 layers; e.g. --stage-layers 2,2",
        ),
        (
            ["--mesh", "stage=2,fsdp=4", "--stage-layers", "4,0", "--microbatches", "2"],
            "every stage needs at least one layer",
        ),
        (
            ["--mesh", "stage=2,fsdp=4", "--stage-layers", "2,1,1", "--microbatches", "2"],
            "--stage-layers 2,1,1: 3 entries, but --mesh stage=2 needs 2",
        ),
        # the example is a split of this model (4 layers) over its stages, not the 7B's 10,10,6,6
        (
            ["--mesh", "stage=2,fsdp=4", "--stage-layers", "two,two"],
            "--stage-layers 'two,two': expected comma-separated layer counts, e.g. --stage-layers 2,2",
        ),
        (["--mesh", "stage=2,fsdp=4", "--stage-layers", ""], "--stage-layers '': expected"),
        (
            ["--mesh", "stage=2,fsdp=4", "--microbatches", "2", "--pipeline-repeats", "2"],
            "--pipeline-repeats 2 needs --pipeline-schedule circular, 1f1b or 1f1b-fused (interleaved)",
        ),
        (
            ["--mesh", "stage=4,fsdp=2", "--microbatches", "2"],
            "--microbatches 2: fewer microbatches than the 4 pipeline stages (--mesh stage=4)",
        ),
        (["--mesh", "stage=4,fsdp=2", "--microbatches", "2", "--batch-size", "4"], "use --microbatches 4"),
        (["--mesh", "stage=2,fsdp=4", "--microbatches", "3"], "--batch-size 8 is not divisible by --microbatches 3"),
        (
            ["--mesh", "stage=2,fsdp=4", "--microbatches", "4"],
            "--batch-size 8 / --microbatches 4 = 2 sequences per microbatch, not divisible by the data-parallel size",
        ),
        (
            [
                "--mesh",
                "stage=4,fsdp=2",
                "--microbatches",
                "4",
                "--pipeline-schedule",
                "circular",
                "--pipeline-repeats",
                "1",
            ],
            "--pipeline-schedule circular needs --pipeline-repeats of 2 or more",
        ),
        (
            ["--mesh", "stage=4,fsdp=2", "--microbatches", "4", "--pipeline-schedule", "circular"],
            "--pipeline-schedule circular: 4 stages x 2 repeats = 8 chunks, more than the 4 layers, and circular "
            "needs 2 or more per stage; use --pipeline-schedule gpipe",
        ),
        (
            [
                "--mesh",
                "stage=2,fsdp=4",
                "--microbatches",
                "2",
                "--pipeline-schedule",
                "circular",
                "--pipeline-repeats",
                "3",
            ],
            "--pipeline-repeats 3: 2 stages x 3 repeats = 6 chunks, more than the 4 layers; use --pipeline-repeats 2",
        ),
        (["--mesh", "fsdp=8", "--stage-layers", "4"], "--stage-layers needs a pipeline: add a stage axis"),
    ],
)
def test_bad_pipeline_input_fails_before_compiling_with_the_flag_named(tmp_path, args, message, corpus, cache, capsys):
    code = _run([*args, "--steps", "2", "--run-dir", str(tmp_path / "r")], corpus, cache)
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


@pytest.mark.parametrize(
    ("schedule", "gather", "stage_layers"),
    [("gpipe", "once", "3,1"), ("1f1b", "once", "3,1"), ("zb", "microbatch", "3,1"), ("1f1b", "once", "2,1")],
)
def test_a_bfloat16_pipeline_compiles(schedule, gather, stage_layers):
    """XLA's CPU compiler aborted on the bfloat16 sum over ``stage`` of the pipeline's outputs and of its
    inputs' cotangents (``AllReducePromotion``: "Invalid binary instruction opcode copy"); the pipeline sums
    them in float32 (exact: one stage's are nonzero). It aborted the same way on the per-microbatch gather's
    bfloat16 reduce-scatter of each layer's gradient, which now reduces in the float32 of the sums (zero
    bubble: both the input- and the weight-gradient passes). In a subprocess: the abort would end the test
    session. Two layers a stage over fsdp=4 pad the working copy to 4 slots: its two real ones are assembled by
    an all-reduce, of bfloat16 bit patterns (`sharding.pipeline.padding.sum_owned`)."""
    import subprocess
    import sys

    args = [
        "--cpu-devices",
        "8",
        "--model",
        "test",
        "--mesh",
        "stage=2,fsdp=4",
        "--stage-layers",
        stage_layers,
        "--set",
        f"num_layers={sum(map(int, stage_layers.split(',')))}",
        "--microbatches",
        "4",
        "--batch-size",
        "16",
        "--seq-len",
        "32",
        "--dry-run",
        "--pipeline-schedule",
        schedule,
        "--pipeline-gather",
        gather,
        "--set",
        "dtype=bfloat16",
    ]
    done = subprocess.run([sys.executable, "-m", "train.train", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "temporaries" in done.stdout and "empty slots are not computed (skipped by a conditional)" in done.stdout


def test_a_pipeline_with_uneven_context_shares_compiles_its_check_at_the_padded_length(monkeypatch):
    """The pipeline's compiled check (collectives in skipped slots) compiled the step at --seq-len, not at the
    padded length the run feeds (each device's block padded to the largest share), and ring attention refused
    its blocks: 'a device block of 16 tokens cannot hold shares [24, 8]'. (The compile itself is replaced: the
    length it is asked for is the point.)"""
    from types import SimpleNamespace

    from train.setup import cli
    from train.train import build_trainer, prepare

    argv = ["--model", "test", "--set", "num_layers=2", "--mesh", "stage=2,context=2,fsdp=2", "--attention", "ring"]
    argv += ["--context-shares", "3,1", "--microbatches", "2", "--batch-size", "4", "--seq-len", "32", "--dry-run"]
    config, _ = prepare(cli.parse(argv), jax.devices(), lambda _: None)
    asked = []

    def compile_train_step(self, *shape):
        asked.append(shape)
        return SimpleNamespace(as_text=str)

    monkeypatch.setattr(Trainer, "compile_train_step", compile_train_step)
    trainer = build_trainer(config, lambda _: None)
    assert trainer.par.context_shares == (24, 8) and asked == [(4, 48)]


def test_collectives_in_skipped_slots_are_one_short_note_and_every_slot_computed(monkeypatch):
    """The note listed every collective-permute by name (19 for a ring-attention pipeline, a line of 1,500
    characters) and was printed twice: as a Python warning with its source line, and in the start-up report."""
    import train.setup.strategy_setup as strategy
    from sharding.hlo import BranchCollective

    found = [BranchCollective("collective-permute", f"ppermute.{i}", None, False) for i in range(19)]
    monkeypatch.setattr(strategy, "branch_collectives", lambda text, mesh: found)
    layout, _ = pl.plan_layout(4, 2)
    par = Parallelism(parse_mesh("stage=2,fsdp=4", 8), get_rules("fsdp_tp"), pipeline=pl.PipelinePlan(layout, 2))
    checked, note = strategy.check_compiled(par, "")
    assert not checked.pipeline.skip_empty
    assert note.startswith(
        "pipeline: the partitioner put 19 collective-permute (ppermute.0, ppermute.1, ppermute.10, ...) inside "
        "skipped layer slots"
    ), note


@pytest.mark.parametrize(
    ("mesh", "said"),
    [("stage=2,fsdp=4", "all-gathers its stage's rows"), ("stage=2,tensor=4", "nothing to all-gather")],
)
def test_the_weights_line_says_an_all_gather_only_where_a_batch_axis_splits_the_rows(mesh, said):
    """Gathering once with no batch axis splitting the stored rows (stage=2,tensor=4), the report described an
    all-gather over the storage's batch axes that does not run."""
    layout, _ = pl.plan_layout(4, 2)
    trainer = _trainer(get_config("test"), mesh, pl.PipelinePlan(layout, 2))
    line = report.weight_gather_line(trainer)
    assert said in line and ("all-gathers" in line) == (said != "nothing to all-gather"), line
