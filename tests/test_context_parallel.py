"""Context parallelism end to end: rules, the model's sharded attention, data layout, CLI.

The kernels themselves are checked against the reference in `test_ring_attention.py`; here
they run as the model runs them (with a `Parallelism` on a mesh with data, sequence and tensor
axes, specs from the rules), the data pipeline permutes rows for the zigzag layout, and a
training run over a `sequence` axis reproduces the losses of one without it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import _procs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli_errors import raises_as_cli

from models.attention import (
    CONTEXT_LAYOUTS,
    attend,
    check_context_parallel,
    layout_shards,
    resolve_context_layout,
    ulysses_mesh,
)
from models.attention_reference import reference_attention
from models.config import PRESETS as MODEL_PRESETS
from models.kernels.ring_attention import uneven_zigzag_layout, zigzag_permutation
from models.transformer import abstract_model
from sharding import axes as ax
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import UNSHARDED, Parallelism
from sharding.rules import PRESETS as RULE_PRESETS
from sharding.rules import get_rules, logical_to_spec
from train import train
from train.data import context_permutation, pack_windows, permute_length

SMALL = [
    "--model",
    "test",
    "--seq-len",
    "64",
    "--batch-size",
    "4",
    "--log-every",
    "1",
    "--no-progress",
    "--eval-batches",
    "1",
]


# Rules -------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(RULE_PRESETS))
def test_activation_length_maps_to_context_and_sequence_in_every_preset(preset):
    spec, _ = logical_to_spec((ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM), get_rules(preset))
    assert spec[1] == (ax.CONTEXT, ax.SEQUENCE)


@pytest.mark.parametrize("model", ["test", "7b"])
def test_no_parameter_carries_the_length_axis(model):
    """Parameters are never split over `sequence`: no parameter names `length`."""
    _, abstract, names = abstract_model(MODEL_PRESETS[model])
    leaves = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    assert len(leaves) == len(jax.tree.leaves(abstract))
    assert all(ax.LENGTH not in leaf for leaf in leaves)
    rules, sizes = get_rules("fsdp_tp"), {"data": 1, "stage": 1, "fsdp": 1, "sequence": 8, "tensor": 1}
    for leaf, shape in zip(leaves, (x.shape for x in jax.tree.leaves(abstract))):
        spec, _ = logical_to_spec(leaf, rules, shape, sizes)
        assert ax.SEQUENCE not in jax.tree.leaves(tuple(spec))


# The model's sharded attention ------------------------------------------------------------


def _attention_inputs(heads, kv_heads, length=64, batch=2, head_dim=16):
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    q = jax.random.normal(keys[0], (batch, length, heads, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (batch, length, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (batch, length, kv_heads, head_dim), jnp.float32)
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    segments = jnp.asarray(np.repeat(np.arange(4, dtype=np.int32), length // 4)[None].repeat(batch, 0))
    segments = segments.at[1].set(0)
    return q, k, v, d_out, segments


@functools.cache
def _reference_attention_grads(heads, kv_heads):
    """``((loss, out), (dq, dk, dv))`` of one-device causal reference attention on `_attention_inputs` with
    ``heads`` and ``kv_heads``: the same for every kernel, layout and mesh, so computed once per head counts."""
    q, k, v, d_out, segments = _attention_inputs(heads, kv_heads)

    def reference(q, k, v):
        out = reference_attention(q, k, v, causal=True, q_segment_ids=segments, kv_segment_ids=segments)
        return jnp.sum(out * d_out), out

    return jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2), has_aux=True))(q, k, v)


@pytest.mark.parametrize(
    "impl, layout, heads, kv_heads, mesh, ring",
    [
        # heads split over tensor, the one KV head sliced on each device
        ("ring", "zigzag", 4, 1, "data=2,sequence=2,tensor=2", 2),
        # 4 heads and 2 KV heads per tensor shard, over sequence=2
        ("ulysses", "contiguous", 8, 4, "data=2,sequence=2,tensor=2", 2),
        # 1 KV head per tensor shard, repeated to 2 for sequence=2
        ("ulysses", "zigzag", 8, 2, "data=2,sequence=2,tensor=2", 2),
        # USP: all-to-all over sequence (KV heads repeated), ring over context (zigzag over the ring)
        ("usp", "zigzag", 8, 2, "context=2,sequence=2,tensor=2", 2),
        ("usp", "zigzag", 4, 2, "context=2,sequence=4", 2),
        ("usp", "zigzag", 4, 1, "context=4,sequence=2", 4),
        ("usp", "contiguous", 4, 2, "data=2,context=2,sequence=2", 2),
    ],
)
def test_sharded_attention_under_the_rules_matches_the_reference(impl, layout, heads, kv_heads, mesh, ring):
    """`attend` as the model calls it, specs from fsdp_tp; ``ring``: the devices the zigzag layout deals
    chunks over (the length's devices, or for USP those of the context axis)."""
    mesh = make_mesh(parse_mesh(mesh, 8))
    rules = get_rules("fsdp_tp")
    q, k, v, d_out, segments = _attention_inputs(heads, kv_heads)
    par = Parallelism.of(mesh, rules, context_layout=layout)
    assert layout_shards(impl, par) == ring
    perm = zigzag_permutation(q.shape[1], ring) if layout == "zigzag" else np.arange(q.shape[1])
    natural = np.argsort(perm)

    def sharded(q, k, v):
        out = attend(impl, q[:, perm], k[:, perm], v[:, perm], segments[:, perm], causal=True, par=par)
        return jnp.sum(out[:, natural] * d_out), out[:, natural]

    (_, got), got_grads = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    (_, want), want_grads = _reference_attention_grads(heads, kv_heads)
    for a, b in zip((got, *got_grads), (want, *want_grads)):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("impl", ["reference", "flash"])
def test_natural_order_attention_refuses_the_zigzag_layout(impl):
    q, k, v, _, segments = _attention_inputs(4, 2)
    with raises_as_cli(ValueError, match=f"--attention {impl} assumes tokens in natural order"):
        attend(impl, q, k, v, segments, layout="zigzag", par=UNSHARDED)


def test_auto_layout_is_zigzag_for_ring_over_a_split_length_only():
    assert resolve_context_layout("auto", "ring", 4) == "zigzag"
    assert resolve_context_layout("auto", "ring", 1) == "contiguous"
    assert resolve_context_layout("auto", "ulysses", 4) == "contiguous"
    assert resolve_context_layout("auto", "flash", 4) == "contiguous"
    assert resolve_context_layout("zigzag", "ulysses", 4) == "zigzag"
    assert resolve_context_layout("contiguous", "ring", 4) == "contiguous"
    choices = next(a.choices for a in train.build_parser()._actions if a.dest == "context_layout")
    assert tuple(choices) == CONTEXT_LAYOUTS


# Data ----------------------------------------------------------------------------------------


def test_the_data_pipeline_permutes_every_field_alike():
    windows = np.random.default_rng(0).integers(0, 50, size=(3, 33))
    windows[:, ::7] = 0  # end-of-document tokens: several segments per row
    natural = pack_windows(windows, eod_id=0)
    perm = context_permutation(32, 4, "zigzag")
    np.testing.assert_array_equal(perm, zigzag_permutation(32, 4))
    laid_out = permute_length(natural, perm)
    for name, value in natural.items():
        np.testing.assert_array_equal(laid_out[name], value[:, perm])
    # the same (token, target, position, segment, mask) tuples, in another order
    rows = lambda d, r: sorted(zip(*(d[f][r].tolist() for f in sorted(d))))
    assert all(rows(laid_out, r) == rows(natural, r) for r in range(3))
    assert context_permutation(32, 4, "contiguous") is None
    assert context_permutation(32, 1, "zigzag") is None
    # uneven shares: blocks of 12 positions, padding 0 in every field (no loss, segment 0), the same tokens
    uneven = permute_length(natural, context_permutation(32, 4, "zigzag", shares=(12, 4, 8, 8)))
    pad = uneven_zigzag_layout((12, 4, 8, 8), 12) < 0
    assert all(value.shape == (3, 48) and not value[:, pad].any() for value in uneven.values())
    real = {name: value[:, ~pad] for name, value in uneven.items()}
    assert all(rows(real, r) == rows(natural, r) for r in range(3))
    with pytest.raises(ValueError, match="--seq-len 36: --context-layout zigzag needs a multiple of 2 x 4"):
        context_permutation(36, 4, "zigzag")


# CLI: refused before compiling ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--attention", "ring", "--mesh", "data=2,sequence=4", "--seq-len", "36"],
            "--seq-len 36: --context-layout zigzag cuts each sequence into 2 x 4",
        ),
        (
            ["--attention", "ulysses", "--mesh", "sequence=8"],
            "heads (4) per device is not divisible by 8; use a sequence axis of 4, or ring attention "
            "(--attention ring); e.g. --mesh data=2,sequence=4",
        ),
        (
            ["--attention", "usp", "--mesh", "context=2,sequence=4", "--set", "num_heads=6", "--set", "num_kv_heads=2"],
            "heads (6) per device is not divisible by 4; use a sequence axis of 2, or ring attention "
            "(--attention ring); e.g. --mesh context=4,sequence=2",
        ),
        (
            ["--attention", "usp", "--mesh", "data=2,context=4", "--seq-len", "36"],
            "--seq-len 36: --context-layout zigzag cuts each sequence into 2 x 4",
        ),
        (
            ["--attention", "flash", "--mesh", "data=2,sequence=4", "--context-layout", "zigzag"],
            "--context-layout zigzag: --attention flash assumes tokens in natural order",
        ),
        (
            ["--attention", "ring", "--mesh", "data=2,sequence=4", "--context-shares", "2,1"],
            "for a ring of 4 devices (--mesh data=2,sequence=4); give one relative share per ring device, e.g. "
            "--context-shares 1,1,1,1, or --context-shares auto",
        ),
        (
            ["--attention", "ulysses", "--mesh", "data=2,sequence=4", "--context-shares", "auto"],
            "--context-shares needs --attention ring over a split length in the zigzag layout",
        ),
        (  # USP's all-to-all trades equal blocks: a ring over the same devices takes the shares
            ["--attention", "usp", "--mesh", "data=2,context=2,sequence=2", "--context-shares", "2,1,1,1"],
            "e.g. --attention ring --mesh data=2,context=2,sequence=2 --context-layout zigzag --context-shares auto",
        ),
        (
            ["--attention", "ring", "--mesh", "data=2,sequence=4", "--context-shares", "2,0,1,1"],
            "--context-shares 2,0,1,1: expected auto or positive relative shares, one per device of the ring",
        ),
    ],
)
def test_wrong_sizes_are_refused_before_compiling(tmp_path, args, message, corpus, cache, capsys, monkeypatch):
    from train.runtime import step

    def no_trainer(*_, **__):
        raise AssertionError("a Trainer was built: the check came too late")

    monkeypatch.setattr(step, "Trainer", no_trainer)
    code = train.main(
        [
            *SMALL,
            *args,
            "--steps",
            "2",
            "--run-dir",
            str(tmp_path / "r"),
            "--data",
            str(corpus),
            "--data-cache",
            str(cache),
        ]
    )
    assert code == 2
    assert message in capsys.readouterr().err


