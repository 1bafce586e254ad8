"""The cost model splits a sequence's length over the mesh axes its rules map ``length`` to
(`sharding.rules.Rules.length_split`), as the run does (`sharding.parallel.Parallelism.length_shards`, the
attention kernels' `jax.shard_map` specs), not over ``context`` x ``sequence`` whatever the rules: under
``--rule length=none`` a ``sequence`` axis splits nothing, and USP runs its all-to-all over the rule's last axis.
Every preset maps the length to ``context`` and ``sequence``, so presets price as before."""

import math

import pytest
from test_batch_rule import _rows

from models.attention import all_to_all_axes, layout_shards
from models.config import get_config
from sharding import axes as ax
from sharding import costmodel as cm
from sharding.mesh import parse_mesh
from sharding.parallel import Parallelism
from sharding.rules import PRESETS, get_rules

WHOLE = ["length=none", "act_length=none"]  # the length whole on every device, whatever the mesh
SWAPPED = ["length=sequence+context", "act_length=sequence+context"]  # sequence outer, context inner


def test_a_dry_run_prices_a_length_its_rules_keep_whole(capsys):
    """``data=2,sequence=4`` under ``--rule length=none --rule act_length=none``: ``sequence`` splits nothing, so
    each device runs its sequence's 32 tokens whole. Priced within 10% of the compiled step: the matrix products
    (0.170 GFLOP priced, 0.171 compiled; a quarter of them, 0.042, when the cost model split the length over
    ``sequence`` regardless) and the gradients' all-reduce (3.50 MiB both; 7.07 with a reduction over the
    length's devices), and no key/value gather over ``sequence``, which the step does not run."""
    from train import train

    args = ["--model", "test", "--seq-len", "32", "--batch-size", "2", "--mesh", "data=2,sequence=4", "--dry-run"]
    assert train.main([*args, *(f for rule in WHOLE for f in ("--rule", rule))]) == 0
    out = capsys.readouterr().out
    rows = _rows(out[out.index("cost model (sharding.costmodel") :])
    for label in ("matrix-product FLOPs", "all-reduce"):
        predicted, compiled = rows[label]
        assert abs(predicted - compiled) <= 0.10 * compiled, (label, predicted, compiled)
    assert "all-gather" not in rows, rows


@pytest.mark.parametrize(
    "mesh, overrides, split",
    [
        ("data=2,sequence=4", WHOLE, 1),
        ("context=2,sequence=2,data=2", ["length=sequence", "act_length=sequence"], 2),
        ("context=2,sequence=4", SWAPPED, 8),
        ("context=2,sequence=4", [], 8),  # the preset: context x sequence
        ("data=2,sequence=2,tensor=2", [], 2),
    ],
)
def test_the_cost_model_splits_the_length_as_the_run_does(mesh, overrides, split):
    """The layout the cost model prices for a run (`sharding.costmodel.layout_of`) splits each sequence over as
    many devices as the run (`Parallelism.length_shards`, what its attention's specs read) and the hand count
    of the rule's axes; priced tokens per device are the sequence's over that split."""
    par = Parallelism(parse_mesh(mesh, 8), get_rules("fsdp_tp", overrides))
    layout = cm.layout_of(par, get_config("test"), attention="ring")  # priced over any split of the length
    assert layout.length_split == par.length_shards == split
    cost = cm.device_cost(get_config("test"), layout, seq_len=32, rows=1, backend="cpu")
    assert cost.memory.batch == 5 * 32 / split * 4  # tokens, targets, positions, segment ids, mask: int32 each


@pytest.mark.parametrize("mesh, overrides", [("context=2,sequence=4", SWAPPED), ("context=2,sequence=4", [])])
def test_usp_is_priced_over_the_axes_its_kernel_runs_on(mesh, overrides):
    """USP runs its all-to-all over the length rule's last axis and its ring over the others
    (`models.attention.all_to_all_axes`, `layout_shards`): under ``--rule length=sequence+context`` that is an
    all-to-all over ``context`` (2) and a ring over ``sequence`` (4), which the cost model prices (it priced an
    all-to-all over ``sequence`` and a ring over ``context``, 0.12 and 0.09 MiB where the compiled step moves
    0.09 and 0.14); under the preset the all-to-all is over ``sequence``."""
    par = Parallelism(parse_mesh(mesh, 8), get_rules("fsdp_tp", overrides))
    layout = cm.layout_of(par, get_config("test"), attention="usp")
    comms = cm.device_cost(get_config("test"), layout, seq_len=32, rows=1, backend="cpu").comms
    (a2a,) = {(c.axes, c.group) for c in comms if c.kind == "all-to-all"}
    (ring,) = {(c.axes, c.group) for c in comms if c.kind == "collective-permute"}
    inner = all_to_all_axes("usp", par)
    assert a2a == (inner, math.prod(par.mesh_shape[a] for a in inner))
    assert ring[1] == layout_shards("usp", par)
    assert set(ring[0]) | set(inner) == set(par.rules.length_axes(par.mesh_shape))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_splits_the_length_over_context_and_sequence(preset):
    """What keeps every preset's prices as they were when the cost model multiplied the fixed axes: each maps
    the length to `sharding.axes.LENGTH_MESH_AXES` (sizes 1 left out)."""
    rules, mesh = get_rules(preset), {ax.CONTEXT: 2, ax.SEQUENCE: 1, ax.DATA: 4}
    assert rules.mesh_axes(ax.LENGTH) == ax.LENGTH_MESH_AXES
    assert rules.length_axes(mesh) == (ax.CONTEXT,)
    assert rules.length_split(mesh) == cm.Layout(mesh, preset).length_split == 2


def test_the_pipeline_heads_fallback_line_names_the_rules_batch_axes():
    """A batch the head's rows do not divide over: the line names the axes the rules split the batch over
    (``fsdp`` and ``stage`` under ``--rule batch=fsdp``), not ``data x fsdp``."""
    from types import SimpleNamespace

    from sharding.pipeline import layout as pl
    from train.reports import report

    layout, _ = pl.plan_layout(4, 2)
    rules = get_rules("fsdp_tp", ["batch=fsdp"])
    par = Parallelism(parse_mesh("stage=2,data=2,fsdp=2", 8), rules, pipeline=pl.PipelinePlan(layout, 3))
    line = report.head_line(SimpleNamespace(par=par), 3)
    assert "computed by every stage (batch 3 not divisible by fsdp x stage = 4)" in line, line


def test_a_context_axis_the_length_rule_leaves_out_does_not_bar_reference_attention():
    """The cost model prices a kernel that keeps the length whole over a split ``sequence`` but not over
    ``context`` (`sharding.costmodel.layout.unpriced_attention`): under ``--rule length=sequence`` a ``context``
    axis splits no sequence, so reference attention is priced there (within 1% of the compiled step's products
    on ``context=2,sequence=2,data=2``, 0.085 GFLOP both), while the preset, whose length it splits, is refused."""
    model, mesh = get_config("test"), {ax.CONTEXT: 2, ax.SEQUENCE: 2, ax.DATA: 2}
    kept = cm.Layout(mesh, get_rules("fsdp_tp", ["length=sequence", "act_length=sequence"]), attention="reference")
    assert cm.attention_of(cm.describe_model(model), kept).name == "reference"
    with pytest.raises(ValueError, match="over context=2"):
        cm.attention_of(cm.describe_model(model), cm.Layout(mesh, "fsdp_tp", attention="reference"))
