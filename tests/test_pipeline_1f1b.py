"""The 1F1B pipeline schedule: its tick table, equality with the unpipelined stack and model, memory
against GPipe, and no transfer inside a conditional."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from sharding import pipeline as pl
from sharding.hlo import branch_collectives
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import UNSHARDED, Parallelism
from sharding.pipeline.layout import BACKWARD, FORWARD, one_f_one_b_live
from sharding.rules import get_rules

RULES = get_rules("fsdp_tp")


def assert_close(actual, expected, rtol=1e-5):
    """float32 agreement to ``rtol`` of each array's largest magnitude (entries near zero included)."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * float(np.max(np.abs(e)) or 1.0))


# The tick table (no devices) ----------------------------------------------------------------


@pytest.mark.parametrize("stages, microbatches", [(2, 2), (4, 4), (4, 8), (4, 16), (3, 7)])
def test_the_tick_table_is_a_valid_1f1b_schedule_holding_at_most_s_microbatches(stages, microbatches):
    table = pl.one_f_one_b_ticks(stages, microbatches)
    assert table.shape == (2 * (microbatches + stages - 1), stages, 2)
    when = {}
    for t, row in enumerate(table):
        for s, (op, mb) in enumerate(row):
            if op:
                assert (op, s, mb) not in when
                when[op, s, mb] = t
    assert len(when) == 2 * stages * microbatches  # every microbatch forward and backward on every stage
    for i in range(microbatches):
        for s in range(stages):
            if s:  # the input left the previous stage at an earlier tick
                assert when[FORWARD, s, i] > when[FORWARD, s - 1, i]
            if s < stages - 1:  # the cotangent arrives from the next stage exactly one tick before
                assert when[BACKWARD, s, i] == when[BACKWARD, s + 1, i] + 1
        assert when[BACKWARD, stages - 1, i] == when[FORWARD, stages - 1, i] + 1
    live = one_f_one_b_live(table)
    assert live.max() <= stages and live[0] == stages
    # after warm-up each stage alternates: no two forwards in a row once its first backward ran
    for s in range(stages):
        ops = [op for op in table[:, s, 0] if op]
        first_backward = ops.index(BACKWARD)
        assert first_backward == stages - s
        steady = ops[first_backward:-(stages - s)]
        assert all(a != b for a, b in zip(steady, steady[1:]))


# The toy stack ----------------------------------------------------------------------------------


def _toy_layer(par, w, h, position):
    h = jnp.tanh(h @ w["a"] + w["b"] + 0.01 * position[:, None])
    return par.constrain(h, ("batch", "act_embed"))


def _toy_head(par, hp, h, target, mask):
    """A small head with parameters: ``sum(mask * ((h @ v) - target)^2)`` and ``sum(mask)``."""
    y = h @ hp["v"] + hp["c"]
    return jnp.sum(mask[:, None] * (y - target[:, None]) ** 2), jnp.sum(mask)


def _toy(mesh_spec, num_layers, stage_layers, microbatches, batch=16, dim=16, schedule="1f1b", skip_empty=True):
    mesh = make_mesh(parse_mesh(mesh_spec, 8))
    rules = pl.pipeline_rules(RULES)
    layout, _ = pl.plan_layout(num_layers, mesh.shape["stage"], 1, stage_layers)
    plan = pl.PipelinePlan(layout, microbatches, skip_empty=skip_empty, one_f_one_b=schedule == "1f1b")
    rng = np.random.default_rng(0)
    w = {"a": rng.normal(size=(num_layers, dim, dim)).astype(np.float32) / 4,
         "b": rng.normal(size=(num_layers, dim)).astype(np.float32)}
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

    def pipelined(w, hp, x):
        loss, weight, applied = pl.run_pipeline_loss(
            _toy_layer, _toy_head, w, hp, x, (position,), (target, mask), Parallelism.of(mesh, rules, plan),
            names={"a": ("layers", None, "embed"), "b": ("layers", None)},
            head_names={"v": ("embed", None), "c": (None,)})
        return loss, (weight, applied)

    staged = jax.tree.map(lambda a: pl.relayout(jnp.asarray(a), None, layout, num_layers), w)
    staged = jax.device_put(staged, {"a": NamedSharding(mesh, P("stage", None, "fsdp")),
                                     "b": NamedSharding(mesh, P("stage"))})
    hp_dev = jax.device_put(hp, {"v": NamedSharding(mesh, P("fsdp")), "c": NamedSharding(mesh, P())})
    grad_fn = jax.jit(jax.value_and_grad(pipelined, argnums=(0, 1, 2), has_aux=True))
    (loss, (weight, applied)), grads = grad_fn(staged, hp_dev, x)
    forward_only = jax.jit(pipelined)(staged, hp_dev, x)
    (ref_loss, ref_weight), ref_grads = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2), has_aux=True))(w, hp, x)
    grads = (jax.tree.map(lambda g: pl.relayout(g, layout, None, num_layers), grads[0]), *grads[1:])
    return plan, (loss, weight, grads, applied, forward_only), (ref_loss, ref_weight, ref_grads), grad_fn, (staged, hp_dev, x)


