"""The data pipeline: corpora, split, packing, window order, tokenizers, process-local rows."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.mesh import make_mesh, parse_mesh
from train.data import (
    WindowSource,
    corpus_files,
    load_dataset,
    local_rows,
    pack_windows,
    read_documents,
    split_documents,
    to_global_arrays,
)
from train.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

EOD = 99


def test_packing_segments_positions_and_loss_mask():
    window = np.array([[1, 2, EOD, 3, 4, 5, EOD, 6, 7]])
    out = pack_windows(window, EOD)
    np.testing.assert_array_equal(out["tokens"], [[1, 2, EOD, 3, 4, 5, EOD, 6]])
    np.testing.assert_array_equal(out["targets"], [[2, EOD, 3, 4, 5, EOD, 6, 7]])
    np.testing.assert_array_equal(out["segment_ids"], [[1, 1, 1, 2, 2, 2, 2, 3]])
    np.testing.assert_array_equal(out["positions"], [[0, 1, 2, 0, 1, 2, 3, 0]])
    # The EOD input's target opens the next document: no loss there.
    np.testing.assert_array_equal(out["loss_mask"], [[1, 1, 0, 1, 1, 1, 0, 1]])


def test_windows_cover_every_window_once_per_epoch_and_reproduce():
    stream = np.arange(1001)
    source = WindowSource(stream, seq_len=10, seed=3, shuffle=True, name="training")
    assert source.num_windows == 100
    first_epoch = source.window_index(np.arange(100))
    assert sorted(first_epoch) == list(range(100))
    assert not np.array_equal(first_epoch, np.arange(100))
    second_epoch = source.window_index(np.arange(100, 200))
    assert sorted(second_epoch) == list(range(100)) and not np.array_equal(first_epoch, second_epoch)
    again = WindowSource(stream, seq_len=10, seed=3, shuffle=True, name="training")
    np.testing.assert_array_equal(again.window_index(np.arange(150, 170)), source.window_index(np.arange(150, 170)))
    windows = source.windows(np.array([0]))
    assert windows.shape == (1, 11) and windows[0, -1] - windows[0, 0] == 10


def test_too_short_stream_names_the_split_and_the_flag():
    with pytest.raises(ValueError, match="held-out split .* --seq-len 64"):
        WindowSource(np.arange(10), seq_len=64, seed=0, shuffle=False, name="held-out")


def write_corpus(folder, docs=30):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        (folder / f"doc{i:02d}.txt").write_text(f"document {i}: " + "the quick brown fox. " * (5 + i))
    return folder


def test_split_is_fixed_by_seed_and_keeps_both_sides(tmp_path):
    docs = read_documents(str(write_corpus(tmp_path / "c")))
    train_a, held_a = split_documents(docs, 0.2, seed=1)
    train_b, held_b = split_documents(docs, 0.2, seed=1)
    assert [d.name for d in held_a] == [d.name for d in held_b]
    assert held_a and train_a and len(train_a) + len(held_a) == len(docs)
    assert {d.name for d in held_a}.isdisjoint({d.name for d in train_a})
    _, held_c = split_documents(docs, 0.2, seed=2)
    assert [d.name for d in held_c] != [d.name for d in held_a]


def test_jsonl_corpus_and_its_errors(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n\n" + json.dumps({"text": "world", "id": 2}) + "\n")
    assert [d.text for d in read_documents(str(path))] == [b"hello", b"world"]
    path.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="line 1 has no string field 'text'"):
        read_documents(str(path))
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        read_documents(str(path))


def test_missing_and_empty_corpora_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data .*no such file"):
        corpus_files(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(ValueError, match="no non-empty files"):
        corpus_files(str(tmp_path / "empty"))


def test_stdlib_corpus_is_python_source():
    files = corpus_files("stdlib")
    assert len(files) > 500
    assert all(f.suffix == ".py" for f in files)
    assert sum(f.stat().st_size for f in files) > 10e6


def test_dataset_streams_are_cached_and_documents_end_with_eod(tmp_path):
    corpus = write_corpus(tmp_path / "c")
    tokenizer = ByteTokenizer()
    logs = []
    ds = load_dataset(str(corpus), tokenizer, 32, 4, seed=0, heldout=0.1, cache_dir=tmp_path / "cache", log=logs.append)
    assert len(logs) == 1 and "tokenizing" in logs[0]
    load_dataset(str(corpus), tokenizer, 32, 4, seed=0, heldout=0.1, cache_dir=tmp_path / "cache", log=logs.append)
    assert len(logs) == 1  # second load reads the cache
    n_docs = 30
    total_eod = int((ds.train.stream == tokenizer.eod_id).sum() + (ds.heldout.stream == tokenizer.eod_id).sum())
    assert total_eod == n_docs
    batch = ds.train_rows(0, range(0, 4))
    assert batch["tokens"].shape == (4, 32) and batch["tokens"].dtype == np.int32
    assert set(np.unique(batch["segment_ids"])) <= set(range(1, 33))


def test_single_document_holds_out_its_tail(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("abcdefghij" * 100)
    ds = load_dataset(str(path), ByteTokenizer(), 16, 2, seed=0, heldout=0.1, cache_dir=tmp_path / "cache", log=print)
    assert len(ds.heldout.stream) > 16 and len(ds.train.stream) > len(ds.heldout.stream)


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
