"""The zero-bubble schedule (ZB-H1): its tick table, equality with the unpipelined stack and model, memory against
fused 1F1B, and no transfer inside a conditional."""

import numpy as np
import pytest
from _cli_errors import raises_as_cli
from test_pipeline_1f1b import (
    STEPS_LAYERS,
    STEPS_MESH,
    STEPS_MICROBATCHES,
    STEPS_SPLIT,
    _assert_steps_match_the_flat_model,
    _batch,
    _compiled_gradients,
    _loss_and_grads,
    _plan,
    _toy,
    _trainer,
    assert_close,
    flat_loss_and_grads,
)

from sharding import pipeline as pl
from sharding.hlo import branch_collectives
from sharding.pipeline.ticks import BACKWARD, FORWARD, WEIGHT, tick_time

# The tick table (no devices) ----------------------------------------------------------------


@pytest.mark.parametrize("stages, microbatches", [(2, 2), (2, 8), (3, 7), (4, 4), (4, 8), (4, 16)])
def test_the_zero_bubble_table_splits_the_backward_and_keeps_fused_1f1b_ticks_and_memory(stages, microbatches):
    z = pl.zero_bubble_ticks(stages, microbatches)
    f = pl.fused_ticks(stages, microbatches)
    # forwards and input gradients run where fused 1F1B runs its forwards and backwards: the same ticks
    for name in ("forward", "forward_microbatch", "backward", "backward_microbatch", "cotangent_arrive"):
        assert (getattr(z, name) == getattr(f, name)).all(), name
    assert ((z.arrive >= 0) == (f.arrive >= 0)).all()  # the same arrivals (ring slots coloured anew)
    assert z.ticks == f.ticks == microbatches + 2 * (stages - 1)
    when = {}
    for t in range(z.ticks):
        for s in range(stages):
            for op, on, mb in (
                (FORWARD, z.forward, z.forward_microbatch),
                (BACKWARD, z.backward, z.backward_microbatch),
                (WEIGHT, z.weight, z.weight_microbatch),
            ):
                if on[t, s]:
                    key = (op, s, int(mb[t, s]))
                    assert key not in when
                    when[key] = t
    assert len(when) == 3 * stages * microbatches
    for s in range(stages):
        for i in range(microbatches):
            # W at or after its B (in the same tick the loop runs B before W), one W a stage a tick
            assert when[WEIGHT, s, i] >= when[BACKWARD, s, i]
    assert ((z.weight == WEIGHT).sum(axis=0) == microbatches).all()
    # the chunk inputs' ring is fused 1F1B's (an input is freed by its B, as there)
    for name in ("forward_slot", "backward_slot", "arrive"):
        assert (getattr(z, name) == getattr(f, name)).all(), name
    assert z.slots == f.slots and (z.live() == f.live()).all()
    # the saved ring: never two live entries in one slot, each W reads what its own B left
    for s in range(stages):
        live = {}
        for t in range(z.ticks):
            if z.backward[t, s]:
                slot = int(z.backward_saved[t, s])
                assert slot not in live, (t, s, slot)
                live[slot] = int(z.backward_microbatch[t, s])
            if z.weight[t, s]:
                assert live.pop(int(z.weight_saved[t, s])) == int(z.weight_microbatch[t, s])
        assert not live
    # one cut held per stage (ZB-H1's bound of what waits for W, here one microbatch's), and on the clock (F 1,
    # B 2, W 1, every tick as long as its busiest stage) one forward-equivalent less than fused 1F1B and GPipe
    assert list(z.saved_live()) == [1] * stages and z.saved_slots == 1
    unit = [1.0] * stages
    gpipe = 4 * (microbatches + stages - 1)
    assert tick_time(f, unit, [3.0] * stages) == gpipe
    assert tick_time(z, unit, [2.0] * stages, unit) == gpipe - 1


@pytest.mark.parametrize("stages, microbatches", [(3, 7), (4, 8)])
def test_a_deeper_saved_ring_buys_a_forward_equivalent_per_entry(stages, microbatches):
    """``ring`` c < S cuts per stage: the clock is ``4 (M + S - 1) - c`` (W-only ticks appended at the end), and
    no stage holds more than c."""
    gpipe, unit = 4 * (microbatches + stages - 1), [1.0] * stages
    for ring in range(1, stages):
        z = pl.zero_bubble_ticks(stages, microbatches, ring=ring)
        assert max(z.saved_live()) == z.saved_slots == ring
        assert tick_time(z, unit, [2.0] * stages, unit) == gpipe - ring, ring


