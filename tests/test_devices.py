"""Tests of sharding/devices.py: the kind table, parsers, files, detection, simulation."""

import dataclasses
import json
import re
import sys
from types import SimpleNamespace

import jax
import pytest

from sharding import devices as dv

# --- The table ---------------------------------------------------------------------

REQUIRED_KINDS = (
    "h200_sxm",
    "h100_sxm",
    "h100_pcie",
    "a100_80gb",
    "a100_40gb",
    "l40s",
    "a10g",
    "v100_sxm2_32gb",
    "rtx4090",
)


def test_table_has_the_required_kinds():
    assert set(REQUIRED_KINDS) <= set(dv.KINDS)


@pytest.mark.parametrize("kind", list(dv.KINDS.values()), ids=lambda k: k.name)
def test_every_kind_has_positive_figures_and_a_cited_source(kind):
    for field in ("peak_bf16_flops", "memory_bytes", "memory_bandwidth", "intra_host_bandwidth"):
        value = getattr(kind, field)
        assert isinstance(value, float) and value > 0, (kind.name, field, value)
    assert kind.is_known
    assert re.search(r"https://\S+", kind.source), kind.source
    assert kind.label and kind.name == kind.name.lower()


@pytest.mark.parametrize("kind", list(dv.KINDS.values()), ids=lambda k: k.name)
def test_figures_are_in_plausible_ranges(kind):
    # Guards against unit slips (TFLOP/s vs FLOP/s, GB vs bytes, bits vs bytes).
    assert 50e12 <= kind.peak_bf16_flops <= 2e15
    assert 16e9 <= kind.memory_bytes <= 200e9
    assert 300e9 <= kind.memory_bandwidth <= 6e12
    assert 16e9 <= kind.intra_host_bandwidth <= 1e12
    # Memory bandwidth of every listed part exceeds its link to the peers.
    assert kind.memory_bandwidth > kind.intra_host_bandwidth


def test_memory_sizes_match_the_names_in_binary_gigabytes():
    # A datasheet's memory "GB" is binary (DRAM comes in powers of two): 80 GB = 80 GiB, as CUDA reports it.
    expected_gb = {
        "h200_sxm": 141,
        "h100_sxm": 80,
        "h100_pcie": 80,
        "a100_80gb": 80,
        "a100_40gb": 40,
        "a100_80gb_pcie": 80,
        "a100_40gb_pcie": 40,
        "l40s": 48,
        "a10g": 24,
        "v100_sxm2_32gb": 32,
        "rtx4090": 24,
    }
    assert set(expected_gb) == set(dv.KINDS)
    for name, gb in expected_gb.items():  # a datasheet's "80GB" of DRAM is 80 GiB
        assert dv.KINDS[name].memory_bytes == gb * 2**30, name
    for name, kind in dv.KINDS.items():
        size = re.search(r"(\d+)GB", kind.label)
        assert size and int(size.group(1)) * 2**30 == kind.memory_bytes, (name, kind.label)


def test_peak_orderings_between_generations():
    k = dv.KINDS
    assert k["h100_sxm"].peak_bf16_flops > k["h100_pcie"].peak_bf16_flops
    assert k["h100_pcie"].peak_bf16_flops > k["a100_80gb"].peak_bf16_flops
    assert k["a100_80gb"].peak_bf16_flops == k["a100_40gb"].peak_bf16_flops
    assert k["a100_80gb"].peak_bf16_flops > k["v100_sxm2_32gb"].peak_bf16_flops
    assert k["h200_sxm"].peak_bf16_flops == k["h100_sxm"].peak_bf16_flops
    assert k["h200_sxm"].memory_bandwidth > k["h100_sxm"].memory_bandwidth
    # NVLink parts beat PCIe parts on the intra-host link.
    assert k["a100_80gb"].intra_host_bandwidth > 4 * k["a100_80gb_pcie"].intra_host_bandwidth


def test_dense_peaks_and_unidirectional_links_match_the_datasheets():
    k = dv.KINDS
    assert k["h100_sxm"].peak_bf16_flops == pytest.approx(989.5e12)  # 1,979 sparse / 2
    assert k["a100_80gb"].peak_bf16_flops == 312e12
    assert k["h100_sxm"].intra_host_bandwidth == 450e9  # 900 GB/s bidirectional NVLink
    assert k["a100_80gb"].intra_host_bandwidth == 300e9  # 600 GB/s bidirectional
    assert k["l40s"].intra_host_bandwidth == 32e9  # PCIe Gen4 x16, 64 GB/s bidirectional


