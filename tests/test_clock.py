"""The cost model's clock: collectives as NCCL runs them, FSDP gathers in the compute dtype, and the fitted
efficiency per device kind. No devices and no compiles: the clock prices descriptions."""

import argparse
import dataclasses
import math

import pytest

from models.config import get_config
from models.spec import describe
from sharding import costmodel as cm
from sharding import devices, planner
from train.plan import build_parser, given_layout, options_from, overlap_axes

A100 = devices.get_kind("a100")


def _hw(efficiency=None):
    return cm.hardware_for(A100, 8, 200e9, efficiency)


def test_ring_inside_a_host_and_tree_across_hosts():
    """Inside a host a ring pays one NVLink step per rank; across 384 hosts of 8 an all-reduce's tree pays
    ``2 (7 alpha_nvlink + log2(384) alpha_net)``, far below the ring's 2 x 3,071 steps; an all-gather stays
    a ring, whose network steps are the hosts', not the ranks'."""
    hw, lat = _hw(), cm.NCCL_LATENCY
    inside = cm.Comm("all-gather", ("tensor",), 8, 0.0, 1, "x")
    links = {"tensor": "intra", "data": "inter"}
    assert cm.comm_seconds(inside, hw, links) == pytest.approx(lat["base"] + 7 * lat["ring_nvlink"])
    shares = {"data": 8}  # 8 of the group's ranks on each host
    reduce = cm.Comm("all-reduce", ("data",), 3072, 0.0, 1, "x")
    tree = 2 * (7 * lat["tree_nvlink"] + math.log2(384) * lat["tree_net"])
    assert cm.comm_seconds(reduce, hw, links, shares) == pytest.approx(tree)
    ring = lat["base"] + 2 * (3071 - 383) * lat["ring_nvlink"] + 2 * 383 * lat["ring_net"]
    assert tree < ring / 10
    gather = cm.Comm("all-gather", ("data",), 3072, 0.0, 1, "x")
    assert cm.comm_seconds(gather, hw, links, shares) == pytest.approx(
        lat["base"] + (3071 - 383) * lat["ring_nvlink"] + 383 * lat["ring_net"]
    )
    one_per_host = lat["base"] + 3071 * lat["ring_net"]
    assert cm.comm_seconds(gather, hw, links) == pytest.approx(one_per_host)


def test_large_messages_pay_the_bus_bandwidth():
    hw = _hw()
    big = cm.Comm("all-gather", ("data",), 16, 16e9, 1, "x")
    seconds = cm.comm_seconds(big, hw, {"data": "inter"}, {"data": 1})
    assert seconds == pytest.approx(big.wire_bytes() / hw.inter_bandwidth, rel=1e-3)
    assert cm.host_shares({"data": 4, "fsdp": 4, "tensor": 4}, 8) == {
        "data": 1,
        "stage": 1,
        "fsdp": 2,
        "expert": 1,
        "context": 1,
        "sequence": 1,
        "tensor": 4,
    }


