"""The cost model against the compiler: FLOPs, state bytes and collective bytes within 10%.

Each case compiles one train step (`Trainer.compile_train_step`, abstract shapes, 8 simulated CPU
devices) and compares the cost model's prediction for the CPU backend with:

* ``compiled.cost_analysis()["flops"]``, which counts each ``while`` body once (one microbatch
  through one layer, plus what is outside the loops): `Cost.counted_flops`;
* the matrix-product FLOPs of the compiled HLO with loop trip counts folded in
  (`sharding.hlo.dot_flops`): `Cost.matmul_flops`, the per-step figure the planner uses;
* ``compiled.memory_analysis().argument_size_in_bytes`` (parameters, AdamW moments, batch):
  `Cost.argument_bytes`;
* the bytes of each collective kind parsed from the HLO (`sharding.hlo.collectives`).

Pipelines (`PIPELINE_GRID`: stage 2 and 4, GPipe and circular, uneven splits, fsdp and data) are
checked on the same figures; kinds the model does not price for a case are listed in `UNMODELLED`.
"""

import dataclasses

import pytest
from _cli_errors import raises_as_cli
from costmodel_grid import (
    CONTEXT_GRID,
    GRID,
    PIPELINE_GRID,
    UNEVEN_CONTEXT_GRID,
    UNMODELLED,
    compiled_figures,
    predicted,
)
from costmodel_grid import case_id as _id
from costmodel_grid import config_of as _config

from models import attention_registry as registry
from models.config import get_config
from models.spec import describe
from sharding import costmodel as cm
from sharding.costmodel.pipeline import weight_cut_bytes
from sharding.mesh import parse_mesh
from sharding.pipeline.layout import PipelinePlan, bubble_fraction, plan_layout
from sharding.rules import get_rules

TOLERANCE = 0.10


def _within(pred, actual):
    return abs(pred - actual) <= TOLERANCE * abs(actual)


@pytest.mark.parametrize("case", GRID + PIPELINE_GRID, ids=_id)
def test_flops_match_cost_analysis_and_folded_products(case):
    figures, cost = compiled_figures(case), predicted(case)
    assert _within(cost.counted_flops, figures["flops"]), (cost.counted_flops, figures["flops"])
    assert _within(cost.matmul_flops, figures["dot_flops"]), (cost.matmul_flops, figures["dot_flops"])


@pytest.mark.parametrize("case", GRID + PIPELINE_GRID, ids=_id)
def test_state_bytes_match_memory_analysis(case):
    figures, cost = compiled_figures(case), predicted(case)
    assert _within(cost.argument_bytes, figures["arguments"]), (cost.argument_bytes, figures["arguments"])
    # parameters + AdamW moments are nearly all of it
    assert cost.memory.state >= 0.9 * figures["arguments"]


@pytest.mark.parametrize("case", GRID + PIPELINE_GRID, ids=_id)
def test_collective_bytes_match_hlo_per_kind(case):
    _assert_collectives_within(predicted(case), compiled_figures(case)["collectives"], UNMODELLED.get(case, ()))


def _assert_collectives_within(cost, compiled, unmodelled=()):
    """The predicted collective kinds are the compiled ones, each kind's bytes within 10% (but ``unmodelled``)."""
    pred = cm.collective_bytes(cost.comms)
    assert set(pred) == set(compiled), (sorted(pred), sorted(compiled))
    for kind in set(compiled) - set(unmodelled):
        assert _within(pred[kind], compiled[kind]), (kind, pred[kind], compiled[kind])


def test_no_layout_of_the_grid_makes_the_partitioner_rematerialize():
    """XLA's "Involuntary full rematerialization" (a whole array gathered onto every device because the
    partitioner finds no cheaper move) on none of the README's layouts in the grid: ``data`` beside ``fsdp``
    (the embedding lookup reads its table gathered there, `sharding.vocab.lookup_gathers_table`) and
    pipelines (it reads the table as the rules lay it out, not as stored over ``stage``). Reads the
    warnings each case's compilation logged (none when a compilation was served from the cache)."""
    warned = {_id(case): n for case in GRID + PIPELINE_GRID if (n := compiled_figures(case)["rematerializations"])}
    assert not warned, warned


def test_saved_activations_per_layer_match_the_compiled_temporaries():
    """What ``remat="dots"`` saves per layer, as the compiler allocates it: the step's temporaries grow with
    each scanned layer by the layer's saved activations and its float32 gradient (``data=8``: the gradient
    whole), to the byte: 1,024 tokens x (block input, q, k, v, o, gate, up: 1,280 float32 elements) and the
    layer's 196,864 parameters. The attention output, the rotated keys and silu(gate) * up are recomputed."""
    two, four = ((f"test+num_layers={n}", "data=8", "dp", 16, 512, 1, "dots") for n in (2, 4))
    per_layer = (compiled_figures(four)["temp"] - compiled_figures(two)["temp"]) / 2
    grown = [
        getattr(predicted(four).memory, f) - getattr(predicted(two).memory, f) for f in ("activations", "gradients")
    ]
    assert per_layer == pytest.approx(sum(grown) / 2, rel=1e-3), (per_layer, grown)
    assert grown[0] / 2 == 1024 * 1280 * 4 and grown[1] / 2 == 196864 * 4


def test_saved_activations_of_a_moe_layer_match_the_compiled_temporaries():
    """The same for a mixture-of-experts layer (`models.spec._moe_activations`) under ``remat="dots"``: per token
    the block's kept products (input, o, q, k, v: 256 float32 elements), the router's float32 logits (8) and the
    shared expert's gate and up (64); the routed experts' grouped products (`jax.lax.ragged_dot`, no
    ``dot_general``) keep nothing, to the byte."""
    two, four = ((f"moe-test+first_dense_layers=0+num_layers={n}", "data=8", "dp", 16, 512, 1, "dots") for n in (2, 4))
    per_layer = (compiled_figures(four)["temp"] - compiled_figures(two)["temp"]) / 2
    grown = [
        getattr(predicted(four).memory, f) - getattr(predicted(two).memory, f) for f in ("activations", "gradients")
    ]
    assert per_layer == pytest.approx(sum(grown) / 2, rel=1e-3), (per_layer, grown)
    assert grown[0] / 2 == 1024 * 328 * 4


