"""``python -m train.plan --layout`` and ``--json``: a given layout priced as the search prices it.

No devices are needed: the planner prices layouts with the cost model.
"""

import json

import pytest

from train.plan import main as plan_main

# Small enough to search in about a second: the test preset on 8 devices of two kinds.
SEARCH = ["--model", "test", "--batch", "32", "--seq-len", "128", "--top", "8"]


def _json(capsys, argv):
    assert plan_main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "cluster, extra", [("h100:4,a100:4", []), ("a100:4x2", []), ("h100:2x2,a100:2x2", ["--no-pipeline"])]
)
def test_a_given_layout_is_priced_as_the_search_priced_it(capsys, cluster, extra):
    """Every plan the search lists, given back as ``--layout`` (its own flags), gets the same step time,
    memory and fit (uneven counts and pipelines included)."""
    found = _json(capsys, SEARCH + ["--cluster", cluster] + extra)
    assert found["plans"] and found["step_seconds"] == found["plans"][0]["step_seconds"]
    assert extra == [] or any(p["counts"] for p in found["plans"])  # uneven counts are given back too
    for plan in found["plans"]:
        again = _json(capsys, SEARCH + ["--cluster", cluster, "--layout", plan["flags"]])
        assert again["step_seconds"] == pytest.approx(plan["step_seconds"], rel=1e-12), plan["flags"]
        assert again["memory_gb"] == pytest.approx(plan["memory_gb"], rel=1e-12)
        assert again["fits"] == plan["fits"] and again["flags"] == plan["flags"]


def test_pipeline_layout_prints_its_breakdown(capsys):
    argv = SEARCH + [
        "--cluster",
        "a100:4x2",
        "--layout",
        "--mesh data=2,stage=2,tensor=2 --rules tp --microbatches 4 --pipeline-schedule 1f1b --remat full",
    ]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    for part in (
        "compute",
        "exposed traffic",
        "pipeline bubble",
        "memory per device",
        "a100_80gb",
        "fits",
        "--stage-layers 2,2 --pipeline-schedule 1f1b",
    ):
        assert part in out


def test_json_fields_are_present_and_typed(capsys):
    for extra in ([], ["--layout", "--mesh fsdp=8 --rules fsdp --microbatches 2"]):
        out = _json(capsys, SEARCH + ["--cluster", "h100:4,a100:4"] + extra)
        assert isinstance(out["step_seconds"], float) and out["step_seconds"] > 0
        assert isinstance(out["tokens_per_second"], float) and out["tokens_per_second"] > 0
        assert isinstance(out["mfu"], float) and 0 < out["mfu"] < 1
        assert set(out["memory_gb"]) == {"h100_sxm", "a100_80gb"}
        assert all(isinstance(v, float) for v in out["memory_gb"].values())
        assert isinstance(out["fits"], bool) and isinstance(out["flags"], str) and out["flags"].startswith("--mesh")
        assert ("plans" in out) == (not extra)
    assert out["flags"].startswith("--mesh fsdp=8 --rules fsdp --microbatches 2")


