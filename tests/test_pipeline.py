"""Pipeline parallelism over the ``stage`` axis: layouts, equality with the unpipelined model, work, memory,
checkpoints across stage layouts, and refused flags."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from models.config import get_config
from models.transformer import init_params
from sharding import pipeline as pl
from sharding.mesh import make_mesh, parse_mesh
from sharding.hlo import branch_collectives
from sharding.parallel import UNSHARDED, Accumulation, Parallelism
from sharding.rules import get_rules
from train import report, train
from train.optimizer import OptimizerConfig
from train.step import Trainer

RULES = get_rules("fsdp_tp")


def assert_close(actual, expected, rtol=1e-5):
    """float32 agreement to ``rtol`` of each array's largest magnitude (entries near zero included)."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * float(np.max(np.abs(e)) or 1.0))


# Layouts (no devices) ---------------------------------------------------------------


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


# The pipeline on a toy layer (sharding only) ----------------------------------------------


def _toy_layer(par, w, h, position):
    h = jnp.tanh(h @ w["a"] + w["b"] + 0.01 * position[:, None])
    return par.constrain(h, ("batch", "act_embed"))


def _toy(mesh_spec, num_layers, stage_layers, repeats, microbatches, batch=16, dim=16):
    """Loss, gradients and layer applications of the pipelined toy, and the sequential reference's."""
    mesh = make_mesh(parse_mesh(mesh_spec, 8))
    rules = pl.pipeline_rules(RULES)
    layout, _ = pl.plan_layout(num_layers, mesh.shape["stage"], repeats, stage_layers)
    plan = pl.PipelinePlan(layout, microbatches)
    rng = np.random.default_rng(0)
    w = {"a": rng.normal(size=(num_layers, dim, dim)).astype(np.float32) / 4,
         "b": rng.normal(size=(num_layers, dim)).astype(np.float32)}
    x = rng.normal(size=(batch, dim)).astype(np.float32)
    position = jnp.asarray(rng.integers(0, 9, size=(batch,)), jnp.int32)

    def reference(w, x):
        h = x
        for layer in range(num_layers):
            h = _toy_layer(UNSHARDED, jax.tree.map(lambda a: a[layer], w), h, position)
        return jnp.sum(h**2)

    def pipelined(w, x):
        y, applied = pl.run_pipeline(_toy_layer, w, x, (position,), Parallelism.of(mesh, rules, plan),
                                     names={"a": ("layers", None, "embed"), "b": ("layers", None)})
        return jnp.sum(y**2), applied

    staged = jax.tree.map(lambda a: pl.relayout(jnp.asarray(a), None, layout, num_layers), w)
    staged = jax.device_put(staged, {"a": NamedSharding(mesh, P("stage", None, "fsdp")),
                                     "b": NamedSharding(mesh, P("stage"))})
    (loss, applied), grads = jax.jit(jax.value_and_grad(pipelined, argnums=(0, 1), has_aux=True))(staged, x)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(w, x)
    grads = (jax.tree.map(lambda g: pl.relayout(g, layout, None, num_layers), grads[0]), grads[1])
    return plan, (loss, grads, applied), (ref_loss, ref_grads)


