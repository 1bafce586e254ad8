"""``--remat none|dots|full`` inside pipeline stages: every schedule trains as the flat model does.

A stage keeps each layer's residuals from its forward tick (``none``: all of them; ``dots``: the products'
outputs, the rest recomputed) or only each layer's input (``full``: the layer recomputed in the backward), as
`sharding.pipeline.program.keeps` says. ``none`` is the model's default, so the six-step comparisons of
tests/test_pipeline_1f1b.py and tests/test_pipeline_zb.py run it for every schedule; here the other two choices
run the same comparison (`_assert_steps_match_the_flat_model`: the flat one-device-layout float32 model's
losses over 6 steps and its parameters after the first, computed once for the module).
"""

import pytest
from test_pipeline_1f1b import (
    STEPS_LAYERS,
    STEPS_MESH,
    STEPS_MICROBATCHES,
    STEPS_SPLIT,
    _assert_steps_match_the_flat_model,
    _plan,
)

from models.config import get_config

#: (schedule, repeats): lockstep GPipe, circular (GPipe with 2 chunks per stage), 1F1B, interleaved fused 1F1B
#: (2 chunks per stage) and zero bubble, on the uneven split 4,2 with fsdp.
SCHEDULES = [("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("1f1b-fused", 2), ("zb", 1)]


def test_the_model_default_is_no_remat_which_the_schedules_step_tests_run():
    assert get_config("test", [f"num_layers={STEPS_LAYERS}"]).remat == "none"


@pytest.mark.parametrize("remat", ["dots", "full"])
@pytest.mark.parametrize("schedule, repeats", SCHEDULES)
def test_every_schedule_trains_as_the_flat_model_under_each_remat_choice(schedule, repeats, remat):
    """Losses over 6 steps (1e-5 relative) and the parameters after the first (1e-5) equal the flat model's."""
    plan = _plan(STEPS_LAYERS, STEPS_MESH, STEPS_SPLIT, STEPS_MICROBATCHES, schedule, repeats)
    assert plan.layout.repeats == repeats
    _assert_steps_match_the_flat_model(plan, remat, loss_rtol=1e-5)


def remat_case(remat: str):
    """1F1B on ``stage=2,fsdp=4`` (split 3,1, 4 microbatches of 4 sequences of 32 tokens) with ``remat``, as
    `costmodel_grid` cases are written (shared with tests/test_activation_memory.py)."""
    return ("test", "stage=2,fsdp=4", "fsdp", 16, 32, 4, remat, (3, 1), 1, "1f1b")


def test_the_choice_orders_the_compiled_temporaries_and_only_full_recomputes_the_products():
    """The compiled step (8 simulated CPU devices; ``memory_analysis`` and the HLO's products with trip counts
    folded in, both deterministic): ``none`` holds more temporaries than ``dots``, which holds more than
    ``full``; ``full`` runs each layer's forward products again in the backward and ``none`` does not, by the
    priced difference (within 10%), and ``dots`` runs the products as ``none`` does (it recomputes only the
    attention's, whose batch dimensions the policy does not save)."""
    from costmodel_grid import compiled_figures, predicted

    figures = {r: compiled_figures(remat_case(r)) for r in ("none", "dots", "full")}
    temp = {r: f["temp"] for r, f in figures.items()}
    assert temp["none"] > temp["dots"] > temp["full"], temp
    dots = {r: f["dot_flops"] for r, f in figures.items()}
    assert dots["full"] > dots["dots"] >= dots["none"], dots
    compiled = dots["full"] - dots["none"]
    priced = predicted(remat_case("full")).matmul_flops - predicted(remat_case("none")).matmul_flops
    assert abs(priced - compiled) <= 0.10 * compiled, (priced, compiled)


def test_the_cost_model_trades_memory_for_recompute_across_the_choice():
    """The 7B on ``stage=4,fsdp=2`` (1F1B, 16 microbatches of 4 sequences of 4,096 tokens, bfloat16, flash): the
    priced activations shrink from ``none`` to ``dots`` to ``full`` and the priced FLOPs grow, by the layer's
    recomputed forward (``full``: the whole forward once; ``dots``: the attention's; ``none``: nothing), as the
    planner's cheapest-that-fits search over the choice reads them (`sharding.planner.search._state_variants`)."""
    from sharding import costmodel as cm
    from sharding.pipeline.layout import Schedule

    config = get_config("7b", ["dtype=bfloat16", "attention=flash"])
    costs = {
        r: cm.estimate(
            config,
            64,
            4096,
            cm.Layout(
                {"stage": 4, "fsdp": 2},
                "fsdp_tp",
                16,
                remat=r,
                pipeline_schedule=Schedule.ONE_F_ONE_B,
                attention="flash",
                dtype="bfloat16",
            ),
        )
        for r in ("none", "dots", "full")
    }
    saved = {r: c.memory.activations for r, c in costs.items()}
    assert saved["none"] > saved["dots"] > saved["full"], saved
    recompute = {r: c.flops.recompute for r, c in costs.items()}
    assert recompute["none"] == 0 < recompute["dots"] < recompute["full"], recompute
    totals = {r: c.flops.total for r, c in costs.items()}
    assert totals["none"] < totals["dots"] < totals["full"], totals


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_the_priced_temporaries_are_the_compiled_steps_whole_and_by_phase(schedule, remat):
    """The priced in-flight bytes (``Memory.in_flight``) against the compiled step's temporaries
    (``memory_analysis``, 8 simulated CPU devices, deterministic), within 10%, for every schedule and remat
    choice of `bench/remat_stages.py`; and each of the step's two phases against XLA's live ranges
    (`costmodel_grid.compiled_loop_peak`), within 10% too: before the tick loop (``gradients + before_loop``:
    the working copy's gathered rows and a slice of them, the zeroed rings, cotangents and gradient sums,
    the head's weights; `sharding.costmodel.pipeline._before_loop`) and inside it (``Memory.in_loop``: the
    ring of kept residuals or slot inputs, a chunk pass's fresh residuals, a slot's weights sliced out of
    the working copy, a layer's backward). The priced phase that peaks is the compiled step's: the one before
    the loop for ``full``, the loop for the choices that keep residuals."""
    from costmodel_grid import compiled_loop_peak, predicted
    from remat_stages import case

    temp, loop, before = compiled_loop_peak(case(remat, schedule))
    memory = predicted(case(remat, schedule)).memory
    assert abs(memory.in_flight - temp) <= 0.10 * temp, (memory.in_flight, temp)
    priced_before = memory.gradients + memory.before_loop
    assert abs(priced_before - before) <= 0.10 * before, (priced_before, before)
    assert abs(memory.in_loop - loop) <= 0.10 * loop, (memory.in_loop, loop)
    assert (before > loop) == (remat == "full") == (priced_before > memory.in_loop), (before, loop, memory)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_the_priced_growth_over_full_is_the_compiled_steps(schedule):
    """What keeping residuals adds over ``--remat full``, priced (``Memory.in_flight``) against the compiled
    step's temporaries (``memory_analysis``, 8 simulated CPU devices, deterministic), within 10%, for
    ``none`` and ``dots`` on every schedule: the ring's residuals per slot as the layer's split keeps them
    (`models.spec._residuals`) and one chunk pass's fresh ones beside the ring, in the tick loop, against
    ``full``'s step, which peaks before its loop, gathering the working copy (the test above)."""
    from costmodel_grid import compiled_loop_peak, predicted
    from remat_stages import case

    full_compiled = compiled_loop_peak(case("full", schedule))[0]
    full_priced = predicted(case("full", schedule)).memory.in_flight
    for remat in ("none", "dots"):
        compiled = compiled_loop_peak(case(remat, schedule))[0] - full_compiled
        priced = predicted(case(remat, schedule)).memory.in_flight - full_priced
        assert abs(priced - compiled) <= 0.10 * compiled, (remat, priced, compiled)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["dtype=bfloat16"],
        ["qk_norm=true"],
        ["qk_norm=true", "dtype=bfloat16"],
        ["attention=flash"],
        ["attention=flash", "dtype=bfloat16"],
    ],
)
@pytest.mark.parametrize("remat", ["none", "dots"])
def test_the_priced_residuals_are_what_the_split_keeps_to_the_byte(remat, overrides):
    """A test-model block traced as a stage traces it (`LayerSplit.trace`; the layer checkpointed under the
    policy, as `sharding.pipeline.onef1b` does, for ``dots``), 2 sequences of 16 tokens (fewer than the head
    width, so the score-sized and head-sized residuals differ; 128 with the flash kernel, one whole tile): its
    kept residuals are, to the byte, the priced ones (`models.spec._residuals` beyond the block input, with
    every query seeing all 16 keys; the flash kernel's none, its log-sum-exp in place of the reference's
    float32 output), as `sharding.costmodel.pipeline._saved_per_slot` selects them."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.spec import describe
    from models.transformer import _REMAT_POLICIES, Block
    from sharding.costmodel.layout import _per_token
    from sharding.costmodel.pipeline import residual_tags
    from sharding.mesh import parse_mesh
    from sharding.parallel import UNSHARDED
    from sharding.pipeline.split import LayerSplit
    from sharding.rules import get_rules

    config = get_config("test", overrides, remat=remat)
    graphdef, state = nnx.split(Block(config, rngs=nnx.Rngs(0)))

    def layer(w, h, positions, segment_ids):
        return nnx.merge(graphdef, w)(h, positions, segment_ids, UNSHARDED)

    if remat != "none":
        layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[remat], prevent_cse=False)
    flash = config.attention == "flash"
    rows, length, dtype = 2, 128 if flash else 16, jnp.dtype(config.dtype)
    h = jnp.zeros((rows, length, config.embed_dim), dtype)
    split = LayerSplit.trace(layer, state, h, h, (jnp.broadcast_to(jnp.arange(length), (rows, length)), None))
    tags = residual_tags(remat, not flash, dtype.itemsize < 4)
    mesh, keys = parse_mesh("fsdp=1", 1), 0 if flash else length
    priced = (
        rows * length * _per_token(describe(config), "residuals", get_rules("fsdp"), mesh, keys, dtype.itemsize, tags)
    )
    # the block input is the slot's input, held beside them (as `_saved_per_slot` prices the slot)
    priced -= rows * length * config.embed_dim * dtype.itemsize
    assert split.kept_bytes == priced, (split.kept_bytes, priced, split.kept_avals)