def test_cost_analysis_counts_a_loop_body_once():
    """What the cost model assumes of XLA: doubling the scanned layers doubles the folded products
    but leaves cost_analysis nearly unchanged (only the optimizer's share grows)."""
    four, eight = compiled_figures(GRID[1]), compiled_figures(("test+num_layers=8",) + GRID[1][1:])
    assert eight["dot_flops"] > 1.8 * four["dot_flops"]
    assert eight["flops"] < 1.1 * four["flops"]
    cost = predicted(("test+num_layers=8",) + GRID[1][1:])
    assert _within(cost.counted_flops, eight["flops"]) and _within(cost.matmul_flops, eight["dot_flops"])


def test_gpu_backend_reduce_scatters_fsdp_gradients():
    layout = cm.Layout(parse_mesh("data=2,fsdp=4", 8), "fsdp", 1, "none")
    config = get_config("small")
    gpu = cm.collective_bytes(cm.estimate(config, 32, 32, layout, backend="gpu").comms)
    cpu = cm.collective_bytes(cm.estimate(config, 32, 32, layout, backend="cpu").comms)
    assert "reduce-scatter" in gpu and "reduce-scatter" not in cpu
    assert gpu["all-reduce"] < cpu["all-reduce"]


def test_remat_and_microbatches_trade_compute_and_traffic_for_memory():
    config = get_config("1b")
    base = cm.Layout({"fsdp": 8}, "fsdp", 1, "none", attention="flash", dtype="bfloat16")
    none = cm.estimate(config, 32, 2048, base)
    full = cm.estimate(config, 32, 2048, cm.Layout({"fsdp": 8}, "fsdp", 1, "full", attention="flash", dtype="bfloat16"))
    micro = cm.estimate(
        config, 32, 2048, cm.Layout({"fsdp": 8}, "fsdp", 4, "none", attention="flash", dtype="bfloat16")
    )
    assert full.memory.activations < none.memory.activations / 4 and full.flops.total > none.flops.total
    assert micro.memory.activations < none.memory.activations / 3
    assert cm.collective_bytes(micro.comms)["all-gather"] > 3 * cm.collective_bytes(none.comms)["all-gather"]


def test_ring_collective_costs_and_links():
    n = 8
    assert cm.Comm("all-reduce", ("fsdp",), n, 800.0, 1, "x").wire_bytes() == pytest.approx(2 * 800 * 7 / 8)
    assert cm.Comm("all-gather", ("fsdp",), n, 800.0, 1, "x").wire_bytes() == pytest.approx(800 * 7 / 8)
    assert cm.Comm("reduce-scatter", ("fsdp",), n, 100.0, 1, "x").wire_bytes() == pytest.approx(700)
    links = cm.link_classes({"data": 2, "stage": 1, "fsdp": 8, "sequence": 1, "tensor": 1}, devices_per_host=8)
    assert links["fsdp"] == "intra" and links["data"] == "inter"
    hw = cm.Hardware(1e15, 80e9, 3e12, intra_bandwidth=400e9, inter_bandwidth=50e9 / 8)
    comm = cm.Comm("all-reduce", ("data",), 2, 1e9, 1, "x")
    assert cm.comm_seconds(comm, hw, links) > 10 * cm.comm_seconds(
        cm.Comm("all-reduce", ("fsdp",), 2, 1e9, 1, "x"), hw, links
    )


def test_fsdp_overlap_exposes_the_loops_first_gather_and_last_reduction():
    """FSDP's per-layer weight gathers hide behind one layer's compute each: the first gather (nothing runs
    before it) and the last gradient reduction (nothing after it) are exposed, the rest hidden costs
    `OVERLAP_SLOWDOWN` of its length; with no compute to hide behind, all of it is exposed. References by
    hand from each collective's own price (`comm_seconds`)."""
    model = describe(get_config("test"))
    layout = cm.Layout({"fsdp": 8}, "fsdp", 2, "none", attention="flash", dtype="bfloat16")
    cost = cm.device_cost(model, layout, seq_len=256, rows=4)
    links = cm.link_classes(layout.mesh, 8)
    slow = cm.Hardware(1e11, 80e9, 3e12, intra_bandwidth=400e9, inter_bandwidth=50e9 / 8, overlap_slowdown=0.18)
    seconds = {c: cm.comm_seconds(c, slow, links) for c in cost.comms}
    loop = [c for c in cost.comms if c.layer_loop]
    assert {c.kind for c in loop} == {"all-gather", "reduce-scatter"}
    runs = {c.count for c in loop if c.kind == "reduce-scatter"}
    assert runs == {model.num_layers * 2}  # a reduction per layer and microbatch; two gathers each
    first_gather = sum(seconds[c] for c in loop if c.kind == "all-gather") / (2 * model.num_layers * 2)
    last_reduction = sum(seconds[c] for c in loop if c.kind == "reduce-scatter") / (model.num_layers * 2)
    st = cm.step_time(cost, slow, links)
    assert st.overlapped_comm == pytest.approx(sum(seconds[c] for c in cost.comms if c.overlappable), rel=1e-12)
    assert st.overlapped_comm < st.compute / 10  # every other layer's traffic hides behind its compute
    assert st.overlap_exposed == pytest.approx(first_gather + last_reduction, rel=1e-9)
    hidden = st.overlapped_comm - st.overlap_exposed
    assert st.contention == pytest.approx(0.18 * hidden, rel=1e-9)
    assert st.total == pytest.approx(
        st.compute + first_gather + last_reduction + 0.18 * hidden + st.exposed_comm + st.optimizer, rel=1e-9
    )
    assert st.total > max(st.compute, st.overlapped_comm) + st.exposed_comm + st.optimizer  # all hidden: less
    fast = dataclasses.replace(slow, peak_flops=1e18)  # compute far too short to hide the traffic
    st = cm.step_time(cost, fast, links)
    assert st.compute < st.overlapped_comm / 1e4
    assert st.overlapped_comm - st.overlap_exposed == pytest.approx(st.compute, rel=1e-6)  # it hides its length
    assert st.contention == pytest.approx(0.18 * st.compute, rel=1e-6)