@pytest.mark.parametrize(
    "mesh_spec, num_layers, stage_layers, repeats, microbatches",
    [
        ("stage=2,fsdp=4", 4, (3, 1), 1, 2),  # uneven GPipe
        ("stage=4,fsdp=2", 12, (5, 3, 2, 2), 1, 4),  # uneven GPipe, 4 stages
        ("stage=4,fsdp=2", 12, (5, 3, 2, 2), 2, 4),  # uneven circular
        ("stage=4,fsdp=2", 6, None, 1, 4),  # default split 2,2,1,1
        ("stage=2,data=2,fsdp=2", 8, None, 2, 4),  # even circular with data parallelism
    ],
)
def test_pipeline_matches_the_sequential_stack(mesh_spec, num_layers, stage_layers, repeats, microbatches):
    plan, (loss, grads, applied), (ref_loss, ref_grads) = _toy(
        mesh_spec, num_layers, stage_layers, repeats, microbatches
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
    cases = [(None, (8, 6, 4), P("stage", None, "fsdp")),  # canonical, rows split over stage
             (pl.plan_layout(8, 2)[0], (2, 4, 6, 4), P(None, None, None, "fsdp")),  # stage=2 layout: not split
             (pl.plan_layout(8, 4, 2)[0], (4, 2, 6, 4), P("stage"))]  # circular layout, split
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

    program = jax.shard_map(stage_program, mesh=mesh, in_specs=P("stage"), out_specs=P("stage"),
                            axis_names={"stage"})
    text = jax.jit(program).lower(jnp.zeros((2, 16))).compile().as_text()
    found = branch_collectives(text, mesh)
    assert any(c.op == "collective-permute" and not c.safe for c in found)


def test_device_groups_read_every_replica_group_format():
    """Listed and iota groups (jax 0.10), and the mesh-axes form jax 0.12 prints, give the same groups."""
    from sharding.hlo import device_groups

    mesh = "mesh['data'=1,'stage'=2,'fsdp'=2,'sequence'=2,'tensor'=1]"
    assert device_groups(f"x), replica_groups={mesh} {{'sequence'}}, dimensions={{1}}") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert device_groups(f"x), replica_groups={mesh} {{'stage','sequence'}}") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert device_groups("x), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert device_groups("x), replica_groups={{0,2},{1,3}}, dimensions={0}") == [[0, 2], [1, 3]]


# The model ---------------------------------------------------------------------------------------


def _batch(batch, length, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 512, (batch, length)).astype(np.int32)
    segments = np.cumsum(rng.random((batch, length)) < 0.05, axis=1).astype(np.int32)
    starts = np.concatenate([np.ones((batch, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    index = np.arange(length)[None].repeat(batch, 0)
    positions = (index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)).astype(np.int32)
    return {"tokens": tokens, "targets": np.roll(tokens, -1, 1), "positions": positions, "segment_ids": segments,
            "loss_mask": np.ones((batch, length), np.float32)}


def _loss_and_grads(trainer, batch):
    state = trainer.init_state(0)

    def fn(params, batch):
        return jax.value_and_grad(trainer.loss_sums, has_aux=True)(params, batch)

    (loss, _), grads = jax.jit(fn)(state["params"], batch)
    layers = jax.tree.map(lambda g: pl.relayout(g, trainer.layout, None, trainer.config.num_layers), grads["layers"])
    return float(loss), {**grads, "layers": layers}


def _trainer(config, mesh_spec, plan=None, microbatches=1):
    return Trainer(config, OptimizerConfig(), Parallelism.of(make_mesh(parse_mesh(mesh_spec, 8)), RULES,
                                                             plan or Accumulation(microbatches)))


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
    config = get_config("test", [f"num_layers={num_layers}"])
    batch = _batch(8, 32)
    ref_loss, ref_grads = _loss_and_grads(_trainer(config, "fsdp=8"), batch)
    layout, _ = pl.plan_layout(num_layers, int(mesh_spec.split(",")[0].split("=")[1]), repeats, stage_layers)
    trainer = _trainer(config, mesh_spec, pl.PipelinePlan(layout, microbatches))
    loss, grads = _loss_and_grads(trainer, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)


@pytest.mark.parametrize(
    "attention, mesh_spec",
    [
        ("flash", "stage=2,fsdp=2,tensor=2"),  # heads split over tensor inside the stage program
        ("ring", "stage=2,fsdp=2,sequence=2"),  # keys and values around the sequence ring inside a stage
        ("ulysses", "stage=2,fsdp=2,sequence=2"),  # all-to-all over sequence inside a stage
    ],
)
def test_attention_kernels_inside_stages_match_the_flat_reference_attention(attention, mesh_spec):
    """Each kernel's map opens over the axes the stage program leaves automatic; loss and gradients equal
    the unpipelined model's with plain attention. As at start-up (`train.strategies.checked_pipeline`), a
    transfer inside a skipped slot (ring's) makes the pipeline compute every slot instead."""
    from train.strategies import checked_pipeline

    batch = _batch(8, 32)
    ref_loss, ref_grads = _loss_and_grads(_trainer(get_config("test"), "fsdp=8"), batch)
    layout, _ = pl.plan_layout(4, 2, 1, (3, 1))
    trainer = _trainer(get_config("test", [f"attention={attention}"]), mesh_spec, pl.PipelinePlan(layout, 2))
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          trainer.state_params, trainer.param_shardings)
    grad_fn = jax.jit(lambda p, b: jax.value_and_grad(trainer.loss_sums, has_aux=True)(p, b))
    checked, note = checked_pipeline(trainer.par, grad_fn.lower(params, trainer.abstract_batch(8, 32)).compile().as_text())
    assert (note is not None) == (attention == "ring"), note
    if note:
        assert "collective-permute" in note and not checked.pipeline.skip_empty
        trainer = Trainer(trainer.config, OptimizerConfig(), checked)
    loss, grads = _loss_and_grads(trainer, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)


def test_flash_inside_a_map_manual_over_the_batch_axes_opens_its_own_over_tensor_only():
    """The kernel's map nested in one manual over data and fsdp (heads split over tensor, no segment ids):
    values and gradients equal the one-device reference attention."""
    from models.attention import reference_attention, sharded_flash_attention

    mesh = make_mesh(parse_mesh("data=2,fsdp=2,tensor=2", 8))
    par = Parallelism.of(mesh, RULES)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (4, 64, 4, 32))
    k, v = (jax.random.normal(key, (4, 64, 2, 32)) for key in keys[1:])
    batch = P(("data", "fsdp"))
    run = jax.shard_map(lambda q, k, v: sharded_flash_attention(q, k, v, None, par=par.inside(("data", "fsdp"))),
                        mesh=mesh, in_specs=batch, out_specs=batch, axis_names={"data", "fsdp"})
    out, grads = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(run(q, k, v) ** 2), argnums=(0, 1, 2)))(q, k, v)
    ref, ref_grads = jax.value_and_grad(lambda q, k, v: jnp.sum(reference_attention(q, k, v) ** 2),
                                        argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(float(out), float(ref), rtol=1e-5)
    assert_close(grads, ref_grads)


def test_layer_weights_are_gathered_once_per_step_and_their_gradients_reduced_once():
    """Outside the pipeline's loops: each layer weight all-gathered once (all slots of the stage), each
    layer gradient reduce-scattered once; only the stage-to-stage transfers run per step of the loop."""
    from sharding.hlo import collectives

    config = get_config("test", ["num_layers=4"])
    layout, _ = pl.plan_layout(4, 2, 1, (3, 1))
    trainer = _trainer(config, "stage=2,fsdp=4", pl.PipelinePlan(layout, 4))
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          trainer.state_params, trainer.param_shardings)
    grad_fn = jax.jit(lambda p, b: jax.value_and_grad(trainer.loss_sums, has_aux=True)(p, b))
    found = collectives(grad_fn.lower(params, trainer.abstract_batch(16, 32)).compile().as_text())
    in_loops = sorted({c.op for c in found if c.executions > 1})
    assert in_loops == ["collective-permute"], in_loops

    layer_leaves = jax.tree.leaves(trainer.abstract_params["layers"])
    per_layer = sum(x.size // x.shape[0] * x.dtype.itemsize for x in layer_leaves)
    other = sum(x.size * x.dtype.itemsize for k, v in trainer.abstract_params.items() if k != "layers"
                for x in jax.tree.leaves(v))
    gathered = sum(c.total_bytes for c in found if c.op == "all-gather")
    assert layout.slots * per_layer <= gathered <= 1.2 * (layout.slots * per_layer + other)
    scattered = [c for c in found if c.op == "reduce-scatter"]
    assert len(scattered) == len(layer_leaves)  # one per layer parameter, each once per step
    assert sum(c.total_bytes for c in scattered) == layout.slots * per_layer // 4  # each device's fsdp=4 block


def test_the_head_runs_on_a_stages_share_of_the_rows_not_on_every_stage(monkeypatch):
    """Final norm, output projection and loss on 1/S of each device's rows: the compiled step's FLOPs
    (``cost_analysis``, deterministic; the head sits outside the pipeline's loops, so it is counted whole)
    drop by (1 - 1/S) of the head's products against the same step with the head replicated over stage."""
    import models.transformer

    config = get_config("test", ["num_layers=4"])
    layout, _ = pl.plan_layout(4, 2, 1, (3, 1))
    batch, length = 8, 32

    def flops():
        trainer = _trainer(config, "stage=2,fsdp=4", pl.PipelinePlan(layout, 2))
        params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              trainer.state_params, trainer.param_shardings)
        grad_fn = jax.jit(lambda p, b: jax.value_and_grad(trainer.loss_sums, has_aux=True)(p, b))
        analysis = grad_fn.lower(params, trainer.abstract_batch(batch, length)).compile().cost_analysis()
        return float((analysis[0] if isinstance(analysis, (list, tuple)) else analysis)["flops"])

    split = flops()
    monkeypatch.setattr(models.transformer, "head_parallelism", lambda par: par)
    replicated = flops()
    rows = batch // 4  # per device over fsdp=4, before the split over stage=2
    head = 3 * 2 * rows * length * config.embed_dim * config.vocab_size  # logits forward, and both backward products
    assert replicated - split == pytest.approx(head / 2, rel=0.05), (replicated, split, head)