def test_ulysses_takes_any_kv_head_count_and_the_mesh_it_suggests():
    """The test model (4 heads, 2 KV heads): sequence=4 repeats the KV heads; sequence=8 is refused
    and the mesh the message names passes the same check."""
    config = MODEL_PRESETS["test"].replace(attention="ulysses")
    rules = get_rules("fsdp_tp")
    check_context_parallel(config, Parallelism(parse_mesh("data=2,sequence=4", 8), rules), 64)
    bad = Parallelism(parse_mesh("sequence=8", 8), rules)
    with raises_as_cli(ValueError, match="e.g. --mesh data=2,sequence=4$"):
        check_context_parallel(config, bad, 64)
    check_context_parallel(config, Parallelism(ulysses_mesh(bad.mesh_shape, 4), rules), 64)
    six = config.replace(attention="usp", num_heads=6, num_kv_heads=2)
    bad = Parallelism(parse_mesh("context=2,sequence=4", 8), rules)
    with raises_as_cli(ValueError, match="e.g. --mesh context=4,sequence=2$"):
        check_context_parallel(six, bad, 64)
    check_context_parallel(six, Parallelism(ulysses_mesh(bad.mesh_shape, 6, inner_only=True), rules), 64)


def test_context_shares_become_tokens_and_the_suggestions_are_accepted():
    """``--context-shares 3,1,2,2`` over 64 tokens: 24, 8, 16, 16 real tokens; the shares a refusal suggests
    pass the same check; ``auto`` is measured later."""
    from models.attention import check_context_shares
    from train.setup.layout_flags import parse_context_shares

    par = Parallelism(parse_mesh("data=2,sequence=4", 8), get_rules("fsdp_tp"), context_layout="zigzag")
    assert parse_context_shares("3,1,2,2", 64) == (24, 8, 16, 16)
    assert par.replace(context_shares=(24, 8, 16, 16)).padded_length == 96
    check_context_shares("ring", par.replace(context_shares=parse_context_shares("1,1,1,1", 64)), 64)
    check_context_shares("ring", par.replace(context_shares="auto"), 64)
    with raises_as_cli(ValueError, match="e.g. --context-shares 1,1,1,1, or --context-shares auto$"):
        check_context_shares("ring", par.replace(context_shares=parse_context_shares("2,1", 64)), 64)
    # Shares with USP, or on a length not split: the ring and mesh the refusal names are accepted.
    usp = Parallelism(parse_mesh("data=2,context=2,sequence=2", 8), get_rules("fsdp_tp"), context_shares="auto")
    flat = Parallelism(parse_mesh("data=8", 8), get_rules("fsdp_tp"), context_shares="auto")
    for layout, mesh in ((usp, "data=2,context=2,sequence=2"), (flat, "data=4,sequence=2")):
        with raises_as_cli(ValueError, match=f"e.g. --attention ring --mesh {mesh} --context-layout zigzag"):
            check_context_shares("usp", layout, 64)
        ring = Parallelism(parse_mesh(mesh, 8), get_rules("fsdp_tp"), context_layout="zigzag", context_shares="auto")
        check_context_shares("ring", ring, 64)