def test_hidden_traffic_on_two_links_spills_only_what_the_busier_link_carries_beyond_the_compute():
    """A host's NVLink and its network adapters are separate wires: overlappable traffic inside the host and
    across hosts run at once, so what is left beyond the compute is the busier class's excess, not the sum's.
    By hand with no loop traffic (``overlap``'s other collectives only), ``slowdown`` 0.18: 0.6 s inside and
    0.7 s across hosts beside 1 s of compute hide entirely (one link, 1.3 s, would spill 0.3 s); 1.4 s across
    hosts spills 0.4 s; one class given alone is the one-link rule."""
    from sharding.costmodel.time import overlap

    model = describe(get_config("test"))
    layout = cm.Layout({"fsdp": 8}, "fsdp", 1, "none", attention="flash", dtype="bfloat16")
    cost = cm.device_cost(model, layout, seq_len=256, rows=4)
    both = {"intra": (0.0, 0.6), "inter": (0.0, 0.7)}
    assert overlap(cost, 1.0, 0.0, 0.0, 1.3, 0.18, both) == pytest.approx((0.0, 0.18 * 1.3), rel=1e-12)
    assert overlap(cost, 1.0, 0.0, 0.0, 1.3, 0.18) == pytest.approx((0.3, 0.18 * 1.0), rel=1e-12)
    busy = {"intra": (0.0, 0.6), "inter": (0.0, 1.4)}
    assert overlap(cost, 1.0, 0.0, 0.0, 2.0, 0.18, busy) == pytest.approx((0.4, 0.18 * 1.6), rel=1e-12)
    one = {"intra": (0.0, 1.3)}
    assert overlap(cost, 1.0, 0.0, 0.0, 1.3, 0.18, one) == overlap(cost, 1.0, 0.0, 0.0, 1.3, 0.18)


def test_model_flops_per_token_is_palm_count():
    """PaLM's count (Appendix B), ``6 * (P - V*D) + 12 * L * N * H * T``, from the config's fields by
    hand; `ModelConfig.flops_per_token` is the description's (one implementation)."""
    for name, tied in (("test", False), ("7b", False), ("test", True)):
        c = get_config(name, tie_embeddings=tied)
        v, d, f, n, k, h = c.vocab_size, c.embed_dim, c.mlp_dim, c.num_heads, c.num_kv_heads, c.head_dim
        dense = v * d + c.num_layers * (2 * d * n * h + 2 * d * k * h + 3 * d * f + 2 * d) + d  # P - V*D (+ V*D tied)
        palm = 6.0 * dense + 12 * c.num_layers * n * h * 4096
        assert describe(c).flops_per_token(4096) == pytest.approx(palm, rel=1e-12)
        assert c.flops_per_token(4096) == describe(c).flops_per_token(4096)


def test_bubble_fraction_and_even_split():
    assert bubble_fraction(4, 16, 1) == pytest.approx(3 / 19)
    assert bubble_fraction(4, 16, 2) == pytest.approx(3 / 35)
    assert plan_layout(10, 4)[0].stage_layers == (3, 3, 2, 2)
    with pytest.raises(ValueError, match="stage=4"):
        plan_layout(3, 4)


def test_layout_errors_name_the_flag():
    with raises_as_cli(ValueError, match="--remat"):
        cm.Layout({"fsdp": 8}, remat="some")
    with raises_as_cli(ValueError, match="--batch-size"):
        cm.estimate(get_config("test"), 12, 64, cm.Layout({"fsdp": 8}))


def test_vocab_parallel_cases_take_the_vocab_parallel_loss():
    """The grid's cases with the larger vocabulary are the vocabulary-parallel layout, the others the gathered one."""
    from sharding.vocab import choose_output

    def picked(case):
        model, mesh_spec, rules, batch, seq, micro, remat = case
        config, mesh = _config(model, remat), parse_mesh(mesh_spec, 8)
        full = {a: mesh.get(a, 1) for a in ("data", "stage", "fsdp", "sequence", "tensor")}
        split = full["data"] * full["fsdp"]
        return (
            choose_output(
                "auto",
                get_rules(rules),
                full,
                config.vocab_size,
                config.embed_dim,
                batch // micro,
                batch // micro // split * seq,
            )
            is not None
        )

    vocab_parallel = ["vocab_size=4096" in case[0] for case in GRID]
    assert sum(vocab_parallel) == 2 and [picked(case) for case in GRID] == vocab_parallel


def test_pipeline_prices_the_layer_applications_the_schedule_runs():
    """Skipping empty slots and bubble steps: the layers' FLOPs scale with
    `PipelinePlan.layer_applications` (M x the stage's layers) against every slot of every step of the
    working copy's 3 slots (the unpadded storage's K' = 4, the layout's 3 rounded up to a multiple of fsdp = 2,
    less the padded slot, dropped after the gather); what runs outside the pipeline and the collectives do not
    change."""
    from sharding.pipeline.storage import StageStorage

    config = get_config("test", ["num_layers=8"])
    stages, _ = plan_layout(8, 4, 1, (3, 3, 1, 1))
    plan = PipelinePlan(stages, 4)
    assert StageStorage(stages, 2).placement.chunk_slots == 4
    every = (plan.steps * 3,) * 4
    skipped = plan.layer_applications()
    kw = dict(stage_layers=(3, 3, 1, 1))
    for stage, layers in ((0, 3), (2, 1)):
        cost = {
            skip: cm.device_cost(
                config,
                cm.Layout({"stage": 4, "fsdp": 2}, "fsdp", 4, skip_empty=skip, **kw),
                seq_len=32,
                rows=2,
                layers=layers,
                slots=3,
                backend="cpu",
            )
            for skip in (True, False)
        }
        ratio = skipped[stage] / every[stage]
        for part in ("layers", "attention", "recompute"):
            assert getattr(cost[True].flops, part) == pytest.approx(ratio * getattr(cost[False].flops, part), rel=1e-12)
        assert cost[True].flops.logits == cost[False].flops.logits
        assert cost[True].comms == cost[False].comms
        assert cost[True].argument_bytes == cost[False].argument_bytes


