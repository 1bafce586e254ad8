"""Logical-to-mesh rules: presets, overrides, collisions, divisibility, activation constraints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sharding import axes as ax
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import UNSHARDED, Parallelism
from sharding.rules import PRESETS, get_rules, logical_to_spec, tree_shardings


@pytest.mark.parametrize(
    "preset, names, expected",
    [
        ("dp", (ax.EMBED, ax.MLP), P()),
        ("dp", (ax.BATCH, ax.LENGTH, ax.ACT_EMBED), P(("data", "fsdp", "expert"), ("context", "sequence"))),
        ("fsdp", (ax.EMBED, ax.MLP), P(("fsdp", "expert"))),
        ("tp", (ax.EMBED, ax.MLP), P(None, "tensor")),
        ("tp", (ax.HEADS, ax.HEAD_DIM, ax.EMBED), P("tensor")),
        ("fsdp_tp", (ax.LAYERS, ax.EMBED, ax.HEADS, ax.HEAD_DIM), P(None, ("fsdp", "expert"), "tensor")),
        ("fsdp_tp", (ax.VOCAB, ax.EMBED), P("tensor", ("fsdp", "expert"))),
        ("fsdp_tp", (ax.LAYERS, ax.EXPERT, ax.EXPERT_EMBED, ax.MLP), P(None, "expert", "fsdp", "tensor")),
        ("fsdp_tp", (ax.BATCH, ax.LENGTH, ax.VOCAB), P(("data", "fsdp", "expert"), ("context", "sequence"), "tensor")),
    ],
)
def test_preset_specs(preset, names, expected):
    spec, dropped = logical_to_spec(names, get_rules(preset))
    assert spec == expected
    assert dropped == []


def test_overrides_remap_and_replicate():
    rules = get_rules("fsdp_tp", ["mlp=tensor+fsdp", "embed=none", "vocab="])
    assert logical_to_spec((ax.EMBED, ax.MLP), rules)[0] == P(None, ("tensor", "fsdp"))
    assert logical_to_spec((ax.VOCAB, ax.EMBED), rules)[0] == P()
    assert "mlp=tensor+fsdp" in rules.name


@pytest.mark.parametrize(
    "override, message",
    [
        (["mpl=tensor"], "unknown logical axis 'mpl'"),
        (["mlp=tensr"], "unknown mesh axis 'tensr'"),
        (["mlp"], "expected NAME=AXIS"),
        (["mlp=tensor+tensor"], "repeated"),
    ],
)
def test_override_errors(override, message):
    with pytest.raises(ValueError, match=message):
        get_rules("fsdp_tp", override)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="dp, fsdp, tp, fsdp_tp"):
        get_rules("zero3")


def test_two_logical_axes_on_one_mesh_axis_is_an_error_naming_both():
    rules = get_rules("fsdp_tp", ["mlp=fsdp"])
    with pytest.raises(ValueError) as info:
        logical_to_spec((ax.EMBED, ax.MLP), rules)
    assert "'embed' and 'mlp'" in str(info.value)
    assert "'fsdp'" in str(info.value)


def test_indivisible_dimension_is_replicated_and_reported():
    mesh = make_mesh(parse_mesh("fsdp=2,tensor=4", 8))
    rules = get_rules("fsdp_tp")
    tree = {
        "k": jax.ShapeDtypeStruct((8, 2, 16), jnp.float32),  # kv_heads=2 on tensor=4: not divisible
        "w": jax.ShapeDtypeStruct((8, 8), jnp.float32),
    }
    names = {"k": (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), "w": (ax.EMBED, ax.MLP)}
    shardings, report = tree_shardings(tree, names, mesh, rules)
    assert shardings["k"].spec == P("fsdp")
    assert shardings["w"].spec == P("fsdp", "tensor")
    assert [row[0] for row in report.reduced] == ["k"]
    assert report.reduced_bytes == 8 * 2 * 16 * 4
    text = report.format_replicated()
    assert "k (8, 2, 16)" in text and "tensor=4" in text
    assert f"{256 / (256 + 64):.1%}" in text


def test_partial_axes_kept_when_only_some_divide():
    spec, dropped = logical_to_spec((ax.BATCH,), get_rules("dp"), (2,), {"data": 2, "fsdp": 4})
    assert spec == P("data")
    assert [(d.mesh_axis, d.axis_size) for d in dropped] == [("fsdp", 4)]


def test_names_must_match_rank():
    with pytest.raises(ValueError, match="shape"):
        logical_to_spec((ax.EMBED,), get_rules("dp"), (4, 4), {"fsdp": 1})


def test_constrain_is_identity_without_rules_and_shards_with_them():
    x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)
    assert UNSHARDED.constrain(x, (ax.BATCH, ax.ACT_EMBED)) is x
    mesh = make_mesh(parse_mesh("data=2,fsdp=4", 8))

    @jax.jit
    def f(x):
        return Parallelism.of(mesh, get_rules("fsdp_tp")).constrain(x * 2, (ax.BATCH, ax.ACT_EMBED))

    y = f(x)
    assert y.sharding.spec == P(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)


def test_constrain_checks_rank():
    with pytest.raises(ValueError, match="rank 2"):
        UNSHARDED.constrain(jnp.zeros((2, 2)), (ax.BATCH,))


# A mesh with every axis that may split a batch > 1 (and tensor, which none of the presets' batch rules name).
EVERY_BATCH_AXIS = {ax.DATA: 2, ax.FSDP: 2, ax.EXPERT: 2, ax.TENSOR: 2}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_splits_the_batch_over_every_batch_axis(preset):
    """Under each preset (and its pipeline variant) the devices the batch is split over, read from the rules
    (`Rules.batch_split`: the cost model's `Layout.batch_split`, the run's `Parallelism.data_parallel`), are the
    mesh's ``data`` x ``fsdp`` x ``expert``, what every place read from `sharding.axes.BATCH_MESH_AXES`
    before; and those are the axes a batch's spec is split over."""
    from sharding import costmodel as cm
    from sharding.pipeline.layout import pipeline_rules

    mesh = dict.fromkeys(ax.MESH_AXES, 1) | EVERY_BATCH_AXIS
    for rules in (get_rules(preset), pipeline_rules(get_rules(preset))):
        assert set(rules.batch_axes(mesh)) == set(ax.BATCH_MESH_AXES), rules.name
        assert rules.batch_split(mesh) == 8
        assert Parallelism(mesh, rules).data_parallel == 8
        assert cm.Layout(mesh, rules).batch_split == 8
        spec, _ = logical_to_spec((ax.BATCH,), rules, (16,), mesh)
        assert set(spec[0]) == set(ax.BATCH_MESH_AXES)
    assert cm.Layout(mesh, preset).batch_split == 8


def test_a_batch_rule_override_sets_the_batch_split():
    """``--rule batch=data+fsdp`` on ``expert=4,fsdp=2``: the batch is split over ``fsdp`` alone (``data`` is
    1), 2 devices, not the 8 of ``data`` x ``fsdp`` x ``expert`` that both the cost model and the run took
    before; ``batch=none`` keeps it whole (1)."""
    from sharding import costmodel as cm

    mesh = parse_mesh("expert=4,fsdp=2", 8)
    rules = get_rules("fsdp_tp", ["batch=data+fsdp"])
    assert rules.batch_axes(mesh) == (ax.FSDP,)
    assert rules.batch_split(mesh) == Parallelism(mesh, rules).data_parallel == cm.Layout(mesh, rules).batch_split == 2
    assert get_rules("fsdp_tp", ["batch=none"]).batch_split(mesh) == 1