def test_device_kind_rejects_bad_figures():
    base = dv.KINDS["h100_sxm"]
    with pytest.raises(ValueError, match="memory_bytes must be a positive number"):
        dataclasses.replace(base, memory_bytes=0)
    with pytest.raises(ValueError, match="must not be empty"):
        dataclasses.replace(base, name="")


# --- Names and aliases ---------------------------------------------------------------


@pytest.mark.parametrize(
    "alias, canonical",
    [
        ("h200", "h200_sxm"),
        ("H100", "h100_sxm"),
        ("h100-sxm", "h100_sxm"),
        ("h100_pcie", "h100_pcie"),
        ("a100", "a100_80gb"),
        ("A100-40GB", "a100_40gb"),
        ("a100_40gb", "a100_40gb"),
        ("v100", "v100_sxm2_32gb"),
        ("L40S", "l40s"),
        ("a10g", "a10g"),
        ("4090", "rtx4090"),
        ("rtx4090", "rtx4090"),
        ("RTX-4090", "rtx4090"),
        (" a100-80GB-pcie ", "a100_80gb_pcie"),
    ],
)
def test_aliases(alias, canonical):
    assert dv.get_kind(alias) is dv.KINDS[canonical]


def test_every_alias_points_at_a_kind():
    assert set(dv.ALIASES.values()) <= set(dv.KINDS)


def test_unknown_kind_lists_known_names():
    with pytest.raises(ValueError) as info:
        dv.get_kind("tpu_v5e")
    message = str(info.value)
    assert "'tpu_v5e'" in message
    for name in ("h100_sxm", "a100_40gb", "4090", "v100"):
        assert name in message


# --- JAX device_kind strings -----------------------------------------------------------