def test_pipeline_gathers_stage_weights_once_per_step():
    """The pipelined 7B dry run (stage=4,fsdp=2, 10,10,6,6, 32 x 2048, float32), unpadded storage of 4
    rows per device: per step, whatever M and the schedule, one all-gather of the stage's 10-slot working
    copy, one reduce-scatter of its gradients (each device's 5 slots), one row received by ppermute and its
    gradient sent back; the activations' ppermutes twice per GPipe step (M + S - 1) or 1F1B tick."""
    from sharding.pipeline.layout import one_f_one_b_ticks

    config = get_config("7b")

    def cost(micro, one_f_one_b=False):
        layout = cm.Layout(
            {"stage": 4, "fsdp": 2},
            "fsdp",
            micro,
            stage_layers=(10, 10, 6, 6),
            pipeline_schedule=_one_f_one_b(one_f_one_b),
        )
        return cm.estimate(config, 32, 2048, layout, backend="cpu")

    layer = sum(p.size for p in describe(config).params if p.per_layer) * 4  # one layer, float32, whole

    def layer_bytes(c, kind):
        return sum(
            x.total_bytes
            for x in c.comms
            if x.kind == kind and x.what.split()[-1] != "activations" and ("layers/" in x.what)
        )

    costs = {(m, f): cost(m, f) for m in (8, 16) for f in (False, True)}
    for (micro, one_f_one_b), c in costs.items():
        assert layer_bytes(c, "all-gather") == pytest.approx(10 * layer, rel=1e-9)
        assert layer_bytes(c, "reduce-scatter") == pytest.approx(5 * layer, rel=1e-9)
        assert layer_bytes(c, "collective-permute") == pytest.approx(2 * layer, rel=1e-9)
        sends = [x for x in c.comms if x.what == "stage activations"]
        act = 32 / 2 / micro * 2048 * config.embed_dim * 4  # one microbatch's rows on a device, float32
        trips = one_f_one_b_ticks(4, micro).ticks if one_f_one_b else micro + 3
        assert [(x.result_bytes, x.count) for x in sends] == [(act, 2 * trips)]

    # At the same microbatch size, GPipe's saved inputs grow with M (every slot of every step), 1F1B's do
    # not (at most S microbatches' stage inputs per stage); both hold every microbatch's stage input and its
    # cotangent (one row of 2,048 tokens each, float32), which are not counted here.
    def saved(micro, one_f_one_b):
        layout = cm.Layout(
            {"stage": 4, "fsdp": 2},
            "fsdp",
            micro,
            stage_layers=(10, 10, 6, 6),
            pipeline_schedule=_one_f_one_b(one_f_one_b),
        )
        activations = cm.device_cost(config, layout, seq_len=2048, rows=1, backend="cpu").memory.activations
        return activations - 2 * micro * 2048 * config.embed_dim * 4

    assert saved(16, True) == saved(8, True) < saved(8, False) < saved(16, False)


def test_a_pipelines_embedding_moves_the_table_once_the_tokens_outnumber_the_vocabulary():
    """GPipe on ``stage=4,fsdp=2``, 32 x 64 tokens in 8 microbatches: a device looks up 1,024 tokens from a
    512-entry table split over ``fsdp`` (``embed``), so the partitioner moves the table's ``[512, 64]`` shard to
    the devices whose tokens it serves (a collective-permute, and the gradient back) rather than the rows by an
    all-to-all (`sharding.costmodel.pipeline_comms._lookup_moves_rows`; at 512 tokens, the grid's and the 16 x 64
    dry run's, it moves the rows). Every collective kind of the compiled step within 10%, no all-to-all."""
    case = ("test", "stage=4,fsdp=2", "fsdp", 32, 64, 8, "none", None, 1)
    cost, compiled = predicted(case), compiled_figures(case)["collectives"]
    assert "all-to-all" not in compiled
    _assert_collectives_within(cost, compiled)


def test_the_7b_pipelines_embedding_moves_its_table_not_its_rows():
    """The README's 7B on ``stage=4,fsdp=2`` (GPipe, 10,10,6,6, 32 x 2048, M = 16): 16 x 2,048 tokens a device
    against 32,000 table entries, so the lookup moves the ``[32000, 2048]`` float32 table shard there and its
    gradient back (250 MiB each) and prices no all-to-all, as the compiled step has none (``bench/RESULTS.md``:
    all-gather, all-reduce, collective-permute and reduce-scatter within 0.1% of the dry run's compiled figures)."""
    cost = cm.estimate(get_config("7b"), 32, 2048, _seven_b_pipeline(), backend="cpu")
    assert "all-to-all" not in cm.collective_bytes(cost.comms)
    moved = [(c.result_bytes, c.count) for c in cost.comms if c.what == "embedding: table and gradient"]
    assert moved == [(32000 * 4096 / 2 * 4, 2)]


@pytest.mark.parametrize(
    "case",
    [
        ("test", "fsdp=2,tensor=4", "fsdp_tp", 16, 64, 1, "none"),
        ("test", "stage=2,tensor=4", "fsdp_tp", 16, 64, 4, "none", None, 1),
    ],
    ids=_id,
)
def test_fewer_kv_heads_than_tensor_are_priced_as_compiled(case):
    """``test``'s 2 KV heads on ``tensor=4`` (the KV projections whole there, the 4 query heads split): the
    backward's key and value cotangents summed over the 2 devices sharing a KV head and all-gathered over the 2
    of distinct KV heads, per layer and microbatch (`sharding.costmodel.partitioner._kv_cotangent_comms`), the
    KV weights gathered over ``tensor`` from slices a collective-permute brings (`_kv_weight_moves`), and, on the
    pipeline, the vocabulary-parallel lookup over ``tensor`` x ``stage`` with no all-to-all. Every collective
    kind within 10%."""
    _assert_collectives_within(predicted(case), compiled_figures(case)["collectives"])


def _one_f_one_b(on: bool) -> str:
    """The ``pipeline_schedule`` of a layout that runs 1F1B in lockstep (``on``) or GPipe."""
    return "1f1b" if on else "gpipe"


def _seven_b_pipeline(**layout):
    """The 7B's pipeline layout these tests price: stage=4,fsdp=2 with stages of 10,10,6,6 layers, M = 16."""
    return cm.Layout({"stage": 4, "fsdp": 2}, "fsdp", 16, stage_layers=(10, 10, 6, 6), **layout)