def test_context_calibration_gives_each_ring_device_tokens_by_its_speed(monkeypatch):
    """``--context-shares auto``: every device timed on its even share of the length (a stand-in timer: ring
    positions 0-1 at 10 ms, 2-3 at 30 ms on data=2,sequence=4, data replicas alike but one slower), the slowest
    device of each ring position counts, tokens by speed."""
    from train.setup import calibrate

    mesh = make_mesh(parse_mesh("data=2,sequence=4", 8))
    par = Parallelism.of(mesh, "fsdp_tp", context_layout="zigzag").replace(context_shares="auto")
    positions = calibrate.ring_devices(mesh, par.rules.mesh_axes(ax.LENGTH))
    assert [len(p) for p in positions] == [2, 2, 2, 2]
    ring = {d.id: i for i, p in enumerate(positions) for d in p}
    seconds = {d.id: (0.01 if ring[d.id] < 2 else 0.03) * (1.5 if d.id == positions[1][1].id else 1.0)
               for d in jax.devices()}  # fmt: skip
    seen = {}

    def timer(fn, args_on, devices, together):
        seen["tokens"] = args_on(devices[0])[1]["tokens"].shape
        return [seconds[d.id] for d in devices]

    monkeypatch.setattr(calibrate, "compute_pools", lambda grid: None)  # as accelerators: each its own speed
    loss = lambda params, batch, par: (jnp.sum(params["w"]) * jnp.sum(batch["tokens"]), 1.0)
    abstract = {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}
    new, calibration = calibrate.calibrate_context(par, loss, abstract, 2, 64, timer=timer)
    assert seen["tokens"] == (2, 16)
    speeds = [1 / 0.01, 1 / 0.015, 1 / 0.03, 1 / 0.03]
    assert calibration.seconds == pytest.approx((0.01, 0.015, 0.03, 0.03))
    assert new.context_shares == calibration.shares and sum(new.context_shares) == 64
    ideal = [64 * s / sum(speeds) for s in speeds]
    assert all(abs(a - b) <= 2 for a, b in zip(new.context_shares, ideal)), (new.context_shares, ideal)