def test_a_ring_across_hosts_leaves_each_host_once():
    """A ring with g ranks on each host crosses the network at host boundaries only, on the host's NICs: its
    bytes move at g x the device's share of the network (capped by NVLink); one rank per host keeps the
    device's share; an all-to-all keeps it too. Figures by hand: A100 hosts of 8 with 200 GB/s of network
    (25 GB/s a device), NVLink 300 GB/s one way, a 16 GB gather result (15 GB of wire bytes over 16 ranks)."""
    hw, lat = _hw(), cm.NCCL_LATENCY
    assert hw.inter_bandwidth == pytest.approx(25e9) and hw.intra_bandwidth == pytest.approx(300e9)
    gather = cm.Comm("all-gather", ("fsdp",), 16, 16e9, 1, "x")
    links = {"fsdp": "inter", "data": "inter"}
    ring = lat["base"] + 14 * lat["ring_nvlink"] + 1 * lat["ring_net"]  # 2 hosts: one network step
    assert cm.comm_seconds(gather, hw, links, {"fsdp": 8}) == pytest.approx(ring + 15e9 / 200e9)  # 0.075 s
    two = ring - 14 * lat["ring_nvlink"] + 8 * lat["ring_nvlink"] + 6 * lat["ring_net"]  # 8 hosts of 2
    assert cm.comm_seconds(gather, hw, links, {"fsdp": 2}) == pytest.approx(two + 15e9 / 50e9)
    spread = lat["base"] + 15 * lat["ring_net"]  # one rank per host: the device's own 25 GB/s
    assert cm.comm_seconds(gather, hw, links, {"fsdp": 1}) == pytest.approx(spread + 15e9 / 25e9)
    fat = cm.hardware_for(A100, 8, 8 * 400e9)  # 400 GB/s a device: the ring runs at NVLink's 300 GB/s
    assert cm.comm_seconds(gather, fat, links, {"fsdp": 8}) == pytest.approx(ring + 15e9 / 300e9)
    reduce = cm.Comm("all-reduce", ("fsdp",), 16, 16e9, 1, "x")  # ring 2 x 15 GB, tree 2 x 16 GB: the ring
    ring_ar = lat["base"] + 28 * lat["ring_nvlink"] + 2 * lat["ring_net"]
    assert cm.comm_seconds(reduce, hw, links, {"fsdp": 8}) == pytest.approx(ring_ar + 30e9 / 200e9)
    a2a = cm.Comm("all-to-all", ("fsdp",), 16, 16e9, 1, "x")
    assert cm.comm_seconds(a2a, hw, links, {"fsdp": 8}) == pytest.approx(ring + 15e9 / 25e9)


def test_fsdp_gathers_move_the_compute_dtype_on_gpu():
    """The GPU step gathers the bfloat16 copy of each weight (half the bytes of float32); a CPU compile
    upcasts bfloat16 collectives, so the CPU prediction keeps float32. Gradients stay float32 on both."""
    model = describe(get_config("test"))
    layout = cm.Layout({"fsdp": 8}, "fsdp", 1, "none", attention="flash", dtype="bfloat16")

    def gathers(backend):
        cost = cm.estimate(model, 16, 64, layout, backend=backend)
        return sum(c.total_bytes for c in cost.comms if c.kind == "all-gather" and c.what.startswith("gather layers"))

    assert gathers("gpu") == pytest.approx(gathers("cpu") / 2)
    f32 = cm.estimate(model, 16, 64, cm.Layout({"fsdp": 8}, "fsdp", 1, "none", attention="flash"), backend="gpu")
    assert sum(c.total_bytes for c in f32.comms if c.what.startswith("gather layers")) == pytest.approx(gathers("cpu"))


def test_measured_fractions_are_data_with_their_source():
    """A100 and H100 carry their SMs and the matmul and attention fractions measured by published benchmarks
    (not fitted to training runs), with the benchmark named; ``--efficiency`` still prices all the step's work
    at one figure; a kind without a measurement gets the stated defaults."""
    for name, sms in (("a100_80gb", 108), ("h100_sxm", 132)):
        kind = devices.get_kind(name)
        assert kind.sm_count == sms and kind.gemm_fraction == devices.GEMM_BENCHMARKS[name][0]
        assert "mamf" in kind.efficiency_source.lower() and "FlashAttention" in kind.efficiency_source
    shapes, given = _hw(), _hw(0.5)
    assert shapes.efficiency is None and shapes.elementwise_bytes == cm.ELEMENTWISE_BYTES_PER_FLOP
    assert shapes.sm_count == 108 and shapes.gemm_fraction == 0.859 and shapes.gemm_tile == (256, 128)
    assert given.efficiency == 0.5 and given.elementwise_bytes is None
    l40s = cm.hardware_for(devices.get_kind("l40s"), 8, 50e9)
    assert l40s.gemm_fraction == devices.kinds.DEFAULT_GEMM_FRACTION and l40s.sm_count == 142
    with pytest.raises(ValueError, match="gemm_fraction"):
        devices.DeviceKind("x", "x", 1e12, 1e9, 1e9, 1e9, "test", gemm_fraction=1.5)


