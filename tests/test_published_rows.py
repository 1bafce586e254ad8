"""bench/published.py's rows file: the reader's one-line errors (file, row, column), the mapping of a row onto a
meshwork layout, and one row priced by hand against the clock's own terms. No devices, no compiles."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "published.py"
_SPEC = importlib.util.spec_from_file_location("bench_published", _PATH)
published = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_published"] = published  # its dataclasses look their module up there
_SPEC.loader.exec_module(published)

_ROW = {
    "name": "sc21-1.7b",
    "source": "Narayanan et al. SC'21 Table 1",
    "model": "GPT 1.7B",
    "layers": "24",
    "hidden": "2304",
    "mlp": "9216",
    "mlp_kind": "gelu",
    "heads": "24",
    "kv_heads": "24",
    "head_dim": "96",
    "vocab": "51200",
    "seq": "2048",
    "gpu": "a100-80gb",
    "gpus": "32",
    "gpus_per_host": "8",
    "network_gbps_per_host": "1600",
    "gbs": "512",
    "mbs": "1",
    "tp": "1",
    "pp": "1",
    "cp": "1",
    "vp": "",
    "ep": "1",
    "dp": "32",
    "sp": "off",
    "dist_opt": "off",
    "recompute": "full",
    "precision": "bf16/fp16",
    "published_step_s": "3.528",
    "published_note": "137 TFLOP/s per GPU",
}


def _write(tmp_path, rows, columns=None):
    columns = columns or published.COLUMNS
    lines = [",".join(columns)] + [",".join(r.get(c, "") for c in columns) for r in rows]
    path = tmp_path / "rows.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_good_row_reads_and_maps_onto_a_layout(tmp_path):
    """Numbers parsed, a blank ``vp`` is 1; the GELU MLP of 9,216 becomes SwiGLU of 6,144 (the same FLOPs), the
    layout data parallel over 32 at one microbatch (gradients reduced once, as Megatron does) with full remat
    and the reference attention (SC'21 ran before FlashAttention)."""
    (row,) = published.read_rows(_write(tmp_path, [_ROW]))
    assert row.layers == 24 and row.vp == 1 and row.published_step_s == 3.528 and row.family == "GPT"
    assert 6144 in {s for p in published.row_model(row).products for s in p.weight.shape}
    flags, clock = published.row_layout(row)
    assert flags == ("--mesh data=32 --rules dp --microbatches 1 --attention reference --dtype bfloat16 --remat full")
    assert clock == "lockstep" and published.row_overlaps(row) == ()
    piped = dict(_ROW, tp="8", pp="4", vp="2", dp="1", gpus="32", published_note="DP/TP/PP communication overlapped")
    (row,) = published.read_rows(_write(tmp_path, [piped]))
    flags, clock = published.row_layout(row)
    assert "--mesh data=1,stage=4,tensor=8 --rules tp --microbatches 512" in flags
    assert "--pipeline-schedule 1f1b-fused --remat none --pipeline-repeats 2" in flags and clock == "fused"
    assert published.row_overlaps(row) == ("tensor", "data", "stage")


def test_a_run_that_overlapped_its_parameter_gathers_is_priced_with_the_distributed_optimizer(tmp_path):
    """Megatron-LM refuses ``--overlap-param-gather`` without its distributed optimizer, so a row whose note says
    its data-parallel communication was overlapped maps onto ``--optimizer-sharding data`` with its ``dist_opt``
    cell blank, as one whose cell says ``on`` does; a row with neither keeps the state replicated."""
    cases = [
        (dict(_ROW, dist_opt="", published_note="DP/TP/PP communication overlapped"), True),
        (dict(_ROW, dist_opt="on (fused Adam)"), True),
        (dict(_ROW, dist_opt=""), False),
    ]
    for values, zero in cases:
        (row,) = published.read_rows(_write(tmp_path, [values]))
        assert ("--optimizer-sharding data" in published.row_layout(row)[0]) == zero, values


@pytest.mark.parametrize(
    "change, column, words",
    [
        ({"layers": "24.5"}, "layers", "'24.5' is not a whole number"),
        ({"published_step_s": "fast"}, "published_step_s", "'fast' is not a number"),
        ({"gpu": "b200"}, "gpu", "unknown gpu 'b200'"),
        ({"gpus": "0"}, "gpus", "must be positive"),
        ({"dp": "lots"}, "dp", "give a number, FSDP N or FSDP+DP"),
        ({"mlp_kind": "swish"}, "mlp_kind", "'swish'"),
        (
            {"kv_heads": "7"},
            "heads",
            "heads or kv_heads to values where it is, e.g. kv_heads=24",
        ),  # was a traceback in price
        ({"mlp": "4"}, "mlp", "mlp=0: must be a positive integer"),  # a GELU MLP of 4: SwiGLU of 0
        ({"published_step_s": "inf"}, "published_step_s", "must be a positive finite number"),
        ({"tp": "3"}, "gpus", "32 is not a multiple of tp x pp x cp = 3"),
        ({"dp": "16"}, "dp", "16: gpus / (tp x pp x cp) = 32 / 1 = 32"),
        ({"dp": "FSDP 5"}, "dp", "FSDP N must divide gpus / (tp x pp x cp) = 32"),
        ({"gbs": "48"}, "gbs", "48 does not split into microbatches of mbs=1 over 32 data-parallel ranks"),
        ({"name": "sc21-1.7b"}, "name", "'sc21-1.7b' is also row 2's name"),
    ],
)
def test_a_bad_value_names_file_row_and_column(tmp_path, change, column, words):
    path = _write(tmp_path, [_ROW, {**_ROW, "name": "bad", **change}])
    with pytest.raises(ValueError) as e:
        published.read_rows(path)
    text = str(e.value)
    name = change.get("name", "bad")
    assert "\n" not in text and text.startswith(f"{path}: row 3 ({name}), column {column}: ") and words in text


def test_an_empty_file_an_unnamed_row_and_the_flags_that_do_not_go_together(tmp_path, capsys):
    """A header alone, a row without a name, ``--only`` with spaces or an unknown name, and ``--json`` with
    ``--top-three`` each get one line and exit 2; the suggestion ``--only`` gives is accepted."""
    empty = _write(tmp_path, [])
    with pytest.raises(ValueError, match=r"rows\.csv: no rows after the header"):
        published.read_rows(empty)
    unnamed = _write(tmp_path, [_ROW, dict(_ROW, name="")])
    with pytest.raises(ValueError, match=r"row 3 \(unnamed\), column name: empty"):
        published.read_rows(unnamed)
    path = _write(tmp_path, [_ROW, dict(_ROW, name="other")])
    assert published.main(["--rows", str(path), "--json", "--top-three"]) == 2
    assert "leave out --json or --top-three" in capsys.readouterr().err
    assert published.main(["--rows", str(path), "--only", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "e.g. --only sc21-1.7b" in err
    assert published.main(["--rows", str(path), "--json", "--only", " sc21-1.7b , other "]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["sc21-1.7b", "other"]


def test_a_missing_column_and_a_missing_file(tmp_path, capsys):
    path = _write(tmp_path, [_ROW], [c for c in published.COLUMNS if c != "gbs"])
    with pytest.raises(ValueError, match=r"rows\.csv: row 1 \(header\), column gbs: missing"):
        published.read_rows(path)
    assert published.main(["--rows", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "column gbs: missing" in err
    assert published.main(["--rows", str(tmp_path / "none.csv")]) == 2
    assert "none.csv: cannot read" in capsys.readouterr().err


def test_json_prices_a_row_as_train_plan_does(tmp_path, capsys):
    """``--json`` gives name, predicted and published step and fits; the prediction is `planner.evaluate`'s at
    the row's layout (the same path as ``python -m train.plan --layout``)."""
    path = _write(tmp_path, [_ROW])
    assert published.main(["--rows", str(path), "--json"]) == 0
    (out,) = json.loads(capsys.readouterr().out)
    assert set(out) == {"name", "predicted_step_s", "published_step_s", "fits"}
    (row,) = published.read_rows(path)
    priced = published.price(row)
    assert out["predicted_step_s"] == pytest.approx(priced.plan.step_time) and out["published_step_s"] == 3.528
    assert out["fits"] is priced.plan.fits


def test_a_binary_file_is_named_and_a_byte_order_mark_is_read(tmp_path, capsys):
    """A rows file that is not UTF-8 is one line naming it (it was the codec's message alone); a spreadsheet's
    UTF-8 byte-order mark before the header reads as the same rows (it hid the name column)."""
    binary = tmp_path / "rows.bin"
    binary.write_bytes(b"name,\xd0\xff\xfe\n")
    assert published.main(["--rows", str(binary)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {binary}: not UTF-8 text (byte 5); pass --rows FILE.csv\n", err
    path = _write(tmp_path, [_ROW])
    marked = tmp_path / "marked.csv"
    marked.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert [r.values for r in published.read_rows(marked)] == [r.values for r in published.read_rows(path)]


def test_the_sustained_fraction_can_be_set_for_the_measured_kinds_only(tmp_path, capsys):
    """``--sustained-fraction F`` prices an H100 row at F of its burst matmul rate in place of the measured
    0.887 (the default is the measurement to the bit), leaves an A100 row (no measurement) as it is, and refuses
    a value outside (0, 1] in one line whose example is accepted."""
    h100 = dict(_ROW, name="h100", gpu="h100-sxm-80gb", source="a run with flash attention")
    path = _write(tmp_path, [_ROW, h100])
    a100_row, h100_row = published.read_rows(path)
    measured = published.price(h100_row).plan
    assert published.price(h100_row, 0.887).plan.step_time == measured.step_time
    slower = published.price(h100_row, 0.5).plan
    assert slower.parts["compute"] > measured.parts["compute"] * 1.5  # the products and attention dominate it
    assert published.price(a100_row, 0.5).plan.step_time == published.price(a100_row).plan.step_time
    assert published.main(["--rows", str(path), "--sustained-fraction", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "e.g. 0.848" in err
    assert published.main(["--rows", str(path), "--json", "--sustained-fraction", "0.848"]) == 0
