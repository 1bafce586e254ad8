"""The distributed optimizer over ``data`` (ZeRO stage 1, `sharding.zero`): exact against one device, resumable
either way onto another mesh, 1/data of the state in the compiled step, and priced as compiled.

The reference is the flat test model on one device in float32; the distributed runs are pipelined, over
``data=4,stage=2`` and ``data=2,tensor=2,stage=2``, so the master slices, the stage storage and the tensor
split compose.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from costmodel_grid import block_bytes, compiled_figures, predicted
from test_pipeline import _batch as packed_batch

from checkpoints.manager import CheckpointManager, restore_state
from checkpoints.meta import RunMeta
from models.config import get_config
from sharding import costmodel as cm
from sharding import hlo
from sharding import pipeline as pl
from sharding.costmodel import zero as cm_zero
from sharding.errors import ConfigError
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Parallelism
from sharding.planner import search
from sharding.rules import get_rules
from sharding.zero import master_spec
from train import train
from train.launcher.replan import choose
from train.runtime.optimizer import OptimizerConfig
from train.runtime.step import Trainer
from train.setup.cli import parse
from train.setup.flagnames import render
from train.setup.flags import parallelism_flags
from train.setup.startup import prepare

STEPS, BATCH, LENGTH, LAYERS = 6, 8, 32, 2
# Full-size updates from the first step. AdamW's eps at 1e-3 (as the other multi-step exactness tests take it):
# at the default 1e-8 an embedding row of a token whose gradients nearly cancel moves by a whole step of
# either sign, set by float rounding, which any change of summation order (a reduce-scatter's, a pipeline's)
# flips, in the flat reference against itself on another mesh as much as here.
OPTIMIZER = OptimizerConfig(warmup=1, decay_steps=8, eps=1e-3)


def _trainer(
    mesh_spec: str,
    devices: int = 8,
    optimizer_sharding: str = "data",
    microbatches: int = 2,
    sets: tuple = (),
    preset: str = "test",
) -> Trainer:
    """A trainer of ``preset`` (``LAYERS`` layers, ``sets`` further ``--set`` overrides) on ``mesh_spec``."""
    mesh = parse_mesh(mesh_spec, devices)
    config = get_config(preset, [f"num_layers={LAYERS}", *sets])
    plan = None
    if mesh.get("stage", 1) > 1:
        plan = pl.PipelinePlan(pl.plan_layout(LAYERS, mesh["stage"])[0], microbatches)
    par = Parallelism.of(make_mesh(mesh, jax.devices()[:devices]), get_rules("fsdp_tp"), pipeline=plan)
    return Trainer(config, OPTIMIZER, par.replace(optimizer_sharding=optimizer_sharding))


def _batch(seed: int) -> dict:
    """A packed batch of ``[BATCH, LENGTH]`` (documents of ~20 tokens, three quarters of positions counted)."""
    return packed_batch(BATCH, LENGTH, seed, unmasked=0.75)


def _canonical(trainer, state) -> dict:
    """The state on the host with its layer stacks in the canonical ``[layers, ...]`` order."""
    return jax.tree.map(np.asarray, trainer.relayout_state(state, None) if trainer.storage is not None else state)


@functools.cache
def _trained(
    mesh_spec: str,
    devices: int = 8,
    optimizer_sharding: str = "data",
    sets: tuple = (),
    rounded: bool = False,
    steps: int = STEPS,
    preset: str = "test",
):
    """``(trainer, state after ``steps`` steps, losses)`` of a run on ``mesh_spec`` (once per module); ``rounded``:
    the forward sees the parameters rounded to bfloat16 by `_round_parameters` in place of the trainer's own
    ``compute_params``."""
    trainer = _trainer(mesh_spec, devices, optimizer_sharding, sets=sets, preset=preset)
    if rounded:
        trainer.compute_params = _round_parameters
    step = trainer.train_step(BATCH, LENGTH)
    state, losses = trainer.init_state(0), []
    for i in range(steps):
        state, metrics = step(state, _batch(i), trainer.signals(False))
        assert bool(metrics["finite"])
        losses.append(float(metrics["loss"]))
    return trainer, state, losses


def _round_parameters(params):
    """The casts the distributed optimizer's bfloat16 gather makes, written out where the parameters lie: each
    float32 parameter rounded to bfloat16 and widened back (no gather)."""
    return jax.tree.map(lambda p: p.astype(jnp.bfloat16).astype(p.dtype), params)


def _assert_close(actual, expected, rtol=1e-5):
    """float32 agreement to ``rtol`` of each array's largest magnitude (entries near zero included)."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * float(np.max(np.abs(e)) or 1.0))