@pytest.mark.parametrize(
    "mesh_spec, num_layers, stage_layers, microbatches",
    [
        ("stage=2,fsdp=4", 4, (3, 1), 2),  # uneven, M = S
        ("stage=4,fsdp=2", 12, (5, 3, 2, 2), 8),  # uneven, 4 stages, M = 2S
        ("stage=4,data=2", 6, None, 5),  # default split 2,2,1,1 with data parallelism, M not a multiple of S
    ],
)
def test_1f1b_matches_the_sequential_stack(mesh_spec, num_layers, stage_layers, microbatches):
    plan, (loss, weight, grads, applied, forward_only), (ref_loss, ref_weight, ref_grads), _, _ = _toy(
        mesh_spec, num_layers, stage_layers, microbatches, batch=2 * microbatches * 2)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(float(weight), float(ref_weight), rtol=1e-6)
    assert_close(grads, ref_grads)
    assert tuple(np.asarray(applied)) == plan.layer_applications()
    np.testing.assert_allclose(float(forward_only[0]), float(ref_loss), rtol=1e-5)  # undifferentiated: forwards only


def test_1f1b_computing_every_slot_matches_too():
    plan, (loss, _, grads, applied, _), (ref_loss, _, ref_grads), _, _ = _toy(
        "stage=2,fsdp=4", 4, (3, 1), 4, skip_empty=False)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_close(grads, ref_grads)
    assert tuple(np.asarray(applied)) == plan.layer_applications() == (plan.ticks * 3,) * 2


# The model ---------------------------------------------------------------------------------------