@pytest.mark.parametrize(
    "one_f_one_b, schedule, passes",
    [(False, "gpipe", 2), (True, "1f1b", 2), (True, "1f1b-fused", 2), (True, "zb", 2)],
)
def test_pipeline_weights_gathered_per_microbatch_cost_a_layer_per_slot(one_f_one_b, schedule, passes):
    """The 7B on stage=4,fsdp=2 (10,10,6,6), ``pipeline_gather`` ``microbatch``: the storage splits each row's
    features over fsdp (G = 2), so each of the M microbatches' forward and backward passes (zero bubble:
    forward and input-gradient passes; its weight-gradient pass reads no weight) all-gathers each of the 10
    layers on its own, the backward once more for the 5 layers whose inputs it recomputes (the forward saves
    one input per 2 layers), and its (weight-)gradient pass reduce-scatters each layer's gradient (a half
    layer per device); the stored rows (two half rows) still move once per step. In flight: one layer and
    the received half rows, against the 10-slot working copy gathered once, whatever the schedule; the saved
    activations, 5 inputs per chunk pass instead of 10. The 1F1B family's head is gathered and reduce-scattered
    at each of the M head steps instead of once, holding the float32 sums of its fsdp half instead of its whole
    copy and whole sums; its entry, the embedding table, alike on stage 0 (gathered at each microbatch's first
    forward, its gradient reduce-scattered at its backward), which holds no microbatch's stage input
    (`sharding.pipeline.edges.Entry`)."""
    config = get_config("7b")
    layer = sum(p.size for p in describe(config).params if p.per_layer) * 4  # one layer, float32, whole

    def cost(gather):
        # remat full: the stage saves slot inputs and recomputes each layer (none/dots keep residuals instead)
        layout = _seven_b_pipeline(pipeline_schedule=schedule, pipeline_gather=gather, remat="full")
        return cm.estimate(config, 32, 2048, layout, backend="cpu")

    def layer_bytes(c, kind):
        return sum(x.total_bytes for x in c.comms if x.kind == kind and "layers/" in x.what)

    def head_comms(c, kind):
        """``[(runs, bytes)]`` of the head's explicit gathers (to whole) or reduce-scatters, its two weights'
        summed per distinct run count."""
        found = [x for x in c.comms if x.kind == kind and x.what.startswith(("gather ", "gradient of "))]
        found = [x for x in found if "layers/" not in x.what and " over " not in x.what]
        runs = sorted({x.count for x in found})
        return [(n, pytest.approx(sum(x.result_bytes for x in found if x.count == n), rel=1e-9)) for n in runs]

    once, streamed = cost("once"), cost("microbatch")
    assert layer_bytes(streamed, "all-gather") == pytest.approx((passes + 0.5) * 16 * 10 * layer, rel=1e-9)
    assert layer_bytes(streamed, "reduce-scatter") == pytest.approx(16 * 10 * layer / 2, rel=1e-9)
    # stage 0 receives two half rows where gathering once receives one whole row
    assert layer_bytes(streamed, "collective-permute") == layer_bytes(once, "collective-permute")
    # the 1F1B family's head (final norm, output projection, float32): gathered once, held whole with whole
    # float32 gradient sums through the loop; per microbatch, gathered and reduce-scattered over fsdp at each of
    # the M head steps on the last stage, holding the sums of its half (its whole copy and gradient, 1,000 MiB,
    # only while a head step runs, under the 2,510 MiB working set of a layer and its gathered copy)
    head = sum(p.size for p in describe(config).params if not p.per_layer and p.role != "embedding") * 4
    table = describe(config).with_role("embedding").size * 4  # the entry's, streamed alike
    if one_f_one_b:
        assert head_comms(once, "all-gather") == [(1, head)] and head_comms(once, "reduce-scatter") == [(1, head / 2)]
        assert head_comms(streamed, "all-gather") == [(16, head + table)]
        assert head_comms(streamed, "reduce-scatter") == [(16, (head + table) / 2)]
    # streamed, the table's float32 sums of its fsdp half are held through the loop too
    held = {"once": 2 * head * one_f_one_b, "microbatch": (head + table) / 2 * one_f_one_b}
    assert once.memory.gathered == pytest.approx(10 * layer + held["once"], rel=1e-9)
    assert streamed.memory.gathered == pytest.approx(2 * layer + held["microbatch"], rel=1e-9)
    # 8 slots fewer; the float32 sums: the working copy's 10 slots in place of the 4 stored rows' gradients (6
    # more) against the received half rows' 1 (each leaf of the gathered layer's gradient is reduce-scattered as
    # the slot's backward produces it: no whole layer's gradient is held); and the ring keeps one input per 2
    # layers, 5 saved activations per chunk instead of 10 (zero bubble's ring of what its input gradients keep
    # for the weight gradients is the same in both modes); and the head's held bytes; and GPipe's head logits
    # beyond a layer's working set (4 rows' 2,000 MiB over 1,738 MiB gathering once; under 2,510 MiB with the
    # layer gathered per microbatch)
    saved = once.memory.activations - streamed.memory.activations
    assert streamed.memory.state == once.memory.state  # 4 whole rows or 8 half rows per device
    fewer = (8 + 5) * layer + saved + held["once"] - held["microbatch"] + once.memory.logits - streamed.memory.logits
    assert streamed.memory.total == pytest.approx(once.memory.total - fewer, rel=1e-9)
    ring = cm.tick_table(schedule, 4, 16, 1).slots if one_f_one_b else 16 + 4 - 1
    act = 2048 * config.embed_dim * 4  # one slot input: one row of a microbatch per device, float32
    # streamed, the 1F1B family also holds none of the M microbatches' stage inputs nor their cotangents (stage 0
    # embeds each one); gathering once, a layer's pass holds its slot's weights sliced out of the working copy
    # (streamed, the gathered layer is in `gathered`)
    assert saved == pytest.approx(ring * (10 - 5) * act + 2 * 16 * act * one_f_one_b + layer, rel=1e-9)


@pytest.mark.parametrize("gather", ["once", "microbatch"])
def test_the_1f1b_heads_gathered_copy_counts_per_microbatch_only_above_a_layers_working_set(gather):
    """The 7B on stage=4,fsdp=2 (10,10,6,6), 1F1B, its vocabulary grown by 16,000 entries (the output projection
    by ``d`` = 4096 x 16,000 float32, 250 MiB; no layer changes). Gathered once, the held head grows by its
    whole copy and whole sums, ``2 d``, and at 128k-144k entries, where one row's logits and the head's
    gradient product (2,000-2,250 MiB and as much) exceed a layer's backward working set (2,510 MiB: 1,738 with
    the reference attention's two score-sized arrays and the slot's weights sliced out of the working copy),
    by the logits' 250 MiB and the product's ``d`` more; at 32k-48k entries (1,000-1,500 MiB) they do not. Per microbatch, by the sums of its fsdp half, ``d / 2`` (and the streamed embedding
    table's as much), while the whole copy and gradient it holds during a head step, with the step's logits
    (1,500-2,250 MiB at 32k-48k entries), stay under a layer's backward working set (2,510 MiB with its gathered
    layer); at 128k-144k entries (6,000-6,750 MiB) they exceed it, and the peak grows by ``2 d`` and the logits'
    250 MiB more."""
    d = 4096 * 16000 * 4

    def gathered(vocab):
        layout = _seven_b_pipeline(pipeline_schedule="1f1b", pipeline_gather=gather)
        memory = cm.estimate(get_config("7b", [f"vocab_size={vocab}"]), 32, 2048, layout, backend="cpu").memory
        return memory.gathered + memory.logits  # held through the loop, and the head step beyond a layer's

    below, above = gathered(48000) - gathered(32000), gathered(144000) - gathered(128000)
    logits = 2048 * 16000 * 4 * 2  # one microbatch row's float32 logits and their gradient
    if gather == "once":
        assert below == pytest.approx(2 * d, rel=1e-9) and above == pytest.approx(3 * d + logits, rel=1e-9)
    else:
        # the sums of the fsdp halves of the output projection and of the table (the streamed entry), d / 2 each
        assert below == pytest.approx(d, rel=1e-9) and above == pytest.approx(d + 2 * d + logits, rel=1e-9)