@pytest.mark.parametrize("mesh_spec", ["data=4,stage=2", "data=2,tensor=2,stage=2"])
def test_six_steps_equal_the_flat_one_device_reference(mesh_spec):
    """Losses of six steps to 1e-5 relative, then the parameters and both moments, against the unsplit model
    on one device; the state really is split over ``data`` (its moments as their master copies)."""
    _, reference, ref_losses = _trained("data=1", 1, "replicated")
    trainer, state, losses = _trained(mesh_spec)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got, want = _canonical(trainer, state), jax.tree.map(np.asarray, reference)
    _assert_close(got["params"], want["params"])
    _assert_close(got["opt_state"], want["opt_state"])
    up = state["params"]["layers"]["mlp"]["up"]
    assert "data" in jax.tree.leaves(tuple(up.sharding.spec))
    assert state["opt_state"][1][0].mu["layers"]["mlp"]["up"].sharding == up.sharding
    # the cost model's state per device, part by part, against the blocks the pipelined state holds
    cost = cm.estimate(trainer.config, BATCH, LENGTH, cm.layout_of(trainer.par, trainer.config), backend="cpu")
    held = {part: block_bytes(trainer.abstract_state()[part]) for part in ("params", "opt_state")}
    assert cost.memory.parameters == pytest.approx(held["params"], rel=0.10)
    assert cost.memory.optimizer == pytest.approx(held["opt_state"], rel=0.10)


@pytest.mark.parametrize(
    "mesh_spec, devices, preset, sets",
    [
        # the length split over sequence, attention by all-to-all over it (a shard_map kernel)
        ("data=2,sequence=2", 4, "test", ("attention=ulysses",)),
        # a mixture of experts, its experts split over expert (and tensor), its tokens over data and expert
        ("data=2,expert=2,tensor=2", 8, "moe-test", ()),
    ],
    ids=["data=2,sequence=2", "moe data=2,expert=2,tensor=2"],
)
def test_six_steps_with_sequence_and_expert_axes_equal_the_flat_reference(mesh_spec, devices, preset, sets):
    """Losses of six steps to 1e-5 relative, then the parameters and moments to 1e-5, against the same model on
    one device (reference attention, the experts in one place), with the state split over ``data``."""
    _, reference, ref_losses = _trained("data=1", 1, "replicated", preset=preset)
    trainer, state, losses = _trained(mesh_spec, devices, sets=sets, preset=preset)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got, want = jax.tree.map(np.asarray, state), jax.tree.map(np.asarray, reference)
    _assert_close(got["params"], want["params"])
    _assert_close(got["opt_state"], want["opt_state"])
    split = [a for a in jax.tree.leaves(state["params"]) if "data" in jax.tree.leaves(tuple(a.sharding.spec))]
    assert len(split) == len(jax.tree.leaves(state["params"])), (
        "every array of these models has a dimension data divides"
    )


@pytest.mark.parametrize(
    "saved_on, saved, devices, resumed_on, resumed",
    [
        ("data=4,stage=2", "data", 8, "data=2,tensor=2,stage=2", "replicated"),
        ("data=1", "replicated", 1, "data=4,stage=2", "data"),
    ],
)
def test_a_checkpoint_resumes_with_and_without_it_onto_another_mesh(
    tmp_path, saved_on, saved, devices, resumed_on, resumed
):
    """The state of six steps saved with one optimizer sharding restores value for value onto another mesh with
    the other (the stage storage re-laid too), and the record says how it was saved."""
    trainer, state, _ = _trained(saved_on, devices, saved)
    meta = RunMeta(
        model=trainer.config.to_dict(),
        preset="test",
        mesh=dict(trainer.par.mesh_shape),
        rules={},
        data={},
        tokenizer={},
        pipeline=trainer.layout_meta(),
        optimizer_sharding=saved,
    )
    target = _trainer(resumed_on, optimizer_sharding=resumed)
    manager = CheckpointManager(tmp_path / "ckpt", async_save=False)
    try:
        manager.save(STEPS, state, meta.to_json())
        restored, read = restore_state(manager, target.state_layout, STEPS)
    finally:
        manager.close()
    assert read.optimizer_sharding == saved
    up = restored["params"]["layers"]["mlp"]["up"]
    assert up.sharding == target.state_shardings["params"]["layers"]["mlp"]["up"]
    assert ("data" in jax.tree.leaves(tuple(up.sharding.spec))) == (resumed == "data")
    np.testing.assert_equal(jax.tree.leaves(_canonical(target, restored)), jax.tree.leaves(_canonical(trainer, state)))