# Training -------------------------------------------------------------------------------------


def _losses(run_dir: Path, key: str) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if key in r}


def test_ring_ulysses_and_usp_train_with_the_losses_of_data_parallel(tmp_path, corpus, cache):
    """Ten steps of the test model (4 heads, 2 KV heads) with ``--attention ring`` on data=2,sequence=4
    (zigzag by default), ``ulysses`` on data=2,sequence=4 (KV heads repeated to 4), ``usp`` on
    data=2,context=2,sequence=2 (zigzag over the context ring) and ring attention on uneven shards
    (``--context-shares 3,1,2,2``: padded blocks, padding masked and skipped), each against one ``--mesh data=2``
    run.

    The baseline runs as a subprocess with `--cpu-devices 2`, so its mesh is exactly `data=2` (this process
    has 8 devices, which `--mesh data=2` would not cover), with the einsum reference attention on tokens in
    natural order, concurrently with the others: a different attention, layout and device count, so equal
    training and held-out losses (within 1e-4) show each kernel, the zigzag permutation of tokens, positions,
    segment ids, targets and loss mask, and the length's sharding together leave the training unchanged.
    """
    common = [
        *SMALL,
        "--steps",
        "10",
        "--warmup",
        "2",
        "--eval-every",
        "0",
        "--ckpt-every",
        "0",
        "--data",
        str(corpus),
        "--data-cache",
        str(cache),
    ]
    baseline = _procs.start(
        [
            *common,
            "--cpu-devices",
            "2",
            "--mesh",
            "data=2",
            "--attention",
            "reference",
            "--run-dir",
            str(tmp_path / "dp"),
        ],
        tmp_path / "dp.log",
    )
    runs = {
        "ring": ["--mesh", "data=2,sequence=4", "--attention", "ring"],
        "ulysses": ["--mesh", "data=2,sequence=4", "--attention", "ulysses"],
        "usp": ["--mesh", "data=2,context=2,sequence=2", "--attention", "usp"],
        # uneven shards: 24, 8, 16, 16 real tokens in blocks of 24 (positions 96 a sequence, 32 of padding)
        "uneven": ["--mesh", "data=2,sequence=4", "--attention", "ring", "--context-shares", "3,1,2,2"],
    }
    try:
        for name, flags in runs.items():
            assert train.main([*common, *flags, "--run-dir", str(tmp_path / name)]) == 0
        assert baseline.wait(timeout=300) == 0, (tmp_path / "dp.log").read_text()
    finally:
        if baseline.poll() is None:
            baseline.kill()
    assert sorted(_losses(tmp_path / "dp", "train/loss")) == list(range(1, 11))
    for key in ("train/loss", "eval/loss"):
        dp = _losses(tmp_path / "dp", key)
        assert len(dp) >= 2
        for name in runs:
            cp = _losses(tmp_path / name, key)
            assert sorted(cp) == sorted(dp), (name, key)
            np.testing.assert_allclose([cp[s] for s in sorted(cp)], [dp[s] for s in sorted(dp)], rtol=1e-4)