@pytest.mark.parametrize("attention", ["reference", "flash"])
@pytest.mark.parametrize("gather", ["once", "microbatch"])
@pytest.mark.parametrize("one_f_one_b", [False, True])
def test_pipeline_in_flight_bytes_are_what_the_step_holds_at_its_peak(attention, gather, one_f_one_b):
    """The 7B dry run's in-flight terms (stage=4,fsdp=2, 10,10,6,6, M = 16, 32 x 2048, float32), hand-computed
    from XLA's live ranges of the compiled step (`bench/RESULTS.md`, "The per-microbatch temporaries: what is
    live at the peak"): the head's logits and a layer's backward never peak together, so the logits count only
    beyond the backward's working set; the per-microbatch gather holds no whole layer's float32 gradient; every
    microbatch's stage input is held with its cotangent (but for the 1F1B family's streamed entry)."""
    config = get_config("7b")
    d, f, tokens = config.embed_dim, config.mlp_dim, 2048  # one row of a microbatch per device
    layer = (4 * d * d + 3 * d * f + 2 * d) * 4  # one layer's weights, float32, whole: 772.03 MiB
    layout = _seven_b_pipeline(  # remat full: slot inputs saved, each layer recomputed (the dry run's)
        pipeline_schedule=_one_f_one_b(one_f_one_b), pipeline_gather=gather, attention=attention, remat="full"
    )
    memory = cm.estimate(config, 32, 2048, layout, backend="cpu").memory
    # A layer's activations per token (models/spec.py: block input, attention output, 4 norm/residual, q, attention
    # output, k and v twice, 2 float32 norm copies, 3 MLP), and where the scores are materialised the score-sized
    # float32 arrays its backward holds at once (the record's count, checked against the compiler in
    # test_attention_registry.py: the reference attention's probabilities and dp), each with its boolean mask.
    scores = (32 * 2048 * 4 + 2048) * registry.kernel(attention).traits.backward_scores
    activations = tokens * ((14 * d + 3 * f) * 4 + scores)
    # and the slot's layer (float32 compute): gathered per microbatch, or sliced out of the working copy
    backward = activations + layer
    # GPipe: the head after the loop on 1/S of the device's 16 rows; 1F1B: one microbatch's row per tick
    logits = (1 if one_f_one_b else 4) * tokens * config.vocab_size * 4 * 2  # float32 logits and their gradient
    # the 1F1B head gathered per microbatch: its whole copy and whole gradient, float32, during the head step
    head = (d * config.vocab_size + d) * 4
    logits += 2 * head * (one_f_one_b and gather == "microbatch")
    # the 1F1B head gathered once: its weights' gradient product, whole (float32 compute), during the head step
    logits += head * (one_f_one_b and gather == "once")
    assert memory.logits == pytest.approx(max(0.0, logits - backward), rel=1e-12)
    # with flash attention a layer's working set (1,478 MiB with the slot's layer) falls under GPipe's logits of 4
    # rows (2,000 MiB) and, just, under the streamed 1F1B head step (1,500 MiB), not under 1F1B's head step
    # gathering once (1,000 MiB: one row's logits and the head's gradient product); with the reference
    # attention's (2,510 MiB) under none
    peaks = attention == "flash" and not (one_f_one_b and gather == "once")
    assert (memory.logits > 0) == peaks
    # gradient sums beyond the stored rows' gradients: the working copy's 10 slots in place of the 4 stored rows,
    # or the 2 received half rows (each leaf of the gathered layer is reduce-scattered as its backward yields it)
    assert memory.gradients - memory.parameters == pytest.approx((6 if gather == "once" else 1) * layer, rel=1e-12)
    ring = cm.tick_table("1f1b", 4, 16, 1).slots if one_f_one_b else 16 + 4 - 1
    # slot (block) inputs; every microbatch's stage input and its cotangent, but for the 1F1B family's streamed
    # entry (stage 0 embeds each microbatch itself)
    saved = ring * (10 if gather == "once" else 5) + 2 * 16 * (not (one_f_one_b and gather == "microbatch"))
    assert memory.activations == pytest.approx(
        tokens * saved * d * 4 + activations + layer * (gather == "once"), rel=1e-12
    )


def test_zero_bubble_keeps_a_cut_for_every_slot_position_of_a_chunk_pass():
    """Zero bubble's ring of cuts (`sharding.pipeline.program.cut_ring`) holds each chunk pass's `positions`:
    the 1B on stage=2,fsdp=4 with 9,7 layers runs, gathering once, the 9 slots of its working copy (gathered
    as K' = 12, rounded up so the 4 fsdp devices divide it, the 3 padded slots dropped) and, per microbatch, 3
    blocks of 4 positions (12 for 9 layers, 3 of them empty): the rings of cuts are 9 and 12 positions deep, and
    the modes differ in the saved inputs (the ring's entries of 9 slot inputs against 3 blocks' inputs) and in
    the stage inputs (per microbatch stage 0 embeds each microbatch: none of the 8 held, nor their
    cotangents)."""
    config = get_config("1b")

    def activations(gather):
        layout = cm.Layout(
            {"stage": 2, "fsdp": 4},
            "fsdp",
            8,
            stage_layers=(9, 7),
            pipeline_schedule="zb",
            pipeline_gather=gather,
            remat="full",  # slot inputs saved (none/dots keep each slot's residuals instead)
        )
        return cm.estimate(config, 32, 2048, layout, backend="cpu").memory.activations

    table = cm.tick_table("zb", 2, 8, 1)
    one_input = 2048 * config.embed_dim * 4  # one row of 2,048 tokens, float32
    cut = weight_cut_bytes(describe(config), get_rules("fsdp"), {"stage": 2, "fsdp": 4, "tensor": 1}, 4, 2048)
    # and, gathering once, the 8 microbatches' stage inputs and their cotangents (streamed, stage 0 embeds each),
    # less the 3 positions of each cut the per-microbatch gather's blocks run past the 9 layers; and, gathering
    # once, the slot's weights sliced out of the working copy beside a layer's pass (per microbatch, the gathered
    # layer is in `gathered`)
    layer = sum(p.size for p in describe(config).params if p.per_layer) * 4
    fewer = table.slots * (9 - 3) * one_input + 2 * 8 * one_input - table.saved_slots * 3 * cut + layer
    assert activations("once") - activations("microbatch") == pytest.approx(fewer, rel=1e-12)