def test_initial_parameters_do_not_depend_on_the_layout():
    config = get_config("test", ["num_layers=6"])
    layout, _ = pl.plan_layout(6, 4)
    key = jax.random.key(3)
    staged = jax.jit(lambda k: init_params(config, k, layout.layer_table()))(key)
    canonical = jax.jit(lambda k: init_params(config, k))(key)
    relaid = jax.tree.map(lambda x: pl.relayout(x, None, layout, 6), canonical["layers"])
    for a, b in zip(jax.tree.leaves(staged["layers"]), jax.tree.leaves(relaid), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(staged["embed"]["embedding"]), np.asarray(canonical["embed"]["embedding"]))


def test_per_device_parameter_bytes_are_each_stages_share_plus_its_padding():
    config = get_config("test", ["num_layers=12"])
    layout, _ = pl.plan_layout(12, 4, 1, (5, 3, 2, 2))
    trainer = _trainer(config, "stage=4,fsdp=2", pl.PipelinePlan(layout, 4))
    memory = report.stage_memory(trainer)
    per_layer = (2 * 128 * 4 * 32 + 2 * 128 * 2 * 32 + 3 * 128 * 384 + 2 * 128) * 4  # bytes of one layer
    assert memory["slot_bytes"] == per_layer // 2  # every layer parameter has an embed dim split over fsdp=2
    assert [pad for _, _, pad in memory["stages"]] == [0, 2 * per_layer // 2, 3 * per_layer // 2, 3 * per_layer // 2]

    step = trainer.eval_step(8, 32)
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          trainer.state_params, trainer.param_shardings)
    batch = trainer.abstract_batch(8, 32)
    compiled = step.lower(params, batch).compile()
    batch_bytes = sum(x.size * x.dtype.itemsize for x in batch.values()) // 2  # batch split over fsdp=2 only
    param_bytes = compiled.memory_analysis().argument_size_in_bytes - batch_bytes
    for _, share, pad in memory["stages"]:
        assert param_bytes == memory["other_bytes"] + share + pad
    assert all(c.safe for c in branch_collectives(compiled.as_text(), trainer.mesh))