def _batch(batch, length, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 512, (batch, length)).astype(np.int32)
    segments = np.cumsum(rng.random((batch, length)) < 0.05, axis=1).astype(np.int32)
    starts = np.concatenate([np.ones((batch, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    index = np.arange(length)[None].repeat(batch, 0)
    positions = (index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)).astype(np.int32)
    return {"tokens": tokens, "targets": np.roll(tokens, -1, 1), "positions": positions, "segment_ids": segments,
            "loss_mask": (rng.random((batch, length)) < 0.9).astype(np.float32)}


def _trainer(config, mesh_spec, strategy, optimizer=None):
    from train.optimizer import OptimizerConfig
    from train.step import Trainer

    return Trainer(config, optimizer or OptimizerConfig(),
                   Parallelism.of(make_mesh(parse_mesh(mesh_spec, 8)), RULES, strategy))


def _plan(num_layers, mesh_spec, stage_layers, microbatches, schedule):
    stages = parse_mesh(mesh_spec, 8)["stage"]
    layout, _ = pl.plan_layout(num_layers, stages, 1, stage_layers)
    return pl.PipelinePlan(layout, microbatches, one_f_one_b=schedule == "1f1b")


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
    if trainer.layout is not None:
        first = {**first, "layers": jax.tree.map(
            lambda g: np.asarray(pl.relayout(jnp.asarray(g), trainer.layout, None, trainer.config.num_layers)),
            first["layers"])}
    return losses, first


def _loss_and_grads(trainer, batch):
    state = trainer.init_state(0)
    fn = jax.jit(lambda params, batch: jax.value_and_grad(trainer.loss_sums, has_aux=True)(params, batch))
    (loss, _), grads = fn(state["params"], batch)
    if trainer.layout is not None:
        grads = {**grads, "layers": jax.tree.map(
            lambda g: pl.relayout(g, trainer.layout, None, trainer.config.num_layers), grads["layers"])}
    return float(loss), grads


CASES = [
    (4, "stage=2,fsdp=4", (3, 1), 2),  # uneven, fsdp
    (6, "stage=4,fsdp=2", (2, 2, 1, 1), 4),  # uneven, 4 stages
    (4, "stage=2,fsdp=2,tensor=2", (3, 1), 2),  # with tensor parallelism inside the stages
]


@pytest.mark.parametrize("num_layers, mesh_spec, stage_layers, microbatches", CASES)
def test_1f1b_model_has_the_loss_and_gradients_of_the_unpipelined_one(num_layers, mesh_spec, stage_layers,
                                                                       microbatches):
    from models.config import get_config
    from sharding.parallel import Accumulation

    config = get_config("test", [f"num_layers={num_layers}"])
    batch = _batch(8, 32)
    ref_loss, ref_grads = _loss_and_grads(_trainer(config, "fsdp=8", Accumulation(1)), batch)
    trainer = _trainer(config, mesh_spec, _plan(num_layers, mesh_spec, stage_layers, microbatches, "1f1b"))
    loss, grads = _loss_and_grads(trainer, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)


def test_1f1b_training_steps_match_the_unpipelined_model():
    """Losses over 3 steps (1e-4) and the parameters after the first (1e-5) equal the flat model's.

    AdamW's first update is ``lr * g / (|g| + eps)``: with the default ``eps`` 1e-8 it is about
    ``lr * sign(g)``, which turns float32 rounding of a near-zero gradient entry into an update of up
    to ``lr`` (an ill-conditioned comparison, not a tolerance question); ``eps`` 1e-3 bounds that gain
    by ``lr / eps`` = 3 while entries with ``|g|`` near 1e-3 still move by about ``lr / 2``."""
    from models.config import get_config
    from sharding.parallel import Accumulation
    from train.optimizer import OptimizerConfig

    num_layers, mesh_spec, stage_layers, microbatches = CASES[0]
    config = get_config("test", [f"num_layers={num_layers}"])
    optimizer = OptimizerConfig(eps=1e-3, warmup=0, decay_steps=10)
    batches = [_batch(8, 32, seed) for seed in range(3)]
    flat = _trainer(config, "fsdp=8", Accumulation(1), optimizer)
    init = jax.tree.map(np.asarray, flat.init_state(0)["params"])
    ref_losses, ref_params = _steps(flat, batches)
    plan = _plan(num_layers, mesh_spec, stage_layers, microbatches, "1f1b")
    losses, params = _steps(_trainer(config, mesh_spec, plan, optimizer), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert_close(params, ref_params)
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(init)))
    assert moved > 1e-3  # the step moved the parameters far beyond the tolerance


def _compiled_gradients(schedule, num_layers=4, mesh_spec="stage=2,fsdp=4", stage_layers=(3, 1), microbatches=16,
                        batch=64, length=256):
    from models.config import get_config

    config = get_config("test", [f"num_layers={num_layers}"])
    trainer = _trainer(config, mesh_spec, _plan(num_layers, mesh_spec, stage_layers, microbatches, schedule))
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          trainer.state_params, trainer.param_shardings)
    fn = jax.jit(lambda p, b: jax.value_and_grad(trainer.loss_sums, has_aux=True)(p, b))
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
    assert temp < 0.6 * gpipe_temp
    found = branch_collectives(one_f_one_b.as_text(), trainer.mesh)
    assert not [c for c in found if c.op == "collective-permute"]
    assert all(c.safe for c in found)


# Through the CLI -------------------------------------------------------------------------------


def test_dry_run_reports_the_1f1b_schedule(capsys):
    from train import train

    code = train.main(["--model", "test", "--mesh", "stage=2,fsdp=4", "--stage-layers", "3,1", "--microbatches", "4",
                       "--batch-size", "16", "--seq-len", "32", "--dry-run", "--pipeline-schedule", "1f1b"])
    out = capsys.readouterr().out
    assert code == 0
    assert "pipeline: 1F1B (PipeDream-Flush) over stage=2, 4 microbatches" in out
    assert "a ring of 2 microbatches x 3 slot inputs per device (GPipe keeps 5 x 3); one loop of 10 ticks" in out
    assert "loss run on the last stage inside the pipeline" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "stage=2,fsdp=4", "--pipeline-schedule", "1f1b", "--pipeline-repeats", "2"],
         "--pipeline-schedule 1f1b runs one chunk per stage (interleaved 1F1B is not implemented); drop "
         "--pipeline-repeats 2"),
        (["--mesh", "fsdp=8", "--pipeline-schedule", "1f1b"], "--pipeline-schedule 1f1b needs a pipeline"),
    ],
)
def test_bad_1f1b_flags_fail_before_compiling_with_the_flags_named(args, message, capsys):
    from train import train

    code = train.main(["--model", "test", "--microbatches", "2", "--batch-size", "8", "--dry-run", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
