"""The planner on clusters of thousands of devices: kinds read per mesh position from the grouped cluster
(no device objects), the host table one line per run of hosts, and the grouped search against brute force.

No devices are needed; no wall-clock bounds are asserted (the machine is shared); the planning times are
benchmark figures (bench/RESULTS.md).
"""

import numpy as np
import pytest

from models.config import ModelConfig
from models.spec import describe
from sharding import devices, planner
from sharding.mesh import device_grid
from sharding.planner.evaluator import PlanOptions, _Evaluator
from sharding.planner.search import _meshes


def _kind(name, tflops, memory_gb):
    return devices.DeviceKind(name, name, tflops * 1e12, memory_gb * 1e9, 2e12, 300e9, "test figures")


FAST, SLOW = _kind("fast", 200, 80), _kind("slow", 100, 48)
MODEL = describe(ModelConfig(32000, 8, 1024, 4096, 16, 16, 64))


def _cluster(*runs, network=25e9):
    """Hosts from ``(kind, hosts, per_host)`` runs, in device order."""
    hosts = [
        devices.Host(kind, per, f"h{len(runs)}-{r}-{i}") for r, (kind, n, per) in enumerate(runs) for i in range(n)
    ]
    return devices.Inventory(tuple(hosts), network)


class _Device:
    def __init__(self, index, host):
        self.id, self.process_index = index, host


def test_kind_grid_matches_device_grid_on_interleaved_hosts():
    """The evaluator's kind grid is `device_grid`'s placement read through each device's kind, on hosts of
    two kinds in three runs (so a data-parallel group or a stage may cross kinds)."""
    inventory = _cluster((FAST, 2, 4), (SLOW, 3, 4), (FAST, 1, 4))
    ev = _Evaluator(MODEL, inventory, 48, 128, PlanOptions())
    kinds = inventory.device_kinds()
    hosts = inventory.device_hosts()
    checked = 0
    for mesh in _meshes(ev.model, ev.cluster, ev.options):
        grid = device_grid(mesh, [_Device(i, h) for i, h in enumerate(hosts)])
        expected = np.vectorize(lambda d: ev.cluster.kinds.index(kinds[d.id]))(grid)
        np.testing.assert_array_equal(ev.grid(mesh), expected)
        slowest = [
            min((kinds[d.id] for d in grid[i, :, j].reshape(-1)), key=lambda k: k.peak_bf16_flops)
            for i in range(mesh["data"])
            for j in range(mesh["fsdp"])
        ]
        assert [k.name for k in ev.batch_kinds(mesh)] == [k.name for k in slowest]
        stage_sets = [sorted({kinds[d.id].name for d in grid[:, s].reshape(-1)}) for s in range(mesh["stage"])]
        assert [[k.name for k in ks] for ks in ev.stage_kind_sets(mesh)] == stage_sets
        checked += 1
    assert checked > 20


def test_host_table_is_one_line_per_run_of_hosts():
    inventory = devices.parse_cluster("h100:8x2048")
    lines = inventory.describe().splitlines()
    assert len(lines) == 4, lines
    assert lines[2].split()[:3] == ["host0..host2047", "h100_sxm", "2048x8"]
    assert "2048 host(s), 16384 device(s)" in lines[-1]
    mixed = devices.parse_cluster("h100:8x3,a100:8x2,h100:8").describe().splitlines()
    assert [line.split()[:3] for line in mixed[2:5]] == [
        ["host0..host2", "h100_sxm", "3x8"],
        ["host3..host4", "a100_80gb", "2x8"],
        ["host5", "h100_sxm", "8"],
    ]


def test_thousands_of_hosts_of_two_kinds_plan_with_counts_per_kind():
    """512 + 512 hosts of 8 (8,192 devices), built in memory: the search runs on kinds (every data-parallel
    group of a kind gets one count) and returns a fitting plan."""
    inventory = _cluster((FAST, 512, 8), (SLOW, 512, 8), network=400e9)
    options = PlanOptions(
        attentions=("flash",), remats=("none",), pipeline=False, rules=("fsdp", "dp"), max_microbatches=4
    )
    plans = planner.plan(MODEL, inventory, 8192 * 8, 2048, options, top=3)
    assert plans and plans[0].fits
    best = plans[0]
    assert best.counts is not None, best.key()  # the fast kind is twice the slow: uneven shares win
    ev = _Evaluator(MODEL, inventory, 8192 * 8, 2048, options)
    names = [k.name for k in ev.batch_kinds(best.layout.mesh)]
    per_kind = {n: {c for c, m in zip(best.counts, names) if m == n} for n in set(names)}
    assert all(max(v) - min(v) <= 1 for v in per_kind.values()), per_kind
    assert min(per_kind["fast"]) > max(per_kind["slow"])
    assert sum(best.counts) == best.layout.batch_split * best.layout.microbatches


def test_sixteen_thousand_devices_of_one_kind_plan_with_pipelines():
    """2,048 hosts of 8 (16,384 devices) of one kind: pipelines searched (up to 4 stages here), a fitting plan."""
    inventory = _cluster((FAST, 2048, 8))
    options = PlanOptions(attentions=("flash",), remats=("none", "full"), max_stages=4)
    plans = planner.plan(MODEL, inventory, 16384 * 2, 512, options, top=3)
    assert plans and all(p.fits for p in plans)
    assert len({p.key() for p in plans}) == 3


@pytest.mark.parametrize("network", [25e9, 1e9])
def test_grouped_search_matches_brute_force_on_runs_of_hosts(network):
    """Four hosts of each kind (two per run, three runs): the search's best within 5% of brute force over
    every mesh, count per kind and stage split."""
    inventory = _cluster((FAST, 2, 2), (SLOW, 4, 2), (FAST, 2, 2), network=network)
    options = PlanOptions(
        attentions=("flash",), remats=("none", "full"), max_microbatches=4, max_stages=4, schedules=("gpipe",)
    )
    plans = planner.plan(MODEL, inventory, 64, 1024, options)
    best = planner.brute_force(MODEL, inventory, 64, 1024, options)
    assert best is not None and plans and plans[0].fits
    assert plans[0].step_time <= 1.05 * best.step_time, (plans[0].key(), best.key())
