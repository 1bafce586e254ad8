"""A run splits its batch over the mesh axes its rules map ``batch`` to (`sharding.rules.Rules.batch_split`),
not over every axis that may split a batch: ``--rule batch=data+fsdp`` on an expert mesh keeps the batch whole
over ``expert``. The run's checks, its dry run's cost model and the strategies that cannot follow such a rule
(the uneven step, a pipeline whose parameters are split over ``expert``) all read it so."""

import re

import pytest

from sharding import axes as ax
from sharding import costmodel as cm
from sharding.mesh import parse_mesh
from sharding.parallel import Parallelism, UnevenBatch
from sharding.rules import get_rules

MOE = ["--model", "moe-test", "--seq-len", "32", "--dry-run"]
KEEP_BATCH = ["--mesh", "expert=4,fsdp=2", "--rule", "batch=data+fsdp"]


def _rows(block: str) -> dict[str, tuple[float, float]]:
    """The dry run's cost-model table: label -> (predicted, compiled), in the unit each cell names."""
    found = re.finditer(r"^  (\S[\w ()+-]*?)\s{2,}([\d.]+) \w+\s+([\d.]+) \w+$", block, re.M)
    return {m[1]: (float(m[2]), float(m[3])) for m in found}


def test_a_dry_run_splits_the_batch_over_the_rules_axes(capsys):
    """A batch of 2 on ``expert=4,fsdp=2`` under ``--rule batch=data+fsdp``: the rules split it over ``fsdp``
    only (1 sequence per device), so the run takes it (it refused it before, as not divisible by data x fsdp x
    expert = 8) and its dry run prices the compiled step's matrix products within 10% (0.032 GFLOP priced,
    0.033 compiled); a batch of 3 is refused naming the rules' split, data x fsdp = 2."""
    from train import train

    assert train.main([*MOE, *KEEP_BATCH, "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "compiled one train step (batch 2 x 32)" in out
    rows = _rows(out[out.index("cost model (sharding.costmodel") :])
    predicted, compiled = rows["matrix-product FLOPs"]
    assert abs(predicted - compiled) <= 0.10 * compiled, (predicted, compiled)

    assert train.main([*MOE, *KEEP_BATCH, "--batch-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "not divisible by the data-parallel size data x fsdp = 2 of --mesh fsdp=2,expert=4" in err, err


def test_a_pipeline_that_cannot_follow_the_rule_names_the_rule_that_can(capsys):
    """Pipeline stages over ``stage=2,expert=2,fsdp=2`` store the layers split over ``expert``, which the
    microbatches must then be split over: under ``--rule batch=data+fsdp`` the run refuses, suggesting the
    rule that adds ``expert`` (it suggested ``--rule batch=data+fsdp``, the rule given, before)."""
    from train import train

    args = ["--mesh", "stage=2,expert=2,fsdp=2", "--microbatches", "2", "--set", "first_dense_layers=0"]
    assert train.main([*MOE, *args, "--rule", "batch=data+fsdp", "--batch-size", "64"]) == 2
    err = capsys.readouterr().err
    assert "split over expert but microbatches of 32 rows are not" in err, err
    assert err.rstrip().endswith("--rule batch=data+fsdp+expert"), err


@pytest.mark.parametrize(
    "mesh, overrides, refused",
    [
        ("data=2,fsdp=4", ["batch=data"], True),  # the uneven step would split the rows over fsdp too
        ("data=2,fsdp=4", ["batch=fsdp+data"], False),  # the same axes in another order
        ("data=2,fsdp=4", [], False),
    ],
)
def test_the_uneven_step_refuses_a_batch_rule_it_does_not_follow(mesh, overrides, refused):
    """The uneven step's map is manual over every batch axis of the mesh and splits the rows over all of them,
    whatever ``batch``'s rule: a rule that leaves one out is refused before any device work, naming the rule
    that the step follows."""
    from train.strategies.uneven import check_uneven

    par = Parallelism(parse_mesh(mesh, 8), get_rules("fsdp_tp", overrides), UnevenBatch(microbatches=1))
    if not refused:
        check_uneven(par, [], [])
        assert par.data_parallel == 8
        return
    with pytest.raises(ValueError, match=r"--rule batch=data does not\. Use --rule batch=data\+fsdp"):
        check_uneven(par, [], [])
    assert par.rules.batch_axes(par.mesh_shape) == (ax.DATA,)


@pytest.mark.parametrize(
    "rule, batch, micro, compiled",
    [
        ("batch=data+fsdp", 8, 1, {"all-gather": 296, "all-to-all": 64, "collective-permute": 80}),
        ("batch=data+fsdp", 16, 2, {"all-gather": 560, "all-to-all": 128, "collective-permute": 144}),
        ("batch=data+expert", 8, 1, {"all-gather": 136, "all-to-all": 128}),
        ("batch=data+expert", 16, 2, {"all-gather": 272, "all-to-all": 256}),
    ],
)
def test_the_embedding_lookup_under_a_batch_kept_whole_over_some_table_axes(rule, batch, micro, compiled):
    """``moe-test`` on ``expert=4,fsdp=2`` (the table's ``embed`` over ``fsdp`` x ``expert``), 256 tokens a
    sequence, no compilation: the KiB per step of the embedding lookup's collectives, as the compiled step moved
    them on jax 0.10 (its ``jit(_take)`` instructions). Under ``batch=data+fsdp``, 4 x 256 tokens a device (a
    microbatch), 2,048 over the ``fsdp`` pair against 512 table entries: the ``[512, 64/8]`` shard permuted
    and gathered over ``fsdp`` once a step (hoisted out of the microbatch loop), the rows gathered over
    ``expert``, their gradient back by an all-to-all over ``fsdp`` and a collective-permute. Under
    ``batch=data+expert``, 2 x 256 tokens a device: the tokens gathered over ``expert``, the rows moved by an
    all-to-all over ``fsdp`` and gathered over it, their gradient back by an all-to-all. Priced with ``expert``
    folded into ``fsdp``, both were an all-to-all of the device's whole rows there and back (0.50 MiB at 8 x 256
    under ``batch=data+fsdp`` against 0.06 compiled; 0.25 against 0.12 under ``batch=data+expert``)."""
    from models.config import get_config
    from sharding.mesh import make_mesh
    from sharding.parallel import Accumulation

    config = get_config("moe-test")
    par = Parallelism.of(make_mesh(parse_mesh("expert=4,fsdp=2", 8)), get_rules("fsdp_tp", [rule]))
    par = par.replace(strategy=Accumulation(microbatches=micro))
    cost = cm.estimate(config, batch, 256, cm.layout_of(par, config), backend="cpu")
    lookup = [c for c in cost.comms if c.what.startswith(("embedding", "gradient of embed/embedding"))]
    priced = {kind: total / 2**10 for kind, total in cm.collective_bytes(lookup).items()}
    assert set(priced) == set(compiled), priced
    for kind, want in compiled.items():
        assert abs(priced[kind] - want) <= 0.10 * want, (kind, priced[kind], want)


def test_a_pipelines_head_moves_its_output_projection_onto_the_axis_the_batch_is_kept_whole_over():
    """GPipe on ``data=2,stage=2,fsdp=2`` under ``--rules dp --rule batch=data``, 16 x 32 in 2 microbatches (no
    compilation): the head splits its rows over ``data`` and ``stage``, leaving ``fsdp`` free, so the partitioner
    moves the output projection's stored ``[128, 512/2]`` float32 shard from ``stage`` onto ``fsdp`` and its
    gradient back (two collective-permutes of 128 KiB) beside the stage activations' six of 64 KiB: 640 KiB per
    step, as the compiled step (jax 0.10) moves them; priced 384 KiB before (the permutes of the shard left out).
    Under the preset's batch rule no axis is free: the stage activations' six of 32 KiB alone, as compiled."""
    from models.config import get_config
    from sharding.parallel import Accumulation
    from sharding.pipeline.layout import PipelinePlan, pipeline_rules, plan_layout

    config = get_config("test")
    stages, _ = plan_layout(config.num_layers, 2)
    for overrides, compiled in ((["batch=data"], 640), ([], 192)):
        rules = pipeline_rules(get_rules("dp", overrides))
        par = Parallelism(
            parse_mesh("data=2,stage=2,fsdp=2", 8), rules, Accumulation(), pipeline=PipelinePlan(stages, 2)
        )
        cost = cm.estimate(config, 16, 32, cm.layout_of(par, config), backend="cpu")
        priced = cm.collective_bytes(cost.comms)["collective-permute"] / 2**10
        assert abs(priced - compiled) <= 0.10 * compiled, (overrides, priced, compiled)


@pytest.mark.parametrize(
    "vocab, preset, rule, compiled, lookup",
    [
        (4096, "fsdp_tp", "batch=data", 3443948, True),  # the weights split over fsdp, the batch whole over it
        (512, "fsdp", "batch=fsdp", 3478124, True),  # the batch whole over data
        (4096, "fsdp_tp", "batch=fsdp", 3691116, True),  # and the loss vocabulary-parallel over fsdp
    ],
)
def test_gradients_are_summed_over_the_axes_the_rules_split_the_batch_over(vocab, preset, rule, compiled, lookup):
    """``test`` on ``data=2,fsdp=4``, 16 x 64 (no compilation): the bytes of the all-reduces per step, as the
    compiled step (jax 0.10) runs them, within 10%. The gradients are summed over the rules' batch axes only
    (`sharding.rules.Rules.batch_axes`): under ``batch=data`` each weight's ``fsdp`` shard over ``data`` (no
    reduction over ``fsdp``, whose devices hold the same rows), under ``batch=fsdp`` nothing over ``data``,
    the vocabulary-parallel output weight's gradient included. Priced over ``data`` x ``fsdp`` whatever the
    rule, they were 8,453 KiB against 3,363 compiled, 4,421 against 3,397 and 4,373 against 3,093 (the last
    without the embedding table's gradient, which the lookup priced 2 MiB over both axes against one all-reduce
    of its ``[4096, 128/4]`` float32 shard over ``data`` compiled; priced so since,
    `test_a_lookup_under_a_batch_kept_whole_over_data`)."""
    from models.config import get_config

    config = get_config("test", [f"vocab_size={vocab}"])
    par = Parallelism(parse_mesh("data=2,fsdp=4", 8), get_rules(preset, [rule]))
    cost = cm.estimate(config, 16, 64, cm.layout_of(par, config), backend="cpu")
    kept = [c for c in cost.comms if lookup or c.what != "gradient of embed/embedding"]
    assert lookup or any(c.what.startswith("loss: softmax") for c in kept)  # the vocabulary-parallel loss
    priced = cm.collective_bytes(kept)["all-reduce"]
    assert abs(priced - compiled) <= 0.10 * compiled, (priced, compiled)


@pytest.mark.parametrize(
    "mesh, vocab, seq, micro, remat, compiled",
    [
        ("data=2,fsdp=4", 4096, 64, 1, "none", 16777216),
        ("data=2,fsdp=4", 4096, 64, 2, "none", 20971520),
        ("data=2,fsdp=4", 4096, 64, 1, "full", 20971520),
        ("data=2,fsdp=2,tensor=2", 512, 64, 1, "none", 10878976),
        ("data=4,fsdp=2", 512, 32, 1, "none", 6815744),
    ],
)
def test_a_batch_kept_whole_over_fsdp_gathers_the_residual_stream(mesh, vocab, seq, micro, remat, compiled):
    """``test`` under ``--rules fsdp_tp --rule batch=data``, 16 sequences (no compilation): the bytes of the
    all-gathers per step, as the compiled step (jax 0.10) runs them, within 10%. The weights' ``embed`` is split
    over ``fsdp`` but the batch is not, so the partitioner carries the residual stream split along ``embed``
    like the norm scales (`sharding.costmodel.stream`): each norm's output, the residual sum between the blocks
    and the cotangents are gathered ``[8 x 64, 128]`` float32 (3 forward and 4 backward per layer, 4 outside
    the layer loop), the scales never, and the query, key, value, gate and up projections only for their forward
    product (their backward takes the split stream). Priced as FSDP under a split batch (every weight twice
    and the scales, no activation), they were 10.0 MiB against 16.0 compiled, 16.0 against 20.0 with 2
    microbatches, 10.0 against 20.0 under full remat, 3.4 against 10.4 with ``tensor``."""
    from models.config import get_config
    from sharding.parallel import Accumulation

    config = get_config("test", [f"vocab_size={vocab}"], remat=remat)
    par = Parallelism(parse_mesh(mesh, 8), get_rules("fsdp_tp", ["batch=data"]), Accumulation(microbatches=micro))
    cost = cm.estimate(config, 16, seq, cm.layout_of(par, config), backend="cpu")
    priced = cm.collective_bytes(cost.comms)["all-gather"]
    assert abs(priced - compiled) <= 0.10 * compiled, (priced, compiled)


@pytest.mark.parametrize(
    "mesh, preset, vocab, batch, micro, compiled",
    [
        ("data=2,fsdp=4", "fsdp", 512, 16, 1, {"all-gather": 130, "all-to-all": 256, "all-reduce": 64, "permute": 1}),
        ("data=2,fsdp=4", "fsdp", 512, 16, 2, {"all-gather": 130, "all-to-all": 256, "all-reduce": 128, "permute": 1}),
        (
            "data=2,fsdp=4",
            "fsdp_tp",
            4096,
            16,
            1,
            {"all-gather": 130, "all-to-all": 256, "all-reduce": 512, "permute": 1},
        ),
        ("data=2,fsdp=4", "fsdp", 512, 64, 1, {"all-gather": 640, "all-reduce": 128, "permute": 128}),
        ("data=4,fsdp=2", "fsdp", 512, 16, 1, {"all-gather": 256, "all-to-all": 512, "all-reduce": 128, "permute": 2}),
        ("data=4,fsdp=2", "fsdp", 512, 64, 1, {"all-gather": 1024, "all-reduce": 128, "permute": 256}),
    ],
)
def test_a_lookup_under_a_batch_kept_whole_over_data(mesh, preset, vocab, batch, micro, compiled):
    """``test`` under ``--rule batch=fsdp``, 64 tokens a sequence (no compilation): the KiB per step of the
    embedding lookup's collectives (``permute``: collective-permute), as the compiled step moved them on jax 0.10
    (its ``jit(_take)`` instructions), within 10%. The table's ``embed`` is split over ``fsdp`` and the batch is
    whole over ``data``, whose devices share the lookup (`sharding.costmodel.embedding._embedding_whole_over_data`):
    up to 4 vocabularies of the ``fsdp`` group's tokens, each device looks up its share of them, the
    ``[tokens, 128/f]`` rows are all-gathered over 2 ``data`` devices and sent to the batch layout and back by
    all-to-alls, the table shard's gradient all-reduced over those 2; at 8 vocabularies of tokens, the table is
    re-split over the 2 and the rows gathered whole. Priced as a lookup under a batch split over ``data`` too, it
    was the table gathered and its whole gradient all-reduced over ``data`` x ``fsdp`` (no all-to-all against
    0.25 MiB compiled at 16 x 64; the gradient 2 MiB against 0.5 at a 4,096 vocabulary), or rows gathered over
    all of ``data``."""
    from models.config import get_config
    from sharding.parallel import Accumulation

    config = get_config("test", [f"vocab_size={vocab}"])
    par = Parallelism(parse_mesh(mesh, 8), get_rules(preset, ["batch=fsdp"]), Accumulation(microbatches=micro))
    cost = cm.estimate(config, batch, 64, cm.layout_of(par, config), backend="cpu")
    lookup = [c for c in cost.comms if c.what.startswith(("embedding", "gradient of embed/embedding"))]
    priced = {kind.replace("collective-", ""): b / 2**10 for kind, b in cm.collective_bytes(lookup).items()}
    assert set(priced) == set(compiled), priced
    for kind, want in compiled.items():
        assert abs(priced[kind] - want) <= 0.10 * want, (kind, priced[kind], want)


@pytest.mark.parametrize("batch, seq, compiled", [(64, 32, 6536960), (16, 64, 3682048)])
def test_a_mixture_under_a_batch_kept_whole_over_fsdp_gathers_to_the_streams_split(batch, seq, compiled):
    """``moe-test`` on ``expert=4,fsdp=2`` under ``--rule batch=data+expert`` (no compilation): the bytes of the
    all-gathers per step, as the compiled step (jax 0.10) runs them, within 10%. The weights' ``embed`` is split
    over ``fsdp`` x ``expert`` and the batch over ``expert`` only, so the residual stream is split over ``fsdp``
    (`sharding.costmodel.stream`): besides the MoE dispatch's gathers over ``expert`` (priced as before), the
    stream's gathers ``[tokens, 64]`` over ``fsdp``, the norm scales and the projections contracting ``embed``
    gathered over ``expert`` to the stream's split (the latter for their backward products), and the experts'
    weights gathered again backward. Priced with ``expert`` folded into ``fsdp``, they were 3.0 MiB against 6.2
    compiled at 64 x 32. What is left: the router's logits gathered before ``top_k`` (``f32[64,32,8]`` over
    ``expert``, twice at 64 x 32), which the cost model does not price under the presets either. The weights'
    part whatever the batch: 102,144 bytes gathered over ``expert`` to the stream's split (128-byte scales 14
    times, the query, key, value, router and gate projections' ``[64/2, ...]`` once a layer) and 196,608 of the
    experts' weights ``[2, 64, 32]`` over ``fsdp`` (3 x 2 layers, forward and backward); 0 and 98,304 before."""
    from models.config import get_config

    config = get_config("moe-test")
    par = Parallelism(parse_mesh("expert=4,fsdp=2", 8), get_rules("fsdp_tp", ["batch=data+expert"]))
    cost = cm.estimate(config, batch, seq, cm.layout_of(par, config), backend="cpu")
    priced = cm.collective_bytes(cost.comms)["all-gather"]
    assert abs(priced - compiled) <= 0.10 * compiled, (priced, compiled)
    experts = {f"gather layers/moe/{name}" for name in ("gate", "up", "down")}
    for part, want in (
        (lambda what: what.endswith(("split", "split (backward)")), 102144),
        (experts.__contains__, 196608),
    ):
        got = sum(c.total_bytes for c in cost.comms if c.kind == "all-gather" and part(c.what))
        assert abs(got - want) <= 0.10 * want, (got, want)


@pytest.mark.parametrize(
    "model, mesh, rule, vocab, batch, seq, micro, remat, compiled",
    [
        ("test", "data=2,fsdp=4", "batch=data", 4096, 16, 64, 1, "none", 2852126720),
        ("test", "data=2,fsdp=4", "batch=data", 4096, 16, 64, 2, "none", 2852126720),
        ("test", "data=2,fsdp=4", "batch=data", 4096, 16, 64, 1, "full", 3489660928),
        ("test", "data=2,fsdp=4", "batch=data", 4096, 16, 64, 1, "dots", 2835349504),
        ("test", "data=4,fsdp=2", "batch=data", 512, 16, 32, 1, "none", 507510784),
        ("test", "data=2,fsdp=2,tensor=2", "batch=data", 512, 16, 64, 1, "none", 1073741824),
        ("moe-test", "expert=4,fsdp=2", "batch=data+expert", None, 64, 32, 1, "none", 924844032),
        ("moe-test", "expert=4,fsdp=2", "batch=data+expert", None, 16, 64, 1, "none", 483393536),
    ],
)
def test_backward_products_on_a_stream_split_along_embed(model, mesh, rule, vocab, batch, seq, micro, remat, compiled):
    """Under ``--rules fsdp_tp`` with ``batch`` kept whole over ``fsdp`` (no compilation): the matrix-product
    FLOPs per step, as the compiled step (jax 0.10, `sharding.hlo.dot_flops`) runs them, within 10%. The
    residual stream is split along ``embed`` over ``fsdp`` (`sharding.costmodel.stream`), and the backward
    products take that split: the weight gradient of every layer product (``[D/f, F]`` or ``[F, D/f]``) and the
    input gradient of those contracting ``embed`` (q, k, v, gate, up: ``[t, D/f]``), a quarter of their work on
    ``fsdp=4``; the output projection's weight gradient too (``f32[4096,32]``) where its weight shares no axis
    with the batch. Priced whole, they were 4.23 GFLOP against 2.85 compiled on ``data=2,fsdp=4``, 4.90 against
    3.49 under full remat, 0.68 against 0.51 on ``data=4,fsdp=2``, 1.41 against 1.07 with ``tensor`` (and
    0.97 against 0.92 on ``moe-test``, within 10% before). The clock's products (`Cost.gemms`) follow the same
    shapes: the query's input gradient is ``[t, D/f]``."""
    from models.config import get_config
    from sharding.parallel import Accumulation

    config = get_config(model, [f"vocab_size={vocab}"] if vocab else [], remat=remat)
    par = Parallelism(parse_mesh(mesh, 8), get_rules("fsdp_tp", [rule]), Accumulation(microbatches=micro))
    cost = cm.estimate(config, batch, seq, cm.layout_of(par, config), backend="cpu")
    assert abs(cost.matmul_flops - compiled) <= 0.10 * compiled, (cost.matmul_flops, compiled)
    if model == "test":
        f = parse_mesh(mesh, 8)["fsdp"]
        assert sum(g.flops * g.count for g in cost.gemms) == pytest.approx(cost.matmul_flops)
        (q,) = [g for g in cost.gemms if g.what == "layers/attention/q input gradient"]
        assert q.n == config.embed_dim / f, q