@pytest.mark.parametrize("stage_layers, mesh_spec", [((7, 5, 2, 2), "stage=4,fsdp=2"), ((5, 3), "stage=2,fsdp=4")])
def test_pipeline_state_bytes_are_the_unpadded_storage(stage_layers, mesh_spec):
    """A pipeline's persistent bytes per device: the unpadded storage (no stage holds the largest stage's
    slots), against the state's shards (abstract, nothing compiled); the compiled arguments of uneven
    pipelines are checked on `PIPELINE_GRID` (`test_state_bytes_match_memory_analysis`)."""
    from sharding import pipeline as pl
    from sharding.mesh import make_mesh
    from sharding.parallel import Parallelism
    from train.reports import report
    from train.runtime.optimizer import OptimizerConfig
    from train.runtime.step import Trainer

    config = get_config("test", [f"num_layers={sum(stage_layers)}"])
    mesh = parse_mesh(mesh_spec, 8)
    layout, _ = plan_layout(sum(stage_layers), mesh["stage"], 1, stage_layers)
    trainer = Trainer(
        config,
        OptimizerConfig(),
        Parallelism.of(make_mesh(mesh), get_rules("fsdp_tp"), pipeline=pl.PipelinePlan(layout, 4)),
    )
    cost = cm.estimate(config, 16, 32, cm.Layout(mesh, "fsdp_tp", 4, "none", stage_layers=stage_layers), backend="cpu")
    state = report.device_state_bytes(trainer.abstract_state())
    assert 0 <= state - cost.memory.state <= 32  # parameters and AdamW moments; the rest: step, RNG key, counters


def test_layout_of_reads_a_parallelism_strategy_by_strategy():
    from sharding.parallel import Accumulation, Parallelism, UnevenBatch

    config = get_config("test", remat="full")
    accumulate = cm.layout_of(Parallelism({"fsdp": 8}, get_rules("fsdp"), Accumulation(4)), config)
    assert (accumulate.microbatches, accumulate.remat, accumulate.attention, accumulate.uneven_batch) == (
        4,
        "full",
        config.attention,
        False,
    )
    uneven = cm.layout_of(Parallelism({"data": 8}, get_rules("dp"), UnevenBatch((3, 3, 1, 1, 2, 2, 2, 2))))
    assert uneven.uneven_batch and uneven.microbatches == 2 and uneven.remat == "none"
    stages, _ = plan_layout(8, 2, 2, (5, 3))
    plan = dataclasses.replace(PipelinePlan(stages, 4, schedule="1f1b"), skip_empty=False)
    piped = cm.layout_of(
        Parallelism({"stage": 2, "fsdp": 4}, get_rules("fsdp"), pipeline=plan), config, dtype="bfloat16"
    )
    assert (
        piped.stage_layers,
        piped.pipeline_repeats,
        piped.microbatches,
        piped.pipeline_schedule.one_f_one_b,
        piped.skip_empty,
        piped.dtype,
    ) == ((5, 3), 2, 4, True, False, "bfloat16")
    hand = cm.Layout(
        {"stage": 2, "fsdp": 4},
        "fsdp",
        4,
        "full",
        stage_layers=(5, 3),
        pipeline_repeats=2,
        dtype="bfloat16",
        attention=config.attention,
        skip_empty=False,
        pipeline_schedule="1f1b",
    )
    model = describe(get_config("test", ["num_layers=8"]))
    assert cm.estimate(model, 32, 64, piped) == cm.estimate(model, 32, 64, hand)


def test_ring_and_ulysses_are_priced_as_flash_without_a_length_split_and_with_their_traffic_over_one():
    model = describe(get_config("test"))
    flash = cm.estimate(model, 16, 64, cm.Layout({"fsdp": 8}, "fsdp", attention="flash"))
    for attention, kind in (("ring", "collective-permute"), ("ulysses", "all-to-all")):
        assert cm.estimate(model, 16, 64, cm.Layout({"fsdp": 8}, "fsdp", attention=attention)) == flash
        split = cm.estimate(model, 16, 64, cm.Layout({"fsdp": 4, "sequence": 2}, "fsdp", attention=attention))
        assert kind in cm.collective_bytes(split.comms)
        assert split.tokens == flash.tokens  # 4 rows x 32 tokens against 2 rows x 64
    with pytest.raises(ValueError, match="attention 'reference' over context=2: the cost model prices the context"):
        cm.estimate(model, 16, 64, cm.Layout({"fsdp": 4, "context": 2}, "fsdp", attention="reference"))


def test_an_unpriced_context_split_names_the_registry_kernels_that_split_the_length():
    model = describe(get_config("test"))
    splitting = [k.traits.name for k in registry.KERNELS if k.traits.splits_length]
    assert splitting == ["ring", "ulysses", "usp"]  # the registry's, read by the reason rather than copied
    with pytest.raises(ValueError, match=r"the attentions that split the length \(ring, ulysses, usp\) only"):
        cm.estimate(model, 16, 64, cm.Layout({"fsdp": 4, "context": 2}, "fsdp", attention="flash"))
    flash, ring = model.attention_kernel("flash"), model.attention_kernel("ring")
    assert cm.unpriced_attention(flash, {"context": 2}, [flash, ring]).endswith("split the length (ring) only")
    assert cm.unpriced_attention(ring, {"context": 2}, [flash, ring]) is None