def test_zero_bubble_refuses_repeats_naming_the_flag():
    with raises_as_cli(ValueError, match="--pipeline-repeats 2: .* --pipeline-repeats 1"):
        pl.zero_bubble_ticks(4, 8, 2)
    with raises_as_cli(ValueError, match="--microbatches 3"):
        pl.zero_bubble_ticks(4, 3)
    with pytest.raises(ValueError, match="at least 1 entry"):
        pl.zero_bubble_ticks(4, 8, ring=0)


# The cut (one layer, one device) ---------------------------------------------------------------


def test_the_split_backward_is_the_layers_vjp_and_its_weight_pass_only_the_weight_products():
    """A test-model block's backward cut by `LayerSplit`: B's input cotangent and W's weight cotangents equal
    `jax.vjp`'s (float32, 1e-5); W is one product per weight matrix (the weight-gradient products, nothing
    recomputed) and reads no weight; what B keeps for W is, to the byte, what the cost model prices
    (`weight_cut_bytes`: each product's input and output cotangent per token, each norm scale's cotangent, which
    B computes itself, per layer)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.config import get_config
    from models.spec import describe
    from models.transformer import Block
    from sharding.costmodel.pipeline import weight_cut_bytes
    from sharding.mesh import parse_mesh
    from sharding.parallel import UNSHARDED
    from sharding.pipeline.split import LayerSplit
    from sharding.rules import get_rules

    config = get_config("test")
    graphdef, state = nnx.split(Block(config, rngs=nnx.Rngs(0)))

    def layer(w, h, positions, segment_ids):
        return nnx.merge(graphdef, w)(h, positions, segment_ids, UNSHARDED)

    rows, length = 2, 16
    k_h, k_g = jax.random.split(jax.random.key(1))
    h = jax.random.normal(k_h, (rows, length, config.embed_dim), jnp.float32)
    g = jax.random.normal(k_g, h.shape, jnp.float32)
    extras = (jnp.broadcast_to(jnp.arange(length), (rows, length)), None)
    cut = LayerSplit.trace(layer, state, h, g, extras)

    @jax.jit
    def split_and_reference(state, h, g, extras):
        dh, saved = cut.input_pass(state, h, g, extras)
        _, vjp = jax.vjp(lambda w, x: layer(w, x, *extras), state, h)
        return dh, cut.weight_pass(state, saved), vjp(g)

    dh, dw, (ref_dw, ref_dh) = split_and_reference(state, h, g, extras)
    assert_close(dh, ref_dh)
    assert_close(dw, ref_dw)
    products = [p for p in describe(config).products if p.weight.per_layer]
    w_ops = [cut.nodes[k].primitive.name for k in cut.w_nodes]
    assert w_ops.count("dot_general") == len(products) == 7, w_ops
    assert w_ops == ["dot_general", "transpose"] * 7, w_ops  # nothing but the products (and their layout)
    assert not cut.needs_params
    priced = weight_cut_bytes(describe(config), get_rules("fsdp"), parse_mesh("fsdp=1", 1), 4, rows * length)
    assert cut.saved_bytes == priced, (cut.saved_bytes, priced, cut.cut_avals)
    # per token: the products' 2D + NH + F inputs and NH + 2KH + 2D + 2F cotangents, 16 float32 activations of
    # D = 128 (the norms' normalised inputs and cotangents, 4 more, stay in B); per layer: two scales' cotangents
    assert priced == rows * length * 16 * 128 * 4 + 2 * 128 * 4


# Exactness -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh_spec, num_layers, stage_layers, microbatches, skip_empty",
    [
        ("stage=4,fsdp=2", 12, (5, 3, 2, 2), 8, True),  # uneven, 4 stages, M = 2S: W deferred up to 3 ticks
        ("stage=2,fsdp=4", 4, (3, 1), 4, False),  # every slot computed and selected
        ("stage=2,fsdp=4", 3, (2, 1), 4, True),  # K = 2 of K' = 4 slots: the copy and its sums all-reduced
    ],
)
def test_zero_bubble_matches_the_sequential_stack(mesh_spec, num_layers, stage_layers, microbatches, skip_empty):
    plan, (loss, weight, grads, applied, forward_only), (ref_loss, ref_weight, ref_grads), _, _ = _toy(
        mesh_spec, num_layers, stage_layers, microbatches, batch=4 * microbatches, schedule="zb", skip_empty=skip_empty
    )
    assert plan.schedule == "zb" and plan.ticks == microbatches + 2 * (plan.layout.stages - 1)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(float(weight), float(ref_weight), rtol=1e-6)
    assert_close(grads, ref_grads)
    assert tuple(np.asarray(applied)) == plan.layer_applications()
    np.testing.assert_allclose(float(forward_only[0]), float(ref_loss), rtol=1e-5)


def test_zero_bubble_training_steps_match_the_unpipelined_model():
    """Losses over 6 steps (1e-4) and the parameters after the first (1e-5) equal the flat model's, for zero
    bubble on the uneven split 4,2 with fsdp (`_assert_steps_match_the_flat_model`)."""
    plan = _plan(STEPS_LAYERS, STEPS_MESH, STEPS_SPLIT, STEPS_MICROBATCHES, "zb")
    assert plan.one_f_one_b and plan.schedule == "zb"
    _assert_steps_match_the_flat_model(plan)


def test_zero_bubble_model_with_tensor_parallelism_has_the_loss_and_gradients_of_the_unpipelined_one():
    """The test model on ``stage=2,fsdp=2,tensor=2`` (split 3,1, M = 2): loss (1e-5) and gradients (1e-5 of each
    array's largest entry) equal the flat model's; tensor-parallel products inside both backward halves."""
    from models.config import get_config

    config = get_config("test", ["num_layers=4"])
    ref_loss, ref_grads = flat_loss_and_grads(4)
    mesh = "stage=2,fsdp=2,tensor=2"
    loss, grads = _loss_and_grads(_trainer(config, mesh, _plan(4, mesh, (3, 1), 2, "zb")), _batch(8, 32))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)


def test_zero_bubble_holds_fused_1f1b_temporaries_plus_its_priced_ring_and_no_transfer_sits_in_a_conditional():
    """The compiled gradient step at M = 16 on 2 stages under ``--remat full`` (memory analysis: deterministic;
    each layer recomputed from its input, where B's cut is what the ring adds): zero bubble keeps fused
    1F1B's ring of chunk inputs (3 entries) and adds its second ring, one entry of what an input-gradient pass
    keeps for its weight-gradient pass (every product's input and output cotangent: 16 activations per layer
    here, and the norm scales' cotangents), so its temporaries exceed fused 1F1B's by that ring as the cost
    model prices it (less at most one layer's cut), and stay below GPipe's. No collective-permute sits inside a conditional, and
    every collective inside one is among the devices of one stage."""
    from models.config import get_config
    from sharding import costmodel as cm

    _, gpipe = _compiled_gradients("gpipe", remat="full")
    _, fused = _compiled_gradients("1f1b-fused", remat="full")
    trainer, zb = _compiled_gradients("zb", remat="full")
    table = trainer.par.pipeline.tick_table()
    assert table.slots == 3 and table.saved_slots == 1
    temps = {
        name: c.memory_analysis().temp_size_in_bytes for name, c in (("fused", fused), ("zb", zb), ("gpipe", gpipe))
    }

    def activations(ticks):  # the tick table's name: "fused" is --pipeline-schedule 1f1b-fused
        schedule = {"fused": "1f1b-fused"}.get(ticks, ticks)
        layout = cm.Layout(
            {"stage": 2, "fsdp": 4}, "fsdp_tp", 16, remat="full", stage_layers=(3, 1), pipeline_schedule=schedule
        )
        return cm.estimate(get_config("test", remat="full"), 64, 256, layout, backend="cpu").memory.activations

    ring = activations("zb") - activations("fused")
    # the excess is the ring less at most one layer's cut (the input-gradient pass writes a layer's cut into the
    # ring, where fused 1F1B's backward holds that layer's residuals: 0.98 MB less here, whatever the ring's size)
    layer_cut = ring / (table.saved_slots * 3)  # the 3 layers' slots (K' = 4 gathered, the padded one dropped)
    assert ring - layer_cut <= temps["zb"] - temps["fused"] <= ring, (temps, ring)
    assert temps["fused"] < temps["zb"] < temps["gpipe"], temps
    found = branch_collectives(zb.as_text(), trainer.mesh)
    assert not [c for c in found if c.op == "collective-permute"]
    assert all(c.safe for c in found)


# Through the CLI -------------------------------------------------------------------------------


def test_the_zero_bubble_plan_round_trips_through_its_flags_and_is_reported(capsys):
    from train import train
    from train.reports.report import schedule_memory_line
    from train.setup.cli import parse
    from train.setup.flags import parallelism_flags

    run = parse(["--model", "test", "--mesh", "stage=2,fsdp=4", "--microbatches", "4", "--pipeline-schedule", "zb"])
    plan = run.parallelism.pipeline
    assert plan.one_f_one_b and plan.schedule == "zb"
    assert parse(["--model", "test", *parallelism_flags(run.parallelism)]).parallelism.pipeline == plan
    assert "one loop of 6 ticks, each a forward, an input gradient and a weight gradient" in schedule_memory_line(plan)
    argv = ["--model", "test", "--mesh", "stage=2,fsdp=4", "--microbatches", "4", "--batch-size", "8", "--dry-run"]
    code = train.main([*argv, "--pipeline-schedule", "zb", "--pipeline-repeats", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--pipeline-repeats 2: --pipeline-schedule zb runs one chunk per stage" in err, err