@pytest.mark.parametrize(
    "device_kind, expected",
    [
        ("NVIDIA H100 80GB HBM3", "h100_sxm"),
        ("NVIDIA H100 PCIe", "h100_pcie"),
        ("NVIDIA H200", "h200_sxm"),
        ("NVIDIA A100-SXM4-80GB", "a100_80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100_40gb"),
        ("NVIDIA A100 80GB PCIe", "a100_80gb_pcie"),
        ("NVIDIA A100-PCIE-40GB", "a100_40gb_pcie"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA A10G", "a10g"),
        ("Tesla V100-SXM2-32GB", "v100_sxm2_32gb"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ],
)
def test_device_kind_strings(device_kind, expected):
    assert dv.kind_from_device_kind_string(device_kind) is dv.KINDS[expected]


@pytest.mark.parametrize(
    "device_kind",
    [
        "cpu",
        "",
        "TPU v5 lite",
        "NVIDIA H100 NVL",
        "NVIDIA H200 NVL",
        "NVIDIA A10",
        "NVIDIA L40",
        "Tesla V100-SXM2-16GB",
        "Tesla V100-PCIE-32GB",
        "NVIDIA GeForce RTX 4090 D",
        "NVIDIA GeForce RTX 3090",
    ],
)
def test_unknown_or_different_device_kind_strings_give_none(device_kind):
    assert dv.kind_from_device_kind_string(device_kind) is None


def test_peak_flops_of_devices():
    cpu = jax.devices()[0]
    assert dv.peak_flops(cpu) is None
    fake_h100 = SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3", id=0)
    assert dv.peak_flops(fake_h100) == dv.KINDS["h100_sxm"].peak_bf16_flops
    simulated = {cpu.id: dv.KINDS["a10g"]}
    assert dv.peak_flops(cpu, simulated) == 70e12


# --- Cluster specs -----------------------------------------------------------------------


def test_parse_cluster_one_host_per_item():
    inv = dv.parse_cluster("h100:8,a100:8")
    assert [(h.kind.name, h.count, h.name) for h in inv.hosts] == [
        ("h100_sxm", 8, "host0"),
        ("a100_80gb", 8, "host1"),
    ]
    assert inv.num_devices == 16 and inv.num_hosts == 2
    assert inv.inter_host_bandwidth == dv.DEFAULT_INTER_HOST_BANDWIDTH == 50e9
    assert inv.device_kinds() == (dv.KINDS["h100_sxm"],) * 8 + (dv.KINDS["a100_80gb"],) * 8
    assert inv.device_hosts() == (0,) * 8 + (1,) * 8
    assert inv.kinds_present == (dv.KINDS["h100_sxm"], dv.KINDS["a100_80gb"])
    assert not inv.is_homogeneous


def test_parse_cluster_repeat_and_bandwidth():
    inv = dv.parse_cluster(" H100:8x3 , 4090:2 @3200Gbps")
    assert [h.count for h in inv.hosts] == [8, 8, 8, 2]
    assert [h.name for h in inv.hosts] == ["host0", "host1", "host2", "host3"]
    assert inv.inter_host_bandwidth == 400e9
    assert dv.parse_cluster("a10g:4", inter_host_bandwidth=3e9).inter_host_bandwidth == 3e9


@pytest.mark.parametrize(
    "text, bytes_per_s",
    [
        ("400Gbps", 50e9),
        ("400Gb/s", 50e9),
        ("50GB/s", 50e9),
        ("50GBps", 50e9),
        ("3.2Tb/s", 400e9),
        ("100 Mbps", 12.5e6),
        ("1e2Gbps", 12.5e9),
        ("400gbps", 50e9),  # a lower-case prefix that means nothing else
        ("3.2tb/s", 400e9),
        ("50gB/s", 50e9),
    ],
)
def test_parse_bandwidth(text, bytes_per_s):
    assert dv.parse_bandwidth(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["400", "400 Gbit", "-5Gbps", "0GB/s", "fast", "400gbps/s", "400mbps"])
def test_parse_bandwidth_errors(text):
    with pytest.raises(ValueError, match="expected a positive number and a unit.*400Gbps"):
        dv.parse_bandwidth(text)


@pytest.mark.parametrize(
    "spec, fragments",
    [
        ("", ["empty cluster spec", "h100:8,a100:8"]),
        ("   ", ["empty cluster spec"]),
        ("h100:8,b200:8", ["item 'b200:8'", "unknown device kind 'b200'", "h100_sxm"]),
        ("h100:0", ["item 'h100:0'", "device count must be a positive integer", "'0'"]),
        ("h100:-2", ["device count", "'-2'"]),
        ("h100:eight", ["device count", "'eight'", "h100:8"]),
        ("h100:x", ["device count", "got 'x'", "h100:8"]),  # was "got ''": the count split at its x
        ("h100", ["item 'h100'", "expected KIND:COUNT", "h100:8,a100:8"]),
        ("h100:8,,a100:8", ["item ''", "expected KIND:COUNT"]),
        ("h100:8x0", ["host repeat must be a positive integer", "h100:8x2"]),
        ("h100:8x", ["host repeat must be a positive integer", "''"]),  # was read as h100:8
        ("h100:8@400", ["bad bandwidth '400'", "400Gbps"]),
        # one bandwidth per item: was "bad bandwidth '400Gbps,a100:8@100Gbps'"
        ("h100:8@400Gbps,a100:8@100Gbps", ["one @BANDWIDTH, at the end, for all hosts", "h100:8,a100:8@400Gbps"]),
        ("h100:8@400Gbps@100Gbps", ["one @BANDWIDTH", "cluster=h100:8@400Gbps"]),
        ("h100:8,a100:8@400mbps", ["bad bandwidth '400mbps'", "a prefix k, M, G or T"]),  # m is milli
    ],
)
def test_parse_cluster_errors(spec, fragments):
    with pytest.raises(ValueError) as info:
        dv.parse_cluster(spec)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_parse_cluster_rejects_two_bandwidths():
    with pytest.raises(ValueError, match="give one of them"):
        dv.parse_cluster("h100:8@400Gbps", inter_host_bandwidth=1e9)


def test_inventory_validation():
    host = dv.Host(dv.KINDS["l40s"], 4, "a")
    with pytest.raises(ValueError, match="at least one host"):
        dv.Inventory(hosts=())
    with pytest.raises(ValueError, match="duplicate host names: a"):
        dv.Inventory(hosts=(host, host))
    with pytest.raises(ValueError, match="inter_host_bandwidth must be a positive"):
        dv.Inventory(hosts=(host,), inter_host_bandwidth=0)
    with pytest.raises(ValueError, match="count must be a positive integer"):
        dv.Host(dv.KINDS["l40s"], 0, "b")
    assert dv.Inventory(hosts=[host]).hosts == (host,)


def test_describe_lists_hosts_and_totals():
    text = dv.parse_cluster("h100:8,a100-40gb:4").describe()
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["host", "kind", "devices"]
    assert lines[2].split()[:5] == ["host0", "h100_sxm", "8", "989.5", "80"]
    assert lines[3].split()[:5] == ["host1", "a100_40gb", "4", "312", "40"]
    total = (8 * 989.5 + 4 * 312) / 1000
    assert f"{total:.4g} PFLOP/s" in lines[-1]
    assert "2 host(s), 12 device(s)" in lines[-1] and "400 Gb/s" in lines[-1]


# --- Files -----------------------------------------------------------------------------


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_load_inventory_json(tmp_path):
    path = _write(
        tmp_path,
        "c.json",
        {
            "inter_host_bandwidth_gbps": 400,
            "hosts": [{"kind": "h100", "count": 8}, {"kind": "a100", "count": 8, "name": "node-b"}],
        },
    )
    inv = dv.load_inventory(path)
    assert [(h.kind, h.count, h.name) for h in inv.hosts] == [
        (dv.KINDS["h100_sxm"], 8, "host0"),
        (dv.KINDS["a100_80gb"], 8, "node-b"),
    ]
    assert inv.inter_host_bandwidth == 50e9


def test_load_inventory_overrides_new_kinds_and_repeat(tmp_path):
    path = _write(
        tmp_path,
        "c.json",
        {
            "inter_host_bandwidth": "1.6Tbps",
            "kinds": {
                "A100": {"memory_bandwidth": 1.9e12},
                "mi300x": {"label": "AMD MI300X", "peak_bf16_flops": 1.3e15, "memory_bytes": 192e9},
            },
            "hosts": [
                {"kind": "a100", "count": 8},
                {"kind": "mi300x", "count": 8, "name": "amd", "repeat": 2},
            ],
        },
    )
    inv = dv.load_inventory(path)
    a100, mi300x = inv.kinds_present
    assert a100 == dataclasses.replace(dv.KINDS["a100_80gb"], memory_bandwidth=1.9e12)
    assert mi300x.name == "mi300x" and mi300x.peak_bf16_flops == 1.3e15
    assert mi300x.memory_bandwidth is None and not mi300x.is_known
    assert str(path) in mi300x.source
    assert [h.name for h in inv.hosts] == ["host0", "amd-0", "amd-1"]
    assert inv.inter_host_bandwidth == 200e9


@pytest.mark.parametrize(
    "content, fragments",
    [
        ("{not json", ["not valid JSON"]),
        ([1, 2], ["expected an object at the top"]),
        ({"hosts": []}, ["hosts: expected a non-empty list"]),
        ({"hosts": [{"kind": "h100", "count": 8}], "host": 1}, ["unknown field(s) 'host'"]),
        ({"hosts": [{"kind": "h1000", "count": 8}]}, ["hosts[0].kind", "unknown device kind 'h1000'", "h100_sxm"]),
        ({"hosts": [{"kind": "h100", "count": 0}]}, ["hosts[0].count", "positive integer", "0"]),
        ({"hosts": [{"kind": "h100", "count": "8"}]}, ["hosts[0].count", "'8'"]),
        ({"hosts": [{"kind": "h100"}]}, ["hosts[0].count", "None"]),
        ({"hosts": [{"kind": "h100", "count": 8, "cnt": 2}]}, ["hosts[0]", "'cnt'"]),
        (
            {"hosts": [{"kind": "h100", "count": 8, "name": "a"}, {"kind": "h100", "count": 8, "name": "a"}]},
            ["duplicate host names: a"],
        ),
        (
            {"hosts": [{"kind": "h100", "count": 8}], "inter_host_bandwidth_gbps": -1},
            ["inter_host_bandwidth_gbps", "-1"],
        ),
        (
            {"hosts": [{"kind": "h100", "count": 8}], "inter_host_bandwidth": "400"},
            ["inter_host_bandwidth", "bad bandwidth '400'"],
        ),
        (
            {"hosts": [{"kind": "h100", "count": 8}], "kinds": {"h100": {"memory_bytes": -1}}},
            ["kinds.h100.memory_bytes", "positive number"],
        ),
        ({"hosts": [{"kind": "h100", "count": 8}], "kinds": {"h100": {"flops": 1}}}, ["kinds.h100", "'flops'"]),
    ],
)
def test_load_inventory_errors_name_file_and_field(tmp_path, content, fragments):
    path = _write(tmp_path, "bad.json", content)
    with pytest.raises(ValueError) as info:
        dv.load_inventory(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_load_inventory_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        dv.load_inventory(tmp_path / "nope.json")


def test_json_round_trip(tmp_path):
    inv = dv.Inventory(
        hosts=(
            dv.Host(dv.KINDS["h200_sxm"], 8, "a"),
            dv.Host(dataclasses.replace(dv.KINDS["l40s"], memory_bytes=47.5e9), 4, "b"),
            dv.Host(dv.detect_inventory().hosts[0].kind, 8, "c"),  # unknown "cpu" kind
        ),
        inter_host_bandwidth=123e9,
    )
    path = tmp_path / "inv.json"
    dv.save_inventory(inv, path)
    assert dv.load_inventory(path) == inv
    assert json.loads(path.read_text())["kinds"]["l40s"] == {"memory_bytes": 47.5e9}
    assert dv.inventory_from_flag(str(path)) == inv


def test_to_dict_rejects_two_kinds_with_one_name():
    inv = dv.Inventory(
        hosts=(
            dv.Host(dv.KINDS["a10g"], 1, "a"),
            dv.Host(dataclasses.replace(dv.KINDS["a10g"], memory_bytes=20e9), 1, "b"),
        )
    )
    with pytest.raises(ValueError, match="two different kinds named 'a10g'"):
        dv.inventory_to_dict(inv)


def test_load_inventory_yaml(tmp_path):
    pytest.importorskip("yaml")
    path = _write(
        tmp_path,
        "c.yaml",
        (
            "inter_host_bandwidth_gbps: 200\n"
            "hosts:\n"
            "  - {kind: l40s, count: 4}\n"
            "  - kind: 4090\n"
            "    count: 2\n"
            "    name: desk\n"
        ),
    )
    inv = dv.load_inventory(path)
    assert [(h.kind.name, h.count, h.name) for h in inv.hosts] == [
        ("l40s", 4, "host0"),
        ("rtx4090", 2, "desk"),
    ]
    assert inv.inter_host_bandwidth == 25e9


def test_bad_yaml_is_one_line_with_its_place(tmp_path):
    """pyyaml's message spans four lines with a caret under the spot; the error is one line naming the file, the
    line and column, the problem and a file that loads."""
    pytest.importorskip("yaml")
    path = _write(tmp_path, "c.yaml", "hosts: [\n")
    with pytest.raises(ValueError) as info:
        dv.load_inventory(path)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(f"{path}: not valid YAML at line 2, column 1: expected the node content"), message
    example = message.split("; e.g. ", 1)[1]
    assert dv.load_inventory(_write(tmp_path, "ok.yaml", example)).num_devices == 8


def test_yaml_without_pyyaml_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes `import yaml` fail
    path = _write(tmp_path, "c.yml", "hosts: []\n")
    with pytest.raises(ImportError, match=r"c\.yml.*JSON.*pip install pyyaml"):
        dv.load_inventory(path)


def test_inventory_from_flag(tmp_path):
    assert dv.inventory_from_flag("h100:4,a100:4") == dv.parse_cluster("h100:4,a100:4")
    path = _write(tmp_path, "c.json", {"hosts": [{"kind": "v100", "count": 8}]})
    assert dv.inventory_from_flag(str(path)).hosts[0].kind is dv.KINDS["v100_sxm2_32gb"]
    with pytest.raises(FileNotFoundError, match="missing.json"):
        dv.inventory_from_flag(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="unknown device kind"):
        dv.inventory_from_flag("b200:8")


def test_a_binary_cluster_file_names_the_field_and_the_file(tmp_path):
    from sharding.errors import ConfigError

    path = tmp_path / "binary.bin"
    path.write_bytes(bytes([0xD0, 0x80, 0xFF]) * 10)
    with pytest.raises(ConfigError) as e:
        dv.inventory_from_flag(str(path))
    assert [p.name for p in e.value.parts if hasattr(p, "name")] == ["cluster"]
    assert str(e.value).startswith(f"cluster={path}: not a text file (byte 2 is 0xff, not UTF-8)")


# --- Detection and simulation -------------------------------------------------------------


def test_detect_on_cpu_gives_one_host_of_eight_unknown_devices():
    inv = dv.detect_inventory()
    assert inv.num_hosts == 1 and inv.num_devices == 8 == len(jax.devices())
    (host,) = inv.hosts
    assert host.name == "process0"
    assert host.kind.name == "cpu" and host.kind.peak_bf16_flops is None
    assert not host.kind.is_known and "not in the table" in host.kind.source
    assert "?" in inv.describe()


def _fake(i, kind, process=0, limit=None):
    stats = None if limit is None else {"bytes_limit": limit, "bytes_in_use": 0}
    return SimpleNamespace(id=i, device_kind=kind, process_index=process, memory_stats=lambda: stats)


def test_detect_groups_by_process_and_uses_bytes_limit():
    devices = [_fake(i, "NVIDIA H100 80GB HBM3", 0, 79e9 + i) for i in range(4)]
    devices += [_fake(4 + i, "NVIDIA A100-SXM4-40GB", 1) for i in range(4)]
    inv = dv.detect_inventory(devices, inter_host_bandwidth=25e9)
    assert [(h.name, h.count) for h in inv.hosts] == [("process0", 4), ("process1", 4)]
    h100, a100 = inv.kinds_present
    assert h100 == dataclasses.replace(dv.KINDS["h100_sxm"], memory_bytes=79e9)  # smallest
    assert a100 is dv.KINDS["a100_40gb"]
    assert inv.inter_host_bandwidth == 25e9


def test_detect_splits_a_process_with_two_kinds():
    devices = [_fake(0, "NVIDIA GeForce RTX 4090"), _fake(1, "NVIDIA GeForce RTX 3090")]
    inv = dv.detect_inventory(devices)
    assert [h.name for h in inv.hosts] == ["process0-rtx4090", "process0-nvidia_geforce_rtx_3090"]
    assert inv.hosts[1].kind.label == "NVIDIA GeForce RTX 3090"


def test_detect_tolerates_memory_stats_errors():
    def broken():
        raise RuntimeError("no stats")

    device = SimpleNamespace(id=0, device_kind="NVIDIA L40S", process_index=0, memory_stats=broken)
    assert dv.detect_inventory([device]).hosts[0].kind is dv.KINDS["l40s"]
    with pytest.raises(ValueError, match="no devices"):
        dv.detect_inventory([])


def test_simulate_assigns_kinds_in_device_order():
    devices = jax.devices()
    inv, kinds = dv.simulate_inventory("h100:4,a100:4", devices)
    assert [(h.kind.name, h.count) for h in inv.hosts] == [("h100_sxm", 4), ("a100_80gb", 4)]
    assert [kinds[d.id].name for d in devices] == ["h100_sxm"] * 4 + ["a100_80gb"] * 4
    assert dv.peak_flops(devices[5], kinds) == 312e12
    inv3, _ = dv.simulate_inventory("l40s:2x2,v100:4@100Gbps", devices)
    assert inv3.num_hosts == 3 and inv3.inter_host_bandwidth == 12.5e9


@pytest.mark.parametrize("spec, total", [("h100:4,a100:2", 6), ("h100:8,a100:8", 16)])
def test_simulate_requires_counts_to_sum_to_devices(spec, total):
    with pytest.raises(ValueError) as info:
        dv.simulate_inventory(spec, jax.devices())
    message = str(info.value)
    assert f"= {total} devices" in message and "8 devices to assign" in message


def test_module_import_calls_no_jax():
    source = open(dv.__file__, encoding="utf-8").read()
    top_level = [line for line in source.splitlines() if line.startswith(("import", "from"))]
    assert not any("jax" in line for line in top_level), top_level