@pytest.mark.parametrize("case", CONTEXT_GRID[-1:], ids=_id)
def test_a_split_length_is_priced_as_the_compiled_step_runs(case):
    """USP attention over ``context`` x ``sequence`` (its all-to-all and its ring: the exchanges of the
    other two; ``bench/costmodel.py`` reports ring and ulysses alone, within 10% too, `CONTEXT_GRID`): FLOPs,
    arguments and every collective kind of one compiled train step within 10%. The products that run: those outside
    conditionals and half of those inside, whose only conditional is the zigzag ring's choice between two
    visiting blocks of equal products (the lower half of the keys or the upper half of the queries). The
    flash kernels' causal loops have run-time trip counts, which `sharding.hlo.dot_flops` counts once: at 256
    tokens (two query tiles) that is half the square, the model's key fraction, while at 1,024 it counts a
    quarter, so the products are checked at this length; the rest of the gap is the ring's diagonal block,
    one tile computed whole (8% on ring, 9% on USP)."""
    figures, cost = compiled_figures(case), predicted(case)
    runs = figures["dot_outside"] + figures["dot_branches"] / 2
    assert _within(cost.matmul_flops, runs), (cost.matmul_flops, runs)
    assert _within(cost.counted_flops, figures["flops"]), (cost.counted_flops, figures["flops"])
    assert _within(cost.argument_bytes, figures["arguments"]), (cost.argument_bytes, figures["arguments"])
    _assert_collectives_within(cost, figures["collectives"])


# Uneven sequence shards (--context-shares) ------------------------------------------------------------------


def test_uneven_context_shares_shrink_attention_and_nothing_else():
    """Shares 3:1 over 64 tokens on ``data=4,sequence=2``: 48 and 16 real tokens in blocks of 48 positions. Each
    ring device's weight products, head, elementwise work, optimizer, memory and ring traffic are exactly those
    of even shards at the padded 96 positions (the blocks run whole); attention alone follows the real tokens:
    device r's is even shards' at 64 tokens times ``tokens[r] / 32`` (the sum kept). `estimate` prices the
    busiest device, and the run's token counts price as the relative shares do."""
    model = describe(get_config("test"))
    layout = cm.Layout({"data": 4, "sequence": 2}, "fsdp_tp", attention="ring")
    shared = dataclasses.replace(layout, context_shares=(3, 1))
    assert cm.ring_tokens(shared, 64) == (48, 16) and cm.ring_tokens(layout, 64) is None
    padded, even = (cm.estimate(model, 8, n, layout, backend="cpu") for n in (96, 64))
    devices = [cm.device_cost(model, shared, seq_len=64, rows=2, backend="cpu", ring_position=r) for r in (0, 1)]
    for cost, tokens in zip(devices, (48, 16)):
        assert cost.memory == padded.memory and cost.comms == padded.comms and cost.tokens == padded.tokens
        for part in ("layers", "logits", "recompute", "elementwise", "optimizer"):
            assert getattr(cost.flops, part) == getattr(padded.flops, part), part
        assert cost.counted_flops == pytest.approx(padded.counted_flops, rel=1e-12)  # Pallas products unseen
        assert cost.flops.attention == pytest.approx(even.flops.attention * tokens / 32, rel=1e-12)
    assert cm.estimate(model, 8, 64, shared, backend="cpu") == devices[0]
    assert cm.estimate(model, 8, 64, dataclasses.replace(layout, context_shares=(48, 16)), backend="cpu") == devices[0]
    with pytest.raises(ValueError, match="context_shares need ring attention in the zigzag layout"):
        cm.estimate(model, 8, 64, dataclasses.replace(shared, attention="ulysses"), backend="cpu")
    with pytest.raises(ValueError, match=r"context_shares \[1, 1, 1\]: give one share >= 0 per device"):
        dataclasses.replace(layout, context_shares=(1, 1, 1))


def test_uneven_attention_is_priced_as_the_kernels_tiles_per_device():
    """Per device of a ring on uneven shards (P = 4, 2,048 tokens, 768/256/512/512 real tokens, float32 64 x 64
    tiles), the priced attention forward against the tiles the flash kernels compute
    (`uneven_ring_tile_counts`: the ring's chunk pairs, each kernel skipping tiles above the causal diagonal or
    of padding only): within 10% on every device (the diagonal tiles, computed whole, add about 3%). The
    compiled step cannot show this: one program runs on every device, and the tile ranges are run-time values."""
    from models.kernels.ring_attention import uneven_ring_tile_counts

    model = describe(get_config("test"))
    tokens = (768, 256, 512, 512)
    layout = cm.Layout({"data": 2, "sequence": 4}, "fsdp_tp", attention="ring", context_shares=tokens)
    tiles = uneven_ring_tile_counts(tokens, max(tokens))
    geometry = model.attention
    per_tile = 4 * 64 * 64 * geometry.head_dim * geometry.num_heads  # both products of one tile, every head
    factor = model.attention_kernel("ring").training_factor
    for r, n in enumerate(tiles):
        cost = cm.device_cost(model, layout, seq_len=2048, rows=4, backend="cpu", ring_position=r)
        priced = cost.flops.attention / factor / (cost.layers * 4)  # one sequence through one layer, forward
        assert _within(priced, n * per_tile), (r, priced, n * per_tile)


@pytest.mark.parametrize("case", UNEVEN_CONTEXT_GRID, ids=_id)
def test_uneven_context_shares_are_priced_as_the_compiled_step_runs(case):
    """Ring attention on shares 3:1 (`UNEVEN_CONTEXT_GRID`: 96 and 32 real tokens in blocks of 96 positions):
    the compiled step of the padded length against the price of its busiest device, FLOPs as cost_analysis
    counts them (the weight products, head and elementwise work of the padded blocks: the kernels' products are
    unseen), arguments and every collective kind within 10%."""
    figures, cost = compiled_figures(case), predicted(case)
    assert _within(cost.counted_flops, figures["flops"]), (cost.counted_flops, figures["flops"])
    assert _within(cost.argument_bytes, figures["arguments"]), (cost.argument_bytes, figures["arguments"])
    _assert_collectives_within(cost, figures["collectives"])


@pytest.mark.parametrize("case", UNEVEN_CONTEXT_GRID, ids=_id)
def test_temporaries_of_a_padded_split_length_match_the_compiled_step(case):
    """The temporaries the padded length adds with each scanned layer (4 layers against 2, `UNEVEN_CONTEXT_GRID`'s
    case: 2 rows x 96 positions a device, a third of them padding), as the compiler allocates them: the layer's
    saved activations under ``dots`` at every padded position and its float32 gradient, priced to the byte."""
    two = (case[0] + "+num_layers=2", *case[1:])
    per_layer = (compiled_figures(case)["temp"] - compiled_figures(two)["temp"]) / 2
    four, half = predicted(case).memory, predicted(two).memory
    grown = sum(getattr(four, f) - getattr(half, f) for f in ("activations", "gradients")) / 2
    assert _within(grown, per_layer), (grown, per_layer)
    assert grown == pytest.approx(per_layer, rel=1e-3)  # to the byte on jax 0.10