def test_master_spec_adds_data_innermost_to_the_largest_block_it_divides():
    mesh = {"data": 4, "tensor": 2}
    assert master_spec((2, 128, 384), jax.sharding.PartitionSpec(None, None, "tensor"), mesh) == (
        jax.sharding.PartitionSpec(None, None, ("tensor", "data"))
    )
    assert master_spec((4, 6), jax.sharding.PartitionSpec(), mesh) == jax.sharding.PartitionSpec("data")
    assert master_spec((3, 5), jax.sharding.PartitionSpec(), mesh) == jax.sharding.PartitionSpec()


# The compiled step and the cost model ---------------------------------------------------------------------

ZERO_CASES = [  # costmodel_grid's cases: (model, mesh, rules, batch, seq_len, microbatches, remat)
    ("test", "data=4,tensor=2", "fsdp_tp", 16, 64, 1, "none"),
    ("test", "data=2,fsdp=2,tensor=2", "fsdp_tp", 16, 64, 1, "none"),
    # fsdp splits the MLP and output weights on one dimension and data lands on another: XLA:CPU sums their
    # gradients over fsdp, then over data, each of the whole gradient (`sharding.costmodel.zero.cpu_two_step`)
    ("test", "data=4,fsdp=2", "fsdp_tp", 16, 64, 1, "none"),
    # pipelines (GPipe, 2 microbatches, even stages): the embedding looked up vocabulary-parallel over
    # tensor x stage, never gathered (`sharding.costmodel.pipeline_comms._vocabulary_over_stage`), and the head's
    # gradients summed whole over data x stage once, their slice's all-reduce over data gone
    # (`sharding.costmodel.zero.replaced_all_reduce`)
    ("test", "data=4,stage=2", "fsdp_tp", 16, 64, 2, "none", None, 1),
    ("test", "data=2,tensor=2,stage=2", "fsdp_tp", 16, 64, 2, "none", None, 1),
    # 8 layers of width 100 on data=8: the norms' and MLP's slices have no dimension 8 divides, their [8, ...]
    # stacks do, and the state splits them along the layers (`sharding.costmodel.zero.held_array`; priced on
    # one layer's slice, they were whole: parameters and moments 2.3x the compiled, no all-gather of them)
    ("test+num_layers=8+embed_dim=100+mlp_dim=100", "data=8", "dp", 16, 64, 1, "none"),
]


@functools.cache
def _compiled(case, optimizer_sharding: str):
    """``(compiled figures, the cost model's Cost)`` of one grid case with ``optimizer_sharding``."""
    return compiled_figures(case, optimizer_sharding), predicted(case, optimizer_sharding)


def test_the_compiled_state_at_data_4_is_a_quarter_of_the_replicated_one():
    """On ``data=4,tensor=2`` the parameters and moments one device holds, as the compiled step takes them as
    arguments, are exactly 1/4 of the replicated step's (every array of the test model has a dimension 4
    divides); the step then all-gathers the parameters over ``data``, which the replicated step never does."""
    case = ZERO_CASES[0]
    (replicated, _), (zero, _) = _compiled(case, "replicated"), _compiled(case, "data")
    for part in ("params", "opt_state"):
        assert zero["state_bytes"][part] * 4 == replicated["state_bytes"][part]
    saved = sum(replicated["state_bytes"].values()) * 3 / 4
    assert replicated["arguments"] - zero["arguments"] == saved
    assert "all-gather" in zero["collectives"] and "all-gather" not in replicated["collectives"]


