"""The distributed optimizer over ``data`` (ZeRO stage 1, `sharding.zero`): exact against one device, resumable
either way onto another mesh, 1/data of the state in the compiled step, and priced as compiled.

The reference is the flat test model on one device in float32; the distributed runs are pipelined, over
``data=4,stage=2`` and ``data=2,tensor=2,stage=2``, so the master slices, the stage storage and the tensor
split compose.
"""

import functools

import jax
import numpy as np
import pytest
from costmodel_grid import block_bytes, compiled_figures, predicted
from test_pipeline import _batch as packed_batch

from checkpoints.manager import CheckpointManager, restore_state
from checkpoints.meta import RunMeta
from models.config import get_config
from sharding import costmodel as cm
from sharding import pipeline as pl
from sharding.errors import ConfigError
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Accumulation, Parallelism
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


def _trainer(mesh_spec: str, devices: int = 8, optimizer_sharding: str = "data", microbatches: int = 2) -> Trainer:
    mesh = parse_mesh(mesh_spec, devices)
    config = get_config("test", [f"num_layers={LAYERS}"])
    strategy = Accumulation()
    if mesh.get("stage", 1) > 1:
        strategy = pl.PipelinePlan(pl.plan_layout(LAYERS, mesh["stage"])[0], microbatches)
    par = Parallelism.of(make_mesh(mesh, jax.devices()[:devices]), get_rules("fsdp_tp"), strategy)
    return Trainer(config, OPTIMIZER, par.replace(optimizer_sharding=optimizer_sharding))


def _batch(seed: int) -> dict:
    """A packed batch of ``[BATCH, LENGTH]`` (documents of ~20 tokens, three quarters of positions counted)."""
    return packed_batch(BATCH, LENGTH, seed, unmasked=0.75)


def _canonical(trainer, state) -> dict:
    """The state on the host with its layer stacks in the canonical ``[layers, ...]`` order."""
    return jax.tree.map(np.asarray, trainer.relayout_state(state, None) if trainer.storage is not None else state)


@functools.cache
def _trained(mesh_spec: str, devices: int = 8, optimizer_sharding: str = "data"):
    """``(trainer, state after STEPS steps, losses)`` of a run on ``mesh_spec`` (once per module)."""
    trainer = _trainer(mesh_spec, devices, optimizer_sharding)
    step = trainer.train_step(BATCH, LENGTH)
    state, losses = trainer.init_state(0), []
    for i in range(STEPS):
        state, metrics = step(state, _batch(i), trainer.signals(False))
        assert bool(metrics["finite"])
        losses.append(float(metrics["loss"]))
    return trainer, state, losses


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
