"""The data path: sources, prepare (shards, manifest, resume, reuse, Parquet), the Grain pipeline (order, packing,
process-local rows, iterator state), and bad input."""

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.mesh import make_mesh, parse_mesh
from train.data import corpus_files, load_dataset, local_rows, pack_windows, read_documents, to_global_arrays
from train.data.corpus import is_heldout, plan_units, unit_documents
from train.data.pipeline import check_source
from train.data.prepare import main as prepare_main
from train.data.prepare import prepare
from train.data.prepared import read_manifest, shuffled_order
from train.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

EOD = 99
QUIET = dict(log=lambda _: None, progress=False)


def test_packing_segments_positions_and_loss_mask():
    window = np.array([[1, 2, EOD, 3, 4, 5, EOD, 6, 7]])
    out = pack_windows(window, EOD)
    np.testing.assert_array_equal(out["tokens"], [[1, 2, EOD, 3, 4, 5, EOD, 6]])
    np.testing.assert_array_equal(out["targets"], [[2, EOD, 3, 4, 5, EOD, 6, 7]])
    np.testing.assert_array_equal(out["segment_ids"], [[1, 1, 1, 2, 2, 2, 2, 3]])
    np.testing.assert_array_equal(out["positions"], [[0, 1, 2, 0, 1, 2, 3, 0]])
    # The EOD input's target opens the next document: no loss there.
    np.testing.assert_array_equal(out["loss_mask"], [[1, 1, 0, 1, 1, 1, 0, 1]])


def test_order_covers_every_window_once_per_epoch_and_reproduces():
    order = shuffled_order(100, seed=3, repeat=True)
    first_epoch = np.array([order[i] for i in range(100)])
    assert sorted(first_epoch) == list(range(100)) and not np.array_equal(first_epoch, np.arange(100))
    second_epoch = np.array([order[i] for i in range(100, 200)])
    assert sorted(second_epoch) == list(range(100)) and not np.array_equal(first_epoch, second_epoch)
    again = shuffled_order(100, seed=3, repeat=True)
    assert [again[i] for i in range(150, 170)] == [order[i] for i in range(150, 170)]
    assert [shuffled_order(100, seed=4, repeat=True)[i] for i in range(100)] != list(first_epoch)


def write_corpus(folder, docs=30):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        (folder / f"doc{i:02d}.txt").write_text(f"document {i}: " + "the quick brown fox. " * (5 + i))
    return folder


def test_split_is_fixed_by_seed_and_document_level(tmp_path):
    corpus = write_corpus(tmp_path / "c")
    names = [d.name for d in read_documents(str(corpus))]
    held = {n for n in names if is_heldout(n, 1, 0.2)}
    assert held and held != set(names)
    assert held != {n for n in names if is_heldout(n, 2, 0.2)}
    manifest = prepare([str(corpus)], tmp_path / "p", ByteTokenizer(), seed=1, heldout=0.2, workers=1, **QUIET)
    assert manifest["heldout_docs"] == len(held) and manifest["train_docs"] == len(names) - len(held)


def test_jsonl_corpus_and_its_errors(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n\n" + json.dumps({"text": "world", "id": 2}) + "\n")
    assert [d.text for d in read_documents(str(path))] == [b"hello", b"world"]
    path.write_text(json.dumps({"body": "x"}) + "\n")
    assert [d.text for d in read_documents(str(path), text_field="body")] == [b"x"]
    with pytest.raises(ValueError, match="byte 0 has no string field 'text'"):
        read_documents(str(path))
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="byte 0 is not JSON"):
        read_documents(str(path))


def test_jsonl_byte_ranges_hold_every_line_once(tmp_path):
    path = tmp_path / "c.jsonl"
    lines = [json.dumps({"text": f"line {i} " + "x" * (i % 7)}) for i in range(200)]
    path.write_text("\n".join(lines) + "\n")
    units = plan_units(str(path), 300)
    assert len(units) > 10
    texts = [d.text.decode() for u in units for d in unit_documents(u)]
    assert texts == [json.loads(line)["text"] for line in lines]


