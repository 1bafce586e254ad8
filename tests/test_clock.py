"""The cost model's clock: collectives as NCCL runs them, FSDP gathers in the compute dtype, and the fitted
efficiency per device kind. No devices and no compiles: the clock prices descriptions."""

import math

import pytest

from models.config import get_config
from models.spec import describe
from sharding import costmodel as cm
from sharding import devices

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


def test_fitted_efficiency_is_data_with_its_source():
    """A100 and H100 carry the efficiency fitted on published runs (bench/published.py), with the runs named;
    the clock then prices products at it and elementwise work at the memory bandwidth. ``--efficiency`` (an
    explicit figure) and kinds without a fit keep one efficiency for all the step's work."""
    for name in ("a100_80gb", "h100_sxm"):
        kind = devices.get_kind(name)
        value, source = devices.FITTED_EFFICIENCY[name]
        assert kind.matmul_efficiency == value and kind.efficiency_source == source and "bench/published.py" in source
    fitted, given = _hw(), _hw(0.5)
    assert fitted.efficiency == A100.matmul_efficiency and fitted.elementwise_bytes == cm.ELEMENTWISE_BYTES_PER_FLOP
    assert given.efficiency == 0.5 and given.elementwise_bytes is None
    unfitted = cm.hardware_for(devices.get_kind("l40s"), 8, 50e9)
    assert unfitted.efficiency == cm.DEFAULT_EFFICIENCY and unfitted.elementwise_bytes is None
    model = describe(get_config("test"))
    cost = cm.estimate(model, 16, 64, cm.Layout({"data": 8}, "dp", 1, "none", attention="flash", dtype="bfloat16"))
    links = cm.link_classes({"data": 8}, 8)
    f = cost.flops
    assert cm.step_time(cost, fitted, links).compute == pytest.approx(
        (f.matmul + f.optimizer) / (A100.peak_bf16_flops * fitted.efficiency)
        + f.elementwise * cm.ELEMENTWISE_BYTES_PER_FLOP / A100.memory_bandwidth
    )
    assert cm.step_time(cost, given, links).compute == pytest.approx(f.total / (A100.peak_bf16_flops * 0.5))
    with pytest.raises(ValueError, match="matmul_efficiency"):
        devices.DeviceKind("x", "x", 1e12, 1e9, 1e9, 1e9, "test", matmul_efficiency=1.5)