@pytest.mark.parametrize("case", ZERO_CASES, ids=lambda c: c[1])
def test_the_cost_model_prices_the_state_and_collectives_as_compiled(case):
    """Parameters and moments per device against the compiled step's arguments, each within 10% (here exact),
    and the bytes of each collective kind against its HLO within 10%."""
    figures, cost = _compiled(case, "data")
    assert cost.memory.parameters == pytest.approx(figures["state_bytes"]["params"], rel=0.10)
    assert cost.memory.optimizer == pytest.approx(figures["state_bytes"]["opt_state"], rel=0.10)
    assert cost.argument_bytes == pytest.approx(figures["arguments"], rel=0.10)
    pred = cm.collective_bytes(cost.comms)
    assert set(pred) == set(figures["collectives"])
    for kind, got in figures["collectives"].items():
        assert pred[kind] == pytest.approx(got, rel=0.10), kind


def test_on_gpu_the_gradients_all_reduce_becomes_a_reduce_scatter_and_an_all_gather():
    """For planning (GPU), the all-reduce of a gradient over ``data`` is priced as the reduce-scatter of its
    slice plus the all-gather of the new parameters: the same bytes on the links, the state at 1/4."""
    config = get_config("test", [f"num_layers={LAYERS}"])
    costs = {
        z: cm.estimate(config, 16, 64, cm.Layout({"data": 4}, "dp", optimizer_sharding=z), backend="gpu")
        for z in ("replicated", "data")
    }
    rep, zero = (cm.collective_bytes(costs[z].comms) for z in ("replicated", "data"))
    assert set(rep) == {"all-reduce"} and set(zero) == {"reduce-scatter", "all-gather"}
    wire = {z: sum(c.wire_bytes() * c.count for c in costs[z].comms) for z in costs}
    assert wire["data"] == pytest.approx(wire["replicated"], rel=1e-6)
    assert costs["data"].memory.state == pytest.approx(costs["replicated"].memory.state / 4)


# Gathered in the compute dtype -----------------------------------------------------------------------------

BF16, BF16_STEPS = ("dtype=bfloat16",), 3