def test_missing_and_empty_corpora_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data .*no such file"):
        corpus_files(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(ValueError, match="no non-empty files"):
        corpus_files(str(tmp_path / "empty"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.dat").write_bytes(bytes(range(256)) * 10)
    with pytest.raises(ValueError, match="a.dat: not UTF-8 text"):
        corpus_files(str(tmp_path / "bin"))
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match=r"blank.jsonl: no document with text in 1 file\(s\)"):
        prepare([str(blank)], tmp_path / "p", ByteTokenizer(), workers=1, **QUIET)


def test_stdlib_corpus_is_python_source():
    files = corpus_files("stdlib")
    assert len(files) > 500
    assert all(f.suffix == ".py" for f in files)
    assert sum(f.stat().st_size for f in files) > 10e6


# Prepare -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A 30-document corpus (13 kB) prepared into shards of 2 kB of input, and its documents."""
    root = tmp_path_factory.mktemp("prep")
    corpus = write_corpus(root / "c")
    out = root / "p"
    prepare([str(corpus)], out, ByteTokenizer(), seed=0, heldout=0.1, shard_mb=2e-3, workers=1, **QUIET)
    return corpus, out


def in_memory_stream(corpus, split, seed=0, heldout=0.1):
    """The split's tokens built the plain way: documents in order, each followed by the EOD token."""
    pieces = []
    for doc in read_documents(str(corpus)):
        if is_heldout(doc.name, seed, heldout) == (split == "heldout"):
            pieces += [np.frombuffer(doc.text, np.uint8).astype(np.int64), [ByteTokenizer.eod_id]]
    return np.concatenate(pieces)


def test_prepare_writes_shards_and_a_manifest(prepared):
    corpus, out = prepared
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["shards"]) > 3  # 2 kB of input per shard
    assert manifest["train_docs"] + manifest["heldout_docs"] == 30
    assert manifest["tokenizer"]["fingerprint"] == ByteTokenizer.fingerprint
    assert manifest["split"]["seed"] == 0 and manifest["split"]["heldout"] == 0.1
    assert len(manifest["sources"]) == 30 and {"size", "mtime_ns"} <= set(manifest["sources"][0])
    assert manifest["train_tokens"] == len(in_memory_stream(corpus, "train"))
    assert manifest["heldout_tokens"] == len(in_memory_stream(corpus, "heldout"))


def test_prepared_batches_equal_the_same_tokens_in_memory(prepared):
    corpus, out = prepared
    T, B = 32, 4
    ds = load_dataset(str(out), ByteTokenizer(), T, B, seed=0, log=lambda _: None)
    stream = in_memory_stream(corpus, "train")
    order = shuffled_order((len(stream) - 1) // T, 0, repeat=True)
    assert ds.train.num_windows == (len(stream) - 1) // T
    for step in range(3):
        batch = ds.train_rows(step * B, range(B))
        windows = np.stack([stream[order[step * B + r] * T :][: T + 1] for r in range(B)])
        expected = pack_windows(windows, ByteTokenizer.eod_id)
        for field, value in expected.items():
            np.testing.assert_array_equal(batch[field], value, err_msg=f"step {step} {field}")
    held = in_memory_stream(corpus, "heldout")
    row = ds.eval_rows(0, range(1))["tokens"][0]
    w = shuffled_order((len(held) - 1) // T, 1, repeat=True)[0]
    np.testing.assert_array_equal(row, held[w * T : w * T + T])


def test_a_second_prepare_reuses_and_an_interrupted_one_resumes_by_shard(prepared, tmp_path):
    corpus, out = prepared
    logs = []
    prepare([str(corpus)], out, ByteTokenizer(), seed=0, heldout=0.1, shard_mb=2e-3, log=logs.append, progress=False)
    assert logs == [f"reusing the prepared data in {out} (same sources, tokenizer and settings)"]
    copy = tmp_path / "p"
    import shutil

    shutil.copytree(out, copy)
    shards = len(json.loads((out / "manifest.json").read_text())["shards"])
    (copy / "manifest.json").unlink()  # interrupted with one shard unfinished
    (copy / "shard-00001.json").unlink()
    (copy / "train-00001.array_record").write_bytes(b"torn")
    logs = []
    prepare([str(corpus)], copy, ByteTokenizer(), seed=0, heldout=0.1, shard_mb=2e-3, log=logs.append, progress=False)
    assert f"resuming: {shards - 1} of {shards} shards already done" in logs[0]
    assert (
        json.loads((copy / "manifest.json").read_text())["shards"]
        == json.loads((out / "manifest.json").read_text())["shards"]
    )
    assert (copy / "train-00001.array_record").read_bytes() == (out / "train-00001.array_record").read_bytes()
    with pytest.raises(ValueError, match="--out .* choose an empty or new folder"):
        prepare([str(corpus)], copy, ByteTokenizer(), seed=1, heldout=0.1, shard_mb=2e-3, **QUIET)


def test_two_workers_write_the_same_shards_as_one(prepared, tmp_path):
    corpus, out = prepared
    prepare([str(corpus)], tmp_path / "w2", ByteTokenizer(), seed=0, heldout=0.1, shard_mb=2e-3, workers=2, **QUIET)
    for path in sorted(out.glob("*.array_record")):
        assert (tmp_path / "w2" / path.name).read_bytes() == path.read_bytes(), path.name


def test_the_cli_prepares_and_refuses_in_one_line(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c", docs=5)
    assert prepare_main(["prepare", str(corpus), "--out", str(tmp_path / "p"), "--workers", "1", "--no-progress"]) == 0
    assert (tmp_path / "p" / "manifest.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no lock file left beside --out
    assert prepare_main(["prepare", str(tmp_path / "nope"), "--out", str(tmp_path / "q")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: SRC {tmp_path / 'nope'}: no such file")
    assert prepare_main(["prepare", str(corpus), "--out", str(tmp_path / "q"), "--workers", "0"]) == 2
    assert "--workers 0: must be at least 1, e.g. --workers 2" in capsys.readouterr().err


def test_the_cli_refuses_an_out_it_cannot_write_before_reading(tmp_path, capsys):
    """A file where --out should be (or above it) and a non-finite --shard-mb are one line naming the flag, not
    an OSError's or OverflowError's traceback after the sources were read."""
    corpus = write_corpus(tmp_path / "c", docs=2)
    (tmp_path / "afile").write_text("not a folder")
    for out in (tmp_path / "afile", tmp_path / "afile" / "p"):
        assert prepare_main(["prepare", str(corpus), "--out", str(out), "--workers", "1"]) == 2
        err = capsys.readouterr().err
        assert err.strip() == (
            f"error: --out {out}: cannot write there ({tmp_path / 'afile'} is a file, not a folder); choose a folder"
        ), err
    for value in ("nan", "inf", "0"):
        code = prepare_main(["prepare", str(corpus), "--out", str(tmp_path / "p"), "--shard-mb", value])
        err = capsys.readouterr().err
        assert code == 2 and err.strip().startswith(
            f"error: --shard-mb {float(value)}: must be a positive number, e.g. --shard-mb 16"
        ), err


def test_ctrl_c_during_the_cli_keeps_the_shards_written_and_the_same_command_resumes(tmp_path, capsys, monkeypatch):
    from train.data import prepare as prepare_module

    corpus = write_corpus(tmp_path / "c", docs=6)
    real, calls = prepare_module._prepare_unit, []

    def interrupted_after_one(job):
        calls.append(job[0])
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(job)

    monkeypatch.setattr(prepare_module, "_prepare_unit", interrupted_after_one)
    argv = [
        "prepare",
        str(corpus),
        "--out",
        str(tmp_path / "p"),
        "--workers",
        "1",
        "--shard-mb",
        "2e-4",
        "--no-progress",
    ]
    assert prepare_main(argv) == 130
    err = capsys.readouterr().err
    assert err.strip() == (
        f"error: interrupted (Ctrl-C); the shards already written to {tmp_path / 'p'} are kept: the same command "
        "tokenizes only the rest"
    ), err
    monkeypatch.setattr(prepare_module, "_prepare_unit", real)
    assert prepare_main(argv) == 0
    assert ", resuming: 1 of " in capsys.readouterr().out
    assert (tmp_path / "p" / "manifest.json").is_file()


# Parquet -----------------------------------------------------------------------------------------------------


def write_parquet(path, texts, row_group_size):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(texts))), "content": texts}), path, row_group_size=row_group_size)


def test_parquet_is_read_by_row_group(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    texts = [f"row {i}: " + "words " * (i % 5) for i in range(100)]
    path = tmp_path / "c.parquet"
    write_parquet(path, texts, row_group_size=10)
    units = plan_units(str(path), 1, text_field="content")  # 1 byte per unit: one row group each
    assert [(u.start, u.stop) for u in units] == [(g, g + 1) for g in range(10)]
    read_groups = []
    original = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        read_groups.append(list(kwargs["row_groups"]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    docs = [d for u in units for d in unit_documents(u, "content")]
    assert [d.text.decode() for d in docs] == texts
    assert docs[37].name == "c.parquet:37"
    assert read_groups == [[g] for g in range(10)]  # never the whole file at once
    monkeypatch.undo()
    manifest = prepare([str(path)], tmp_path / "p", ByteTokenizer(), text_field="content", workers=1, **QUIET)
    assert manifest["train_docs"] + manifest["heldout_docs"] == 100


def test_parquet_without_the_column_or_pyarrow_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "c.parquet"
    write_parquet(path, ["a", "b"], row_group_size=1)
    with pytest.raises(
        ValueError, match=r"c.parquet: no column 'text' \(it has id, content\); pass --text-field content"
    ):
        plan_units(str(path), 1 << 20)
    check_source(str(path), ByteTokenizer(), text_field="content")  # training's --text-field, followed
    write_parquet(path, ["some words"] * 20, row_group_size=5)
    ds = load_dataset(str(path), ByteTokenizer(), 4, 2, 0, 0.3, tmp_path / "cache", text_field="content")
    assert ds.manifest["text_field"] == "content" and ds.manifest["train_docs"] + ds.manifest["heldout_docs"] == 20
    with pytest.raises(ValueError, match="column 'id' holds int64, not strings"):
        list(unit_documents(plan_units(str(path), 1 << 20, "id")[0], "id"))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"pip install 'meshwork\[data\]'"):
        corpus_files(str(path))


# Reading prepared data -----------------------------------------------------------------------------------------


def test_a_manifest_of_another_tokenizer_and_a_damaged_shard_are_refused(prepared, tmp_path):
    _, out = prepared
    hf = load_tokenizer(str(make_hf_tokenizer(tmp_path / "tokenizer.json")))
    with pytest.raises(
        ValueError, match="prepared with the tokenizer bytes .* pass --tokenizer bytes, or prepare again"
    ):
        check_source(str(out), hf)
    import shutil

    damaged = tmp_path / "d"
    shutil.copytree(out, damaged)
    np.save(damaged / "train-00002.lengths.npy", np.array([3], np.uint32))
    with pytest.raises(ValueError, match="shard train-00002.array_record is missing or damaged"):
        read_manifest(damaged, ByteTokenizer())
    shutil.copy(out / "train-00002.lengths.npy", damaged / "train-00002.lengths.npy")
    (damaged / "train-00002.array_record").write_bytes(b"\0" * 64)
    # A folder prepared before checksums were written: the damage shows when a step reads the record.
    manifest = json.loads((damaged / "manifest.json").read_text())
    for shard in manifest["shards"]:
        shard.pop("train_crc32"), shard.pop("heldout_crc32")
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    ds = load_dataset(str(damaged), ByteTokenizer(), 32, 4, seed=0, log=lambda _: None)
    with pytest.raises(ValueError, match="train-00002.array_record"):
        for s in range(0, ds.train.num_windows, 4):
            ds.train_rows(s, range(4))


def test_flipped_bytes_in_a_shard_are_found_when_the_folder_is_opened_and_by_verify(prepared, tmp_path, capsys):
    import shutil

    _, out = prepared
    damaged = tmp_path / "d"
    shutil.copytree(out, damaged)
    assert prepare_main(["verify", str(damaged)]) == 0
    assert "intact (token counts and CRC-32s)" in capsys.readouterr().out
    for name in ("heldout-00001.array_record", "train-00003.array_record"):
        raw = bytearray((damaged / name).read_bytes())
        raw[len(raw) // 2] ^= 0xFF  # one flipped byte, same size: the lengths still agree
        (damaged / name).write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"shard heldout-00001.array_record is damaged \(CRC-32 .*delete the folder"):
        load_dataset(str(damaged), ByteTokenizer(), 32, 4, seed=0, log=lambda _: None)
    assert prepare_main(["verify", str(damaged)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert [line.split(": shard ")[1].split()[0] for line in err[:2]] == [
        "heldout-00001.array_record",
        "train-00003.array_record",
    ]
    assert err[2].startswith("2 of ") and len(err) == 3
    assert prepare_main(["verify", str(tmp_path)]) == 2
    assert "not a prepared folder" in capsys.readouterr().err


def test_single_document_holds_out_its_tail(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("abcdefghij" * 100)
    ds = load_dataset(str(path), ByteTokenizer(), 16, 2, seed=0, heldout=0.1, cache_dir=tmp_path / "cache", log=print)
    assert len(ds.heldout.stream) == 101 and len(ds.train.stream) == 900


def test_a_raw_source_is_prepared_once_into_the_cache(tmp_path):
    corpus = write_corpus(tmp_path / "c")
    logs = []
    load_dataset(
        str(corpus), ByteTokenizer(), 32, 4, seed=0, heldout=0.1, cache_dir=tmp_path / "cache", log=logs.append
    )
    assert any(line.startswith("preparing") for line in logs)
    logs.clear()
    load_dataset(
        str(corpus), ByteTokenizer(), 32, 4, seed=0, heldout=0.1, cache_dir=tmp_path / "cache", log=logs.append
    )
    assert len(logs) == 1 and logs[0].startswith("reusing")


def test_process_rows_and_restored_iterators_see_the_uninterrupted_batches(prepared):
    """The same batches whichever rows a process holds (another data-parallel size or process count) and
    whether the position comes from Grain's saved state or is derived from the samples consumed."""
    _, out = prepared
    ds = load_dataset(str(out), ByteTokenizer(), 16, 8, seed=0, log=lambda _: None)
    straight = ds.train_batches(range(8), 0)
    reference = [next(straight) for _ in range(6)]
    for step, batch in enumerate(reference):
        np.testing.assert_array_equal(batch["tokens"], ds.train_rows(step * 8, range(8))["tokens"])
    halves = [ds.train_batches(range(0, 4), 0), ds.train_batches(range(4, 8), 0)]  # two processes
    for step in range(3):
        joined = [next(h) for h in halves]
        for field in reference[step]:
            np.testing.assert_array_equal(np.concatenate([j[field] for j in joined]), reference[step][field])
    saved = halves[0].state()
    assert saved == {"grain": {"next_index": 3}, "base": 0, "global_batch": 8}
    resumed = ds.train_batches(range(8), 24, saved)  # one process resumes what two saved: Grain's state
    assert resumed.restored == "grain"
    for step in range(3, 6):
        np.testing.assert_array_equal(next(resumed)["tokens"], reference[step]["tokens"])
    ds4 = load_dataset(str(out), ByteTokenizer(), 16, 4, seed=0, log=lambda _: None)
    other = ds4.train_batches(range(4), 24, saved)  # another global batch: the position is derived
    assert other.restored == "derived"
    for step in range(3, 6):
        np.testing.assert_array_equal(next(other)["tokens"], reference[step]["tokens"][:4])
        np.testing.assert_array_equal(next(other)["tokens"], reference[step]["tokens"][4:])


# Tokenizers and process-local arrays -----------------------------------------------------------------------------


def make_hf_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<|endoftext|>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_finds_its_end_of_document_token(tmp_path):
    tok = load_tokenizer(str(make_hf_tokenizer(tmp_path / "tokenizer.json")))
    assert isinstance(tok, HFTokenizer)
    assert tok.eod_id == 1 and tok.vocab_size <= 60
    ids = tok.encode_batch([b"the lazy fox"])[0]
    assert ids.dtype == np.uint32 and len(ids) >= 3
    assert tok.decode(ids).replace(" ", "") == "thelazyfox"
    with pytest.raises(ValueError, match="--eod-token"):
        HFTokenizer(tmp_path / "tokenizer.json", eod_token="<eos>")
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_each_process_loads_only_its_rows():
    mesh = make_mesh(parse_mesh("data=2,fsdp=2,tensor=2", 8))
    sharding = NamedSharding(mesh, P(("data", "fsdp")))
    assert local_rows(sharding, (8, 4)) == range(0, 8)  # one process holds every row
    requested = []

    def rows_fn(rows):
        requested.append(rows)
        data = np.arange(rows.start, rows.stop)[:, None] * 10 + np.arange(4)[None]
        return {f: data.astype(np.int32) for f in ("tokens", "targets", "positions", "segment_ids", "loss_mask")}

    arrays = to_global_arrays(rows_fn, 8, 4, sharding)
    assert requested == [range(0, 8)]
    np.testing.assert_array_equal(np.asarray(arrays["tokens"]), np.arange(8)[:, None] * 10 + np.arange(4))
    assert arrays["tokens"].sharding == sharding
    shard_rows = {tuple(np.asarray(s.data)[:, 0] // 10) for s in arrays["tokens"].addressable_shards}
    assert shard_rows == {(0, 1), (2, 3), (4, 5), (6, 7)}
    assert jax.device_count() == 8


# Mixtures ------------------------------------------------------------------------------------------------------


def test_mixture_spellings_and_refusals(tmp_path):
    from train.data.pipeline import SourceSpec, parse_sources

    corpus = write_corpus(tmp_path / "web", docs=2)
    assert parse_sources(str(corpus)) == [SourceSpec("web", str(corpus), 1.0)]
    assert parse_sources("stdlib") == [SourceSpec("stdlib", "stdlib", 1.0)]
    assert parse_sources(f"web={corpus}:0.7,code=/x/y.jsonl:0.3,stdlib") == [
        SourceSpec("web", str(corpus), 0.7),
        SourceSpec("code", "/x/y.jsonl", 0.3),
        SourceSpec("stdlib", "stdlib", 1.0),
    ]
    code = write_corpus(tmp_path / "code", docs=2)
    for bad, match in (
        (f"{corpus}:0,{code}:1", r"the weight of web is 0.0; each weight must be a positive number"),
        (f"{corpus}:-1,{code}:1", "the weight of web is -1.0"),
        (f"{corpus}:nan,{code}", "the weight of web is nan"),
        (f"{corpus}:1,{corpus}:2", "two sources are named web"),
        (f"{corpus}:1,", "an empty source"),
    ):
        with pytest.raises(ValueError, match=match) as refused:
            check_source(bad, ByteTokenizer())
        suggestion = str(refused.value).split("e.g. --data ")[1]
        assert len(parse_sources(suggestion)) >= 2  # the suggested spelling is accepted
        if "/" in suggestion and "DIR" not in suggestion:
            check_source(suggestion, ByteTokenizer())


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """Two prepared sources told apart by their letters: ``a`` documents and ``b`` documents."""
    root = tmp_path_factory.mktemp("mix")
    for letter in "ab":
        (root / letter).mkdir()
        for i in range(12):
            (root / letter / f"{i}.txt").write_text(letter * (40 + 7 * i))
        prepare([str(root / letter)], root / f"p{letter}", ByteTokenizer(), heldout=0.2, workers=1, **QUIET)
    return f"a={root / 'pa'}:0.7,b={root / 'pb'}:0.3"


def source_of(rows):
    """0 for a row of ``a`` text, 1 for ``b`` (an EOD token between documents belongs to neither)."""
    letters = {int(t) for t in np.unique(rows)} - {ByteTokenizer.eod_id}
    assert len(letters) == 1, letters
    return {ord("a"): 0, ord("b"): 1}[letters.pop()]


def test_a_mixture_draws_by_weight_and_each_source_in_its_own_order(mixture):
    ds = load_dataset(mixture, ByteTokenizer(), 16, 8, seed=3, log=lambda _: None)
    assert [s.name for s in ds.sources] == ["a", "b"] and [s.weight for s in ds.sources] == [0.7, 0.3]
    picks = ds.sample_sources(range(1000))
    counts = np.bincount([k for k, _ in picks], minlength=2)
    assert abs(counts[0] - 700) <= 2 and abs(counts[1] - 300) <= 2
    for n in (0, 1, 7, 100, 999):
        assert ds.source_samples(n) == list(np.bincount([k for k, _ in picks[:n]], minlength=2))
    # Each source's samples are numbered 0, 1, 2, ... in order: its own shuffle is read front to back.
    for k in (0, 1):
        assert [j for kk, j in picks if kk == k] == list(range(counts[k]))
    batch = ds.train_rows(0, range(40))
    for r in range(40):
        k, j = picks[r]
        assert source_of(batch["tokens"][r]) == k
        window, _ = ds.sources[k].train.read([ds.train_orders[k][j]])
        np.testing.assert_array_equal(batch["targets"][r], window[0, 1:])
    for k in (0, 1):  # held-out batches per source
        assert source_of(ds.eval_rows(0, range(8), source=k)["tokens"]) == k
    again = load_dataset(mixture, ByteTokenizer(), 16, 8, seed=3, log=lambda _: None).train_rows(0, range(40))
    np.testing.assert_array_equal(again["tokens"], batch["tokens"])
    other = load_dataset(mixture, ByteTokenizer(), 16, 8, seed=4, log=lambda _: None).train_rows(0, range(40))
    assert not np.array_equal(other["tokens"], batch["tokens"])


def test_a_mixture_resumes_exactly(mixture):
    ds = load_dataset(mixture, ByteTokenizer(), 16, 8, seed=0, log=lambda _: None)
    straight = ds.train_batches(range(8), 0)
    reference = [next(straight)["tokens"] for _ in range(5)]
    first = ds.train_batches(range(4, 8), 0)  # the second of two processes
    for _ in range(2):
        next(first)
    resumed = ds.train_batches(range(8), 16, first.state())
    assert resumed.restored == "grain"
    for step in range(2, 5):
        np.testing.assert_array_equal(next(resumed)["tokens"], reference[step])
    ds4 = load_dataset(mixture, ByteTokenizer(), 16, 4, seed=0, log=lambda _: None)
    derived = ds4.train_batches(range(4), 16, first.state())
    assert derived.restored == "derived"
    np.testing.assert_array_equal(next(derived)["tokens"], reference[2][:4])


def test_a_changed_source_supersedes_its_cache_unless_a_reader_holds_it(tmp_path):
    import subprocess

    from train.data import prepared as pipeline

    corpus = write_corpus(tmp_path / "c", docs=8)
    cache = tmp_path / "cache"
    quiet = dict(log=lambda _: None)
    first = Path(load_dataset(str(corpus), ByteTokenizer(), 8, 2, 0, 0.2, cache, **quiet).train.stream.paths[0]).parent
    seed1 = Path(load_dataset(str(corpus), ByteTokenizer(), 8, 2, 1, 0.2, cache, **quiet).train.stream.paths[0]).parent
    for handle in pipeline._HELD:  # this process stops reading them (as if it had exited)
        handle.close()
    pipeline._HELD.clear()
    code = f"import fcntl;f=open('{first}/.readers','a');fcntl.flock(f,fcntl.LOCK_SH);print('held',flush=True);input()"
    reader = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline() == "held\n"  # another process reads the first preparation: it stays
        (corpus / "doc00.txt").write_text("changed " * 30)
        logs = []
        second = load_dataset(str(corpus), ByteTokenizer(), 8, 2, 0, 0.2, cache, log=logs.append)
        assert not any(line.startswith("removed") for line in logs) and first.is_dir()
    finally:
        reader.communicate("\n")
    second = Path(second.train.stream.paths[0]).parent
    # Read by nobody now, the first is removed at the next change; the second is read by this process and
    # stays, as does the preparation of another seed (not superseded: another split).
    (corpus / "doc01.txt").write_text("changed again " * 30)
    logs = []
    load_dataset(str(corpus), ByteTokenizer(), 8, 2, 0, 0.2, cache, log=logs.append)
    assert [line.split(":")[0] for line in logs if line.startswith("removed")] == [f"removed {first}"]
    assert not first.exists() and second.is_dir() and seed1.is_dir()