# The cost model's context traffic against the compiled program --------------------------------------

# One length: the formula's dependence on the length is checked by the step's compiled traffic at 256 tokens
# (tests/test_costmodel.py, `CONTEXT_GRID`).
TRAFFIC_GRID = [  # (kernel, ring R, all-to-all U, heads, kv_heads, length)
    (kernel, ring, inner, heads, kv_heads, 64)
    for kernel, ring, inner in (("ring", 4, 1), ("ulysses", 1, 4), ("usp", 2, 4))
    for heads, kv_heads in ((4, 4), (4, 1))
]


@pytest.mark.parametrize("kernel, ring, inner, heads, kv_heads, length", TRAFFIC_GRID)
def test_context_traffic_is_what_the_compiled_step_moves(kernel, ring, inner, heads, kv_heads, length):
    """All-to-all and collective-permute bytes per device of one attention forward and backward (float32,
    causal, zigzag, segment ids), compiled on a context=R x sequence=U mesh, against
    `sharding.costmodel.context.context_traffic` on the kernel's traits: within 10% (here exact)."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    from models import attention_registry as registry
    from models.kernels import ring_attention, ulysses_attention, usp_attention
    from sharding.costmodel.context import context_traffic
    from sharding.hlo import collectives, summarize

    batch, head_dim = 2, 16
    run = {
        "ring": lambda q, k, v, s: ring_attention(q, k, v, axis_name="context", **kw(s)),
        "ulysses": lambda q, k, v, s: ulysses_attention(q, k, v, axis_name="sequence", **kw(s)),
        "usp": lambda q, k, v, s: usp_attention(q, k, v, ring_axis="context", all_to_all_axis="sequence", **kw(s)),
    }[kernel]

    def kw(segments):
        return dict(q_segment_ids=segments, kv_segment_ids=segments, causal=True, layout="zigzag")

    mesh = jax.make_mesh((ring, inner), ("context", "sequence"), axis_types=(AxisType.Auto,) * 2)
    tokens, ids = P(None, ("context", "sequence"), None, None), P(None, ("context", "sequence"))
    attention = jax.shard_map(run, mesh=mesh, in_specs=(tokens,) * 3 + (ids,), out_specs=tokens)
    q = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((batch, length, kv_heads, head_dim), jnp.float32)
    segments = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    step = jax.value_and_grad(lambda q, k, v, s, d_out: jnp.sum(attention(q, k, v, s) * d_out), argnums=(0, 1, 2))
    found = summarize(collectives(jax.jit(step).lower(q, kv, kv, segments, q).compile().as_text()))
    want = context_traffic(
        registry.kernel(kernel).traits,
        batch=batch,
        length=length,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ring=ring,
        all_to_all=inner,
        act_bytes=4,
        segment_ids=True,
        training=True,
    )
    for op in ("all-to-all", "collective-permute"):
        got = found.get(op, (0, 0))[1]
        assert abs(got - want.get(op, 0)) <= 0.1 * max(want.get(op, 0), 1), (op, got, want)