def test_with_bfloat16_compute_the_step_equals_one_that_rounds_the_parameters_itself():
    """With bfloat16 compute the parameters are rounded to bfloat16 before the gather: three steps on ``data=4``
    equal, losses to 1e-5 relative, parameters and moments to 1e-5, those of the replicated state on the same mesh
    whose forward sees every parameter rounded to bfloat16 and widened back (`_round_parameters`); without the
    rounding the losses part by more (1.7e-4 measured at the second step: the norm scales, which the model
    uses in float32, move by less than bfloat16's spacing near 1).

    The reference is on ``data=4`` rather than one device because bfloat16 arithmetic itself depends on the
    layout: each device rounds its share of a weight's gradient to bfloat16 before the float32 sum, so the same
    replicated run on one device and on ``data=4`` parts by about 1e-4 in the losses, as much as the rounding
    under test; on one mesh only the gather and the reduction's form differ."""
    _, reference, ref_losses = _trained("data=4", 4, "replicated", BF16, rounded=True, steps=BF16_STEPS)
    _, state, losses = _trained("data=4", 4, "data", BF16, steps=BF16_STEPS)
    _, _, plain_losses = _trained("data=4", 4, "replicated", BF16, steps=BF16_STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got, want = jax.tree.map(np.asarray, state), jax.tree.map(np.asarray, reference)
    _assert_close(got["params"], want["params"])
    _assert_close(got["opt_state"], want["opt_state"])
    assert max(abs(p - r) / r for p, r in zip(plain_losses, ref_losses)) > 1e-4


def test_with_bfloat16_compute_the_parameters_are_gathered_in_bfloat16_as_priced():
    """The partitioned step on ``data=4`` gathers every parameter in bfloat16 (read before XLA:CPU's float
    normalisation, which upcasts bfloat16 collectives: `sharding.hlo.text_before_pass`), half the bytes of the
    float32 gather, and the cost model's GPU price of the gathers (the compute dtype's bytes) is those bytes
    within 10%; the CPU compile's collectives, upcast, are as the CPU price says."""
    trainer = _trained("data=4", 4, "data", BF16, steps=BF16_STEPS)[0]
    lowered = trainer.train_step(BATCH, LENGTH).lower(*trainer.abstract_train_args(BATCH, LENGTH))
    gathers = [c for c in hlo.collectives(hlo.text_before_pass(lowered)) if c.op == "all-gather"]
    assert gathers and {c.dtype for c in gathers} == {"bf16"}
    layout = cm.layout_of(trainer.par, trainer.config)
    gpu = cm.collective_bytes(cm.estimate(trainer.config, BATCH, LENGTH, layout, backend="gpu").comms)
    params = sum(math.prod(p.shape) for p in jax.tree.leaves(trainer.abstract_state()["params"]))
    assert sum(c.total_bytes for c in gathers) == params * 2  # every parameter, whole, in bfloat16
    assert gpu["all-gather"] == pytest.approx(params * 2, rel=0.10)
    compiled = cm.collective_bytes(hlo.collectives(lowered.compile().as_text()))
    cpu = cm.collective_bytes(cm.estimate(trainer.config, BATCH, LENGTH, layout, backend="cpu").comms)
    assert set(cpu) == set(compiled) and compiled["all-gather"] == params * 4
    for kind, got in compiled.items():
        assert cpu[kind] == pytest.approx(got, rel=0.10), kind


# The command line and the planner -------------------------------------------------------------------------


def test_the_flag_round_trips_and_the_uneven_step_refuses_it():
    run = parse(["--model", "test", "--mesh", "data=4,stage=2", "--microbatches", "2", "--optimizer-sharding", "data"])
    flags = parallelism_flags(run.parallelism)
    assert flags[-2:] == ["--optimizer-sharding", "data"]
    assert parse(["--model", "test", *flags]).parallelism.optimizer_sharding == "data"
    with pytest.raises(ConfigError) as refused:
        parse(
            ["--model", "test", "--mesh", "data=8", "--hetero-batch", "3,3,3,3,1,1,1,1", "--optimizer-sharding", "data"]
        )
    assert render(refused.value).startswith("--optimizer-sharding data: the uneven data-parallel step (--hetero-batch)")
    assert render(refused.value).endswith("use --optimizer-sharding replicated")


def test_the_planner_tries_the_split_state_before_the_next_recompute():
    layout = cm.Layout({"data": 4, "tensor": 2}, "fsdp_tp")
    tried = [(v.remat, v.optimizer_sharding) for v in search._state_variants(layout, ("none", "full"), "uniform")]
    assert tried == [("none", "replicated"), ("none", "data"), ("full", "replicated"), ("full", "data")]
    assert [v.optimizer_sharding for v in search._state_variants(layout, ("none",), "uneven")] == ["replicated"]
    alone = cm.Layout({"fsdp": 8}, "fsdp_tp")
    assert [v.optimizer_sharding for v in search._state_variants(alone, ("none",), "uniform")] == ["replicated"]


# A mesh without a data axis ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh, shown, works",
    [
        ("fsdp=8", "fsdp=8", "data=2,fsdp=4"),
        ("data=1,fsdp=-1", "fsdp=-1", "data=2,fsdp=-1"),
        ("stage=2,tensor=4", "stage=2,tensor=4", None),
    ],
)
def test_a_mesh_whose_data_axis_is_one_is_refused_naming_what_works(
    tmp_path, corpus, cache, capsys, monkeypatch, mesh, shown, works
):
    """``--optimizer-sharding data`` where the user's ``--mesh`` gives ``data`` as 1 (or leaves it out) would keep
    the state whole without a word: one line naming both flags and what works, before any device work; each
    suggestion gets past every start-up check (to the model's construction, stubbed here)."""

    def model_built(*_):
        raise RuntimeError("the model was built")

    monkeypatch.setattr(train, "build_trainer", model_built)
    argv = ["--model", "test", "--seq-len", "32", "--batch-size", "16", "--no-progress", "--data", str(corpus)]
    argv += ["--data-cache", str(cache), "--run-dir", str(tmp_path / "r"), "--microbatches", "2"]
    argv += ["--optimizer-sharding", "data"]
    assert train.main([*argv, "--mesh", mesh]) == 2
    example = f"a mesh with one, e.g. --mesh {works}, or " if works else ""
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --optimizer-sharding data on --mesh {shown}: the mesh has no data axis to split the optimizer "
        f"state over; use {example}--optimizer-sharding replicated"
    ]
    fixes = [["--mesh", mesh, "--optimizer-sharding", "replicated"]] + ([["--mesh", works]] if works else [])
    for fix in fixes:
        assert train.main([*argv, *fix]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == "error: the model was built", fix


def test_an_elastic_restart_down_to_one_data_rank_goes_on_with_a_note(corpus):
    """``--mesh data=-1`` leaves the data size to the devices: the elastic launcher's replan
    (`train.launcher.replan.choose`) accepts 2 processes and then 1 (data=1) with the split state asked for,
    and the one process's start-up says in a note that the state stays whole."""
    flags = ["--model", "test", "--cpu-devices", "1", "--mesh", "data=-1", "--batch-size", "6"]
    config = parse([*flags, "--optimizer-sharding", "data", "--data", str(corpus), "--dry-run"])
    assert choose(config, 2, 1) == (2, "data=2", [])
    assert choose(config, 1, 1) == (1, "data=1", [])
    lines = []
    resolved, _ = prepare(config, jax.devices()[:1], lines.append)
    assert resolved.parallelism.mesh_shape["data"] == 1
    assert lines == [
        "note: --mesh resolves to data=1, whose data axis is one device, so --optimizer-sharding data keeps the "
        "optimizer state whole (as replicated)"
    ]


# Arrays data does not divide ------------------------------------------------------------------------------


def test_an_array_data_does_not_divide_is_named_as_not_split_by_start_up_and_the_cost_model():
    """``data=8`` over an embedding width of 100: the norm scales ``[100]`` have no dimension 8 divides, so their
    float32 copies and moments stay whole; the start-up report (printed by ``--dry-run`` too) and the cost
    model's lines name each of them, and only them, rather than leaving them whole without a word."""
    from train.reports.report import startup
    from train.setup.config import resolve_mesh

    flags = ["--model", "test", "--set", "embed_dim=100", "--set", f"num_layers={LAYERS}", "--mesh", "data=8"]
    run = resolve_mesh(parse([*flags, "--optimizer-sharding", "data", "--batch-size", "8"]), 8)
    trainer = Trainer(run.model, OPTIMIZER, run.parallelism.on(make_mesh(run.parallelism.mesh_shape)))
    lines = startup(run, trainer)
    header = [line for line in lines if line.startswith("distributed optimizer: not split over data=8")]
    named = sorted(line.split()[2] for line in lines if line.startswith("  not split: "))
    assert len(header) == 1 and header[0].endswith(f"{len(named)} of 12 arrays"), lines
    assert named == ["final_norm/scale", "layers/attention_norm/scale", "layers/mlp_norm/scale"]
    priced = cm_zero.not_split(trainer.config, cm.layout_of(trainer.par, trainer.config))
    assert sorted(line.split()[2] for line in priced[1:]) == named
    replicated = resolve_mesh(parse([*flags, "--batch-size", "8"]), 8)
    assert cm_zero.not_split(replicated.model, cm.layout_of(replicated.parallelism, replicated.model)) == []


def test_the_start_up_report_says_the_optimizer_state_is_split_over_data_exactly_when_it_is():
    """Start-up (and ``--dry-run``) print one ``optimizer state: split over data=4`` line, counting the arrays
    split (all 12 of the test model's on ``data=4,fsdp=2``), with ``--optimizer-sharding data``; none without."""
    from train.reports.report import startup
    from train.setup.config import resolve_mesh

    flags = ["--model", "test", "--set", f"num_layers={LAYERS}", "--mesh", "data=4,fsdp=2", "--batch-size", "16"]
    for extra, want in (([], []), (["--optimizer-sharding", "data"], [12])):
        run = resolve_mesh(parse([*flags, *extra]), 8)
        trainer = Trainer(run.model, OPTIMIZER, run.parallelism.on(make_mesh(run.parallelism.mesh_shape)))
        found = [line for line in startup(run, trainer) if line.startswith("optimizer state:")]
        assert len(found) == len(want), found
        for line, split in zip(found, want):
            assert line.startswith("optimizer state: split over data=4 (distributed optimizer")
            assert f"moments of {split} of 12 arrays" in line, line