def test_a_gemm_by_hand():
    """An [8192, 8192] x [8192, 8192] product on an H100 SXM: tiles of 128 x 256 make 64 x 32 = 2,048 tiles,
    ceil(2048 / 132) = 16 waves of 2 x 128 x 256 x 8192 FLOPs per SM at 989.5e12 x 0.861 x 0.887 / 132 FLOP/s
    (the burst ceiling at the clock a GH100 holds under sustained load), plus one launch; the same product one row taller pays a 65th row of tiles (tile quantisation); a thin one (m = 16)
    has 32 tiles, k split 4 ways over the idle SMs, and is memory-bound: its bytes at 90% of 3.35 TB/s."""
    hw = cm.hardware_for(devices.get_kind("h100"), 8, 400e9)
    assert hw.gemm_tile == (128, 256) and hw.sm_count == 132
    assert hw.sustained_fraction == 0.887
    per_sm = 1979e12 / 2 * 0.861 * 0.887 / 132  # the datasheet's 1,979 with sparsity, halved
    big = cm.Gemm(8192, 8192, 8192, 1)
    expected = 16 * 2 * 128 * 256 * 8192 / per_sm + cm.GEMM_LAUNCH_SECONDS
    assert cm.gemm_seconds(big, hw) == pytest.approx(expected, rel=1e-12)
    taller = cm.Gemm(8193, 8192, 8192, 1)  # 65 x 32 = 2,080 tiles: still 16 waves (2,112 slots)
    assert cm.gemm_seconds(taller, hw) == pytest.approx(expected, rel=1e-12)
    much_taller = cm.Gemm(8192 + 128 * 3, 8192, 8192, 1)  # 67 x 32 = 2,144 tiles: a 17th wave
    assert cm.gemm_seconds(much_taller, hw) == pytest.approx(
        17 * 2 * 128 * 256 * 8192 / per_sm + cm.GEMM_LAUNCH_SECONDS, rel=1e-12
    )
    thin = cm.Gemm(16, 8192, 8192, 1)
    assert 2 * 128 * 256 * 8192 / 4 / per_sm < 2 * 8192 * 8192 / (3.35e12 * 0.9)  # split-K: memory-bound
    memory = 2 * (16 * 8192 + 8192 * 8192 + 16 * 8192) / (3.35e12 * 0.9)
    assert cm.gemm_seconds(thin, hw) == pytest.approx(memory + cm.GEMM_LAUNCH_SECONDS, rel=1e-12)


def test_the_sustained_fraction_slows_tensor_core_work_and_nothing_else():
    """An H100's products and fused attention run at 0.887 of their burst rate (what a GH100 holds under
    sustained load, measured: `sharding.devices.SUSTAINED_FRACTION`); its elementwise work, priced at the
    memory bandwidth, and its collectives do not change. A100 has no such measurement: its burst figures stand
    (fraction 1)."""
    h100 = devices.get_kind("h100")
    assert h100.sustained_fraction == devices.SUSTAINED_FRACTION["h100_sxm"][0] == 0.887
    assert "MSMF" in h100.efficiency_source and A100.sustained_fraction is None
    # burst and sustained from one run: their product is the measured sustained rate, MSMF 755.5 of 989.5
    assert h100.gemm_fraction * h100.sustained_fraction == pytest.approx(755.5 / 989.5, rel=1e-3)
    assert devices.get_kind("h100_pcie").sustained_fraction == 0.887  # the same die: an upper bound
    assert _hw().sustained_fraction == devices.kinds.DEFAULT_SUSTAINED_FRACTION == 1.0
    model = describe(get_config("test"))
    layout = cm.Layout({"data": 8}, "dp", 1, "none", attention="flash", dtype="bfloat16")
    cost = cm.estimate(model, 16, 64, layout)
    sustained = cm.hardware_for(h100, 8, 400e9)
    burst = dataclasses.replace(sustained, sustained_fraction=1.0)
    f = cost.flops
    elementwise = f.elementwise * 2 / (h100.memory_bandwidth * 0.9)
    tensor_sustained = cm.compute_seconds(cost, sustained) - elementwise
    tensor_burst = cm.compute_seconds(cost, burst) - elementwise
    launches = sum(g.count for g in cost.gemms) * cm.GEMM_LAUNCH_SECONDS
    big = cm.Gemm(8192, 8192, 8192, 1)  # compute-bound: scales by 1 / 0.887 exactly, but its launch
    assert cm.gemm_seconds(big, sustained) - cm.GEMM_LAUNCH_SECONDS == pytest.approx(
        (cm.gemm_seconds(big, burst) - cm.GEMM_LAUNCH_SECONDS) / 0.887, rel=1e-12
    )
    thin = cm.Gemm(16, 8192, 8192, 1)  # memory-bound either way: the clock does not move it
    assert cm.gemm_seconds(thin, sustained) == cm.gemm_seconds(thin, burst)
    assert tensor_sustained > tensor_burst
    assert tensor_sustained - launches <= (tensor_burst - launches) / 0.887 * (1 + 1e-9)
    flash = f.attention / (h100.peak_bf16_flops * 0.55 * 0.887)  # the fused kernel at the same clock
    products = sum(cm.gemm_seconds(g, sustained) * g.count for g in cost.gemms)
    assert tensor_sustained == pytest.approx(products + flash, rel=1e-12)
    links = cm.link_classes({"data": 8}, 8)
    a, b = cm.step_time(cost, sustained, links), cm.step_time(cost, burst, links)
    assert a.exposed_comm == b.exposed_comm and a.optimizer == b.optimizer