@pytest.mark.parametrize(
    "layout, names",
    [
        ("--mesh data=3", "--mesh 'data=3': the sizes multiply to 3 but the cluster has 8 devices"),  # not JAX's
        ("--mesh fsdp=8 --rulez tp", "--rulez"),
        ("--mesh fsdp=8 --steps 3", "--steps is not a layout flag; leave --steps out ("),  # train.plan has none
        ("--mesh fsdp=8 --lora-rank 8", "leave --lora-rank out ("),  # was: give it to train.plan, which refused it
        ("--mesh fsdp=8 --seq-len 64", "give --seq-len to train.plan itself ("),
        ("--mesh fsdp=8 --hetero-batch auto", "--hetero-batch"),
        ("--mesh fsdp=8 --microbatches 'unclosed", "--layout"),
        # the pipeline's microbatches, checked as train.train checks them: the value named splits --batch 32
        (
            "--mesh stage=2,fsdp=4 --pipeline-schedule 1f1b --pipeline-repeats 2 --microbatches 3",
            "needs a multiple of the 2 stages; use --microbatches 2",
        ),
        ("--mesh stage=4,fsdp=2 --microbatches 2", "fewer microbatches than the 4 pipeline stages"),
    ],
)
def test_a_bad_layout_is_one_line_naming_it_and_exits_2(capsys, layout, names):
    assert plan_main(SEARCH + ["--cluster", "h100:4,a100:4", "--layout", layout]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --layout") and names in lines[0], captured.err


def test_a_homogeneous_cluster_is_searched_once(capsys, monkeypatch):
    """One kind: no second search for the "same work on every device" baseline (it would print 1.00x)."""
    from sharding import planner

    def refuse(*args, **kwargs):
        raise AssertionError("uniform_baseline searched a homogeneous cluster again")

    monkeypatch.setattr(planner, "uniform_baseline", refuse)
    assert plan_main(SEARCH + ["--cluster", "a100:4x2"]) == 0
    out = capsys.readouterr().out
    assert "chosen plan:" in out and "same work on every device" not in out and "1.00x" not in out


@pytest.mark.parametrize(
    "model, layout, remedy",
    [
        # moe-test's first layer is dense: train.train refuses such pipeline stages (train.setup.checks.check_experts)
        (
            ["--model", "moe-test"],
            "--mesh stage=2,fsdp=4 --microbatches 2",
            "--set first_dense_layers=0 --set moe_every=1",
        ),
        (["--model", "test"], "--mesh stage=2,fsdp=4 --microbatches 2 --stage-layers auto", "--stage-layers 2,2"),
        # an expert axis on a dense model, or one the experts do not divide: train.train refuses both
        (["--model", "test"], "--mesh expert=4,fsdp=2", "--mesh data=4,fsdp=2"),
        (["--model", "moe-test", "--set", "num_experts=6"], "--mesh expert=4,fsdp=2", "--mesh fsdp=4,expert=2"),
    ],
)
def test_a_layout_train_train_would_refuse_is_refused_with_a_remedy_that_prices(capsys, model, layout, remedy):
    """A MoE pipeline with a dense layer was priced and printed as flags that train.train then refused; the
    remedy of --stage-layers auto was the 7B's 10,10,6,6, which the 4-layer model refuses."""
    argv = SEARCH + model + ["--cluster", "h100:4,a100:4"]
    assert plan_main(argv + ["--layout", layout]) == 2
    err = capsys.readouterr().err
    assert f"e.g. {remedy}," in err or err.rstrip().endswith(f"e.g. {remedy}"), err
    if remedy.startswith("--set"):
        argv, fixed = argv + remedy.split(), layout
    elif remedy.startswith("--mesh"):
        fixed = remedy
    else:
        fixed = layout.replace("--stage-layers auto", remedy)
    assert _json(capsys, argv + ["--layout", fixed])["fits"]


@pytest.mark.parametrize(
    "model, overrides, mesh",
    [("test", [], "fsdp=2,expert=4"), ("moe-test", ["num_experts=6"], "fsdp=2,expert=4")],
)
def test_an_expert_axis_is_refused_by_train_plan_in_train_train_s_words(capsys, model, overrides, mesh):
    """train.plan --layout kept a second copy of train.train's expert-axis check, with its own wording and
    remedy for a dense model; both now make the one check (`train.setup.checks.check_expert_axis`)."""
    from models.config import get_config
    from sharding.mesh import parse_mesh
    from sharding.parallel import Parallelism
    from sharding.rules import get_rules
    from train.setup.checks import check_experts

    sets = [part for o in overrides for part in ("--set", o)]
    assert (
        plan_main(SEARCH + ["--model", model, *sets, "--cluster", "h100:4,a100:4", "--layout", f"--mesh {mesh}"]) == 2
    )
    with pytest.raises(ValueError) as refused:
        check_experts(get_config(model, overrides), Parallelism(parse_mesh(mesh, 8), get_rules("fsdp")))
    assert capsys.readouterr().err.strip() == f"error: --layout: {refused.value}"
    par = Parallelism(parse_mesh(mesh, 8), get_rules("fsdp"))
    if model == "test":  # the models it names are accepted on this mesh
        assert "(--model moe-test, or --set num_experts=4)" in str(refused.value)
        check_experts(get_config("moe-test"), par)
        check_experts(get_config("test", ["num_experts=4"]), par)


def test_a_kind_without_figures_is_named_with_the_figures_it_lacks(tmp_path, capsys):
    """The planner said a kind's figures 'are unknown; ... give them in a cluster file' to a cluster file that
    gave some of them; it names the ones missing and where they go."""
    cluster = tmp_path / "cluster.json"
    kind = '{"label": "AMD MI300X", "peak_bf16_flops": 1.3e15, "memory_bytes": 192e9}'
    cluster.write_text(
        '{"hosts": [{"kind": "h100", "count": 4}, {"kind": "mi300x", "count": 4}], "kinds": {"mi300x": ' + kind + "}}"
    )
    assert plan_main(SEARCH + ["--cluster", str(cluster)]) == 2
    err = capsys.readouterr().err
    assert "device kind 'mi300x' lacks memory_bandwidth, intra_host_bandwidth; " in err, err
    assert '"kinds": {"mi300x": {"memory_bandwidth": ...}}' in err, err
    cluster.write_text(
        cluster.read_text().replace("192e9", '192e9, "memory_bandwidth": 5.3e12, "intra_host_bandwidth": 64e9')
    )
    assert plan_main(SEARCH + ["--cluster", str(cluster)]) == 0


def test_a_plot_format_matplotlib_cannot_write_is_refused_before_the_search(tmp_path, capsys, monkeypatch):
    """--plot plan.txt searched, printed every plan, then ended in matplotlib's own error naming no flag."""
    pytest.importorskip("matplotlib")
    from train import plan as plan_module

    monkeypatch.setattr(plan_module, "report", lambda *a: pytest.fail("searched before refusing the plot"))
    assert plan_main(SEARCH + ["--cluster", "h100:4,a100:4", "--plot", str(tmp_path / "plan.txt")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        captured.err
        == f"error: --plot {tmp_path}/plan.txt: matplotlib does not write .txt files; e.g. --plot {tmp_path}/plan.png\n"
    )


def test_a_binary_cluster_file_is_one_line_naming_the_flag_and_file(tmp_path, capsys):
    path = tmp_path / "binary.bin"
    path.write_bytes(bytes([0xD0, 0xFF]) * 50)
    assert plan_main(["--cluster", str(path), "--batch", "16", "--seq-len", "128", "--model", "test"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --cluster {path}: not a text file (byte 0 is 0xd0")


@pytest.mark.parametrize(
    "layout, names, fixed",
    [
        # no flags: was priced as train.train's default layout, silently
        ("", "--layout '': gives no layout flags; e.g. --layout \"--mesh fsdp=8\"", "--mesh fsdp=8"),
        ("   ", 'gives no layout flags; e.g. --layout "--mesh fsdp=8"', "--mesh fsdp=8"),
        # counts below 1, named by their flags as train.train names them (was the cost model's field names)
        (
            "--mesh fsdp=8 --microbatches 0",
            "--layout: --microbatches 0: must be a positive integer, e.g. --microbatches 1",
            "--mesh fsdp=8 --microbatches 1",
        ),
        (  # circular needs 2 chunks or more: the example is the schedule's own default
            "--mesh stage=2,fsdp=4 --pipeline-schedule circular --pipeline-repeats 0 --microbatches 2",
            "--layout: --pipeline-repeats 0: must be a positive integer, e.g. --pipeline-repeats 2",
            "--mesh stage=2,fsdp=4 --pipeline-schedule circular --pipeline-repeats 2 --microbatches 2",
        ),
    ],
)
def test_an_empty_layout_or_a_zero_count_is_refused_with_a_layout_that_prices(capsys, layout, names, fixed):
    argv = SEARCH + ["--cluster", "h100:4,a100:4"]
    assert plan_main(argv + ["--layout", layout]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and names in err, err
    assert _json(capsys, argv + ["--layout", fixed])["fits"]


@pytest.mark.parametrize(
    "cluster, names, fixed",
    [
        # one bandwidth per item was read as the first item's bandwidth "400Gbps,a100:4@100Gbps"
        (
            "h100:4@400Gbps,a100:4@100Gbps",
            "error: --cluster 'h100:4@400Gbps,a100:4@100Gbps': the spec takes one @BANDWIDTH, at the end, for all "
            "hosts (not one per item); e.g. --cluster h100:4,a100:4@400Gbps\n",
            "h100:4,a100:4@400Gbps",
        ),
        # a missing file named neither the flag nor the inline form
        (
            "cluster.yaml",
            "error: --cluster cluster.yaml: no such inventory file; give an existing JSON/YAML file, or the "
            "cluster inline, e.g. --cluster h100:8\n",
            "h100:8",
        ),
    ],
)
def test_a_bad_cluster_is_one_line_naming_the_flag_with_a_spec_that_plans(
    tmp_path, monkeypatch, capsys, cluster, names, fixed
):
    monkeypatch.chdir(tmp_path)  # no cluster.yaml here
    assert plan_main(SEARCH + ["--cluster", cluster]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == names
    assert _json(capsys, SEARCH + ["--cluster", fixed])["plans"]


def test_help_shows_real_defaults_only():
    """``(default: None)`` was printed after required flags and after help that states its default in words."""
    from train.plan import build_parser

    text = " ".join(build_parser().format_help().split())  # argparse wraps at the terminal's width
    assert "(default: None)" not in text
    assert "plans to list (default: 8)" in text and "model preset (models.config) (default: 7b)" in text
    assert "how a 1F1B pipeline" in text and "(default: lockstep)" in text


def test_the_help_layout_example_prices_on_the_help_cluster(capsys):
    """``--help``'s ``--layout`` example named a 64-device mesh (data=2,stage=4,tensor=8) while its cluster
    example has 16 devices, so copying both was refused. The example command ``--help`` prints runs as printed,
    and the flag's own help names the layout and the cluster of that command."""
    import re
    import shlex

    from train.plan import build_parser

    text = build_parser().format_help()
    commands = [line.strip() for line in text.splitlines() if line.startswith("  python -m train.plan ")]
    priced = [c for c in commands if "--layout" in c]
    assert len(priced) == 1, text
    argv = shlex.split(priced[0])[3:]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "step " in out and "does not fit" not in out, out
    flat = " ".join(text.split())  # argparse wraps the flag's help
    layout, cluster = argv[argv.index("--layout") + 1], argv[argv.index("--cluster") + 1]
    assert re.search(f'e.g. --layout "{re.escape(layout)}" on --cluster {re.escape(cluster)}', flat), flat