# Through the CLI -------------------------------------------------------------------------------

SMALL = ["--model", "test", "--seq-len", "64", "--batch-size", "8", "--no-progress", "--eval-batches", "1",
         "--log-every", "1", "--warmup", "1", "--eval-every", "0", "--decay-steps", "8"]


def _run(args, corpus, cache):
    return train.main([*SMALL, "--data", str(corpus), "--data-cache", str(cache), *args])


def _losses(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r}


def test_dry_run_reports_bubble_layers_padding_and_branch_collectives(capsys):
    code = train.main(["--model", "test", "--mesh", "stage=2,fsdp=4", "--stage-layers", "3,1", "--microbatches", "2",
                       "--batch-size", "8", "--seq-len", "32", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert "bubble (S-1)/(R*M+S-1) = 1/3 = 33.3% of 3 steps" in out
    assert "2 empty slot(s) pad the stages with fewer layers to 3" in out
    assert "layers,-,embed,mlp" in out and "('stage', None, 'fsdp')" in out
    assert "collectives inside skipped-slot branches:" in out and "all among devices of one stage" in out
    assert "final norm, output projection and loss: rows split over fsdp+stage, 1 of the batch's 8 per device" in out
    assert "compute per device per step:" in out


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
        (["--mesh", "stage=8", "--microbatches", "8"], "--mesh stage=8: the model has 4 layers, fewer than the 8 stages"),
        (["--mesh", "stage=2,fsdp=4", "--stage-layers", "3,2", "--microbatches", "2"],
         "--stage-layers 3,2 sums to 5, but the model has 4 layers; e.g. --stage-layers 2,2"),
        (["--mesh", "stage=2,fsdp=4", "--stage-layers", "4,0", "--microbatches", "2"],
         "every stage needs at least one layer"),
        (["--mesh", "stage=2,fsdp=4", "--stage-layers", "2,1,1", "--microbatches", "2"],
         "--stage-layers 2,1,1: 3 entries, but --mesh stage=2 needs 2"),
        (["--mesh", "stage=2,fsdp=4", "--stage-layers", "two,two"], "--stage-layers 'two,two': expected"),
        (["--mesh", "stage=4,fsdp=2", "--microbatches", "2"],
         "--microbatches 2: fewer microbatches than the 4 pipeline stages (--mesh stage=4)"),
        (["--mesh", "stage=4,fsdp=2", "--microbatches", "2", "--batch-size", "4"], "use --microbatches 4"),
        (["--mesh", "stage=2,fsdp=4", "--microbatches", "3"], "--batch-size 8 is not divisible by --microbatches 3"),
        (["--mesh", "stage=2,fsdp=4", "--microbatches", "4"],
         "--batch-size 8 / --microbatches 4 = 2 sequences per microbatch, not divisible by the data-parallel size"),
        (["--mesh", "stage=4,fsdp=2", "--microbatches", "4", "--pipeline-schedule", "circular",
          "--pipeline-repeats", "1"], "--pipeline-schedule circular needs --pipeline-repeats of 2 or more"),
        (["--mesh", "stage=4,fsdp=2", "--microbatches", "4", "--pipeline-schedule", "circular"],
         "--pipeline-repeats 2: 4 stages x 2 repeats = 8 chunks, more than the 4 layers; use --pipeline-repeats 1"),
        (["--mesh", "fsdp=8", "--stage-layers", "4"], "--stage-layers needs a pipeline: add a stage axis"),
    ],
)
def test_bad_pipeline_input_fails_before_compiling_with_the_flag_named(tmp_path, args, message, corpus, cache, capsys):
    code = _run([*args, "--steps", "2", "--run-dir", str(tmp_path / "r")], corpus, cache)
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