def test_compute_is_the_sum_of_its_products():
    """The step's compute from the shapes: its products one by one (`Cost.gemms`, which cover the weight
    products' FLOPs exactly), the flash kernel's FLOPs at the kind's attention fraction, the elementwise work at
    2 bytes a FLOP over 90% of the memory bandwidth."""
    model = describe(get_config("test"))
    layout = cm.Layout({"data": 8}, "dp", 1, "none", attention="flash", dtype="bfloat16")
    cost = cm.estimate(model, 16, 64, layout)
    f, hw = cost.flops, _hw()
    covered = sum(g.flops * g.count for g in cost.gemms)
    assert covered == pytest.approx(f.layers + f.logits)  # flash attention's products are the kernel's
    expected = (
        sum(cm.gemm_seconds(g, hw) * g.count for g in cost.gemms)
        + f.attention / (A100.peak_bf16_flops * 0.58)
        + f.elementwise * 2 / (A100.memory_bandwidth * 0.9)
    )
    links = cm.link_classes({"data": 8}, 8)
    assert cm.step_time(cost, hw, links).compute == pytest.approx(expected)
    assert cm.step_time(cost, _hw(0.5), links).compute == pytest.approx(f.total / (A100.peak_bf16_flops * 0.5))
    full = cm.estimate(model, 16, 64, dataclasses.replace(layout, remat="full", attention="reference"))
    assert sum(g.flops * g.count for g in full.gemms) == pytest.approx(full.flops.matmul)


def test_a_zero3_layer_gather_at_1536_ranks_by_hand():
    """FSDP/ZeRO-3 over 1,536 A100 (192 DGX hosts, 8 x 200 Gb/s each) gathers a 175B layer (1.81e9 bf16
    parameters, 3.6 GB) from pieces of 1/1,536 per rank (2.4 MB): one ring through the 8 ranks of each host,
    leaving each host once on its 8 NICs (200 GB/s), 1,535 steps of which 191 cross hosts."""
    hw = cm.hardware_for(A100, 8, 1600e9 / 8)
    layer = 1.81e9 * 2
    gather = cm.Comm("all-gather", ("fsdp",), 1536, layer, 1, "x")
    lat = cm.NCCL_LATENCY
    expected = lat["base"] + (1535 - 191) * lat["ring_nvlink"] + 191 * lat["ring_net"] + layer * 1535 / 1536 / 200e9
    assert cm.comm_seconds(gather, hw, {"fsdp": "inter"}, {"fsdp": 8}) == pytest.approx(expected, rel=1e-12)
    assert 0.018 < layer / 200e9 < 0.0182 and 0.0063 < expected - layer * 1535 / 1536 / 200e9 < 0.0065


def _priced(layout_flags, options, batch=64):
    """``python -m train.plan --layout`` on 8 H100 with the ``test`` model (4 layers), via its own parser."""
    model = describe(get_config("test"))
    inventory = devices.parse_cluster("h100:8")
    defaults = argparse.Namespace(dtype="bfloat16", attention="flash", batch=batch)
    layout, counts = given_layout(layout_flags, model.num_layers, 8, defaults)
    return planner.evaluate(model, inventory, batch, 64, layout, counts, options)


def test_megatron_clock_and_published_overlaps_from_train_plan_flags():
    """``--pipeline-clock fused`` prices interleaved 1F1B as Megatron-LM runs it, the slowest stage's busy time
    times ``1 + (S - 1) / (M v)``; ``--overlap-axes tensor`` moves the tensor all-reduces off the critical path
    (they hide behind the compute, with its contention)."""
    args = build_parser().parse_args(
        ["--cluster", "h100:8", "--batch", "64", "--seq-len", "64", "--pipeline-clock", "fused"]
        + ["--overlap-axes", "tensor"]
    )
    options = options_from(args)
    assert options.one_f_one_b_clock == "fused" and options.overlaps == ("tensor",)
    flags = "--mesh data=2,stage=2,tensor=2 --rules tp --microbatches 8 --pipeline-schedule 1f1b-fused"
    flags += " --pipeline-repeats 2"
    fused = _priced(flags, planner.PlanOptions(one_f_one_b_clock="fused"))
    busy = fused.step_time - fused.parts["optimizer"]
    assert fused.parts["bubble"] == pytest.approx(busy - busy / (1 + (2 - 1) / (8 * 2)))
    plain = _priced("--mesh data=4,tensor=2 --rules tp", planner.PlanOptions())
    hidden = _priced("--mesh data=4,tensor=2 --rules tp", planner.PlanOptions(overlaps=("tensor",)))
    assert plain.parts["exposed_comm"] > 0 and hidden.parts["exposed_comm"] < plain.parts["exposed_comm"]
    assert hidden.parts["overlapped_comm"] == pytest.approx(
        plain.parts["overlapped_comm"] + plain.parts["exposed_comm"] - hidden.parts["exposed_comm"]
    )


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "names no axis"),
        ("tensor,", "an empty item"),
        ("tensor,tensor", "tensor is named twice"),
        ("tensor,foo", "'foo' is not a mesh axis"),
    ],
)
def test_overlap_axes_refuses_an_empty_repeated_or_unknown_axis_and_its_example_is_accepted(text, says):
    with pytest.raises(ValueError, match=f"--overlap-axes .*{says}.*e.g. --overlap-axes tensor,data"):
        overlap_axes(text)
    assert overlap_axes("tensor,data") == ("tensor", "data")


def test_a_kept_memo_gives_the_same_step_time_to_the_bit():
    """The planner keeps each collective's and product shape's seconds per kind and mesh (`step_time`'s
    ``memo``): a stage's costs priced with one memo, in either order, equal the memo-free figures exactly
    (the search's ranking must not move by a rounding)."""
    model = describe(get_config("test"))
    mesh = {"data": 2, "stage": 2, "fsdp": 2, "tensor": 2}
    layout = cm.Layout(mesh, "fsdp_tp", 4, "none", attention="flash", dtype="bfloat16", stage_layers=(1, 1))
    costs = [
        cm.device_cost(model, layout, seq_len=64, rows=2.0, layers=1, slots=1),
        cm.device_cost(model, dataclasses.replace(layout, remat="full"), seq_len=64, rows=4.0, layers=1, slots=1),
    ]
    hw, links, shares = _hw(), cm.link_classes(mesh, 4), cm.host_shares(mesh, 4)
    plain = [cm.step_time(c, hw, links, shares) for c in costs]
    memo: dict = {}
    kept = [cm.step_time(c, hw, links, shares, memo=memo) for c in costs]
    again = [cm.step_time(c, hw, links, shares, memo=memo) for c in reversed(costs)][::-1]
    assert memo  # the memo holds the shapes' seconds
    assert any(c.count > 1 for c in costs[0].comms)
    for p, k, a in zip(plain, kept, again):
        assert dataclasses.asdict(p) == dataclasses.asdict(k) == dataclasses.asdict(a)
