"""Every refused input: exit 2 and a one-line error naming the flag, before any device work."""

import pytest
from test_data import make_hf_tokenizer

from models import attention_registry
from train import train

BASE = ["--model", "test", "--seq-len", "64", "--batch-size", "8", "--steps", "2", "--no-progress"]


def run_folder(folder):
    (folder / "run" / "checkpoints").mkdir(parents=True)
    (folder / "run" / "config.json").write_text('{"command": [], "flags": {}}')
    return folder / "run"


def json_list(folder):
    (folder / "flags.json").write_text("[1, 2]")
    return folder / "flags.json"


def binary_file(folder):
    path = folder / "weights.bin"
    path.write_bytes(bytes(range(256)) * 64)
    return path


def latin1_file(folder):
    path = folder / "latin1.txt"
    path.write_bytes("caf\xe9 cr\xe8me ".encode("latin-1") * 100)
    return path


def unwritable_cache(folder):
    (folder / "a-file").write_text("not a folder")
    return folder / "a-file" / "cache"


def hf_tokenizer(folder):
    return make_hf_tokenizer(folder / "tokenizer.json")


def hf_folder(folder):
    (folder / "model").mkdir()
    make_hf_tokenizer(folder / "model" / "tokenizer.json")
    return folder / "model"


def prepared_bytes(folder):
    from train.data.prepare import prepare
    from train.data.tokenizer import ByteTokenizer

    (folder / "src").mkdir()
    (folder / "src" / "a.txt").write_text("some text " * 50)
    prepare([str(folder / "src")], folder / "prepared", ByteTokenizer(), workers=1, log=lambda _: None)
    return folder / "prepared"


def parquet_file(folder):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["some text"] * 10}), folder / "c.parquet")
    return folder / "c.parquet"


# (flags, expected message, text the message must NOT contain); "{tmp}" is the test's folder, "{corpus}" the corpus,
# and {name} placeholders call the builders above with it.
CASES = [
    (["--mesh", "data=2,,fsdp=4"], "--mesh 'data=2,,fsdp=4': has an empty item", None),
    (["--mesh", ""], "--mesh '': is empty; give at least one axis (example: --mesh data=2,fsdp=-1,tensor=2)", None),
    (["--lr", "nan"], "--lr nan: must be a finite number", None),
    (
        ["--attention", "cudnn"],
        "--attention cudnn takes bfloat16 only, not --dtype float32; use --attention flash, or --dtype bfloat16",
        None,
    ),
    (["--attention", "cudnn", "--dtype", "bfloat16"], "--attention cudnn runs on cuda devices only", None),
    (["--lr", "inf"], "--lr inf: must be a finite number", None),
    (["--lr", "-1"], "--lr -1.0: must be positive", None),
    (["--weight-decay", "nan"], "--weight-decay nan: must be a finite number", None),
    (["--weight-decay", "-0.5"], "--weight-decay -0.5: must be >= 0", None),
    (["--grad-clip", "inf"], "--grad-clip inf: must be a finite number", None),
    (["--grad-clip", "0"], "--grad-clip 0.0: must be positive", None),
    (["--heldout", "1"], "--heldout 1.0: must be a fraction > 0 and < 1", None),
    (["--heldout", "nan"], "--heldout nan: must be a fraction", None),
    (["--heldout", "-0.1"], "--heldout -0.1: must be a fraction", None),
    (["--set", "rope_theta=-1"], "--set rope_theta=-1.0: must be a finite number > 0", None),
    (["--set", "rope_theta=inf"], "--set rope_theta=inf: must be a finite number > 0", None),
    (["--set", "norm_eps=nan"], "--set norm_eps=nan: must be a finite number > 0", None),
    (["--set", "num_layers=0"], "--set num_layers=0: must be a positive integer", None),
    (["--set", "num_layer=2"], "unknown field 'num_layer'; e.g. --set num_layers=2 (fields are vocab_size,", None),
    (
        ["--set", "attention=bogus"],
        "--set attention=bogus: choose one of " + ", ".join(attention_registry.names()) + "; e.g. --set attention=",
        None,
    ),
    (["--seed", "-1"], "--seed -1: must be in 0..2147483647", None),
    (["--seed", "2147483648"], "--seed 2147483648: must be in 0..", None),
    (["--decay-steps", "0"], "--decay-steps 0: must be a positive number of steps", None),
    (["--decay-steps", "-3"], "--decay-steps -3: must be a positive number of steps", "--warmup"),
    (["--warmup", "-1"], "--warmup -1: must be >= 0", None),
    (["--dist-timeout", "0"], "--dist-timeout 0: must be a positive number of seconds", None),
    (
        ["--coordinator", "127.0.0.1:1", "--num-processes", "0", "--process-id", "0"],
        "--num-processes 0: must be at least 1",
        None,
    ),
    (["--data-cache", "{unwritable_cache}"], "--data-cache {tmp}/a-file/cache: cannot write there", "Errno"),
    (["--eod-token", "</s>"], "--eod-token </s>: applies to a --tokenizer FILE only", None),
    (
        ["--tokenizer", "{hf_tokenizer}", "--eod-token", "<eos>"],
        "--eod-token <eos>: not in the vocabulary of --tokenizer {tmp}/tokenizer.json; e.g. --eod-token '<|endoftext|>'",
        None,
    ),
    (
        ["--tokenizer", "{hf_folder}"],
        "--tokenizer {tmp}/model: a folder; give its tokenizer.json, e.g. --tokenizer {tmp}/model/tokenizer.json",
        None,
    ),
    (
        ["--init-from", "{run_folder}"],
        "{tmp}/run: a meshwork run folder (it has checkpoints/), not a Hugging Face model folder; give it as --run-dir",
        None,
    ),
    (
        ["--config", "{json_list}"],
        '--config {tmp}/flags.json: expected an object of flags, e.g. {"seq-len": 128}',
        None,
    ),
    (["--data", "{binary_file}"], "--data {tmp}/weights.bin: not UTF-8 text (byte 128 is 0x80)", None),
    (["--data", "{latin1_file}"], "--data {tmp}/latin1.txt: not UTF-8 text", None),
    (
        ["--data", "{prepared_bytes}", "--tokenizer", "{hf_tokenizer}"],
        "--data {tmp}/prepared: prepared with the tokenizer bytes (bytes-v1), but this run uses {tmp}/tokenizer.json",
        None,
    ),
    (
        ["--data", "{parquet_file}"],
        "--data {tmp}/c.parquet: no column 'text' (it has body); pass --text-field body",
        None,
    ),
    (
        ["--data", "{parquet_file}:0,stdlib:1"],
        "--data {tmp}/c.parquet:0,stdlib:1: the weight of c is 0.0; each weight must be a positive number",
        None,
    ),
    (
        ["--mesh", "fsdp=4,tensor=2", "--rules", "dp", "--logits", "vocab_parallel"],
        "--logits vocab_parallel does not apply here",
        "--mesh fsdp=4,tensor=2",
    ),
    (
        ["--mesh", "fsdp=4,tensor=2", "--rule", "embed=none", "--logits", "vocab_parallel"],
        "--logits vocab_parallel does not apply here",
        "--mesh fsdp=4,tensor=2",
    ),
    (["--rule", "embed=tensor"], "both map to mesh axis 'tensor'", "output weight"),
    (  # the remedy suggested an fsdp axis, which a pipeline has no use for
        ["--mesh", "stage=2,tensor=4", "--microbatches", "2", "--logits", "vocab_parallel"],
        "--logits vocab_parallel does not apply here: pipeline stages (a stage axis) run the output projection "
        "with its weight gathered; use --logits auto or gathered (or drop stage from --mesh)",
        "fsdp",
    ),
    (["--lora-rank", "4", "--lora-targets", "q,x"], "--lora-targets q,x: a comma-separated list", None),
    (
        ["--mesh", "data=8", "--hetero-batch", "1,1,1,1,1,1,1,1", "--lora-rank", "4"],
        "--lora-rank 4 trains adapters with even batches only; drop --hetero-batch",
        None,
    ),
]


@pytest.mark.parametrize("flags, message, absent", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_refused_input_exits_2_naming_the_flag(tmp_path, corpus, cache, capsys, flags, message, absent):
    def fill(text):
        for name, build in (
            ("unwritable_cache", unwritable_cache),
            ("hf_tokenizer", hf_tokenizer),
            ("hf_folder", hf_folder),
            ("run_folder", run_folder),
            ("json_list", json_list),
            ("binary_file", binary_file),
            ("latin1_file", latin1_file),
            ("prepared_bytes", prepared_bytes),
            ("parquet_file", parquet_file),
        ):
            if "{" + name + "}" in text:
                text = text.replace("{" + name + "}", str(build(tmp_path)))
        return text.replace("{tmp}", str(tmp_path))

    extra = [fill(f) for f in flags]
    argv = [*BASE, "--data", str(corpus), "--data-cache", str(cache), "--run-dir", str(tmp_path / "r"), *extra]
    code = train.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert fill(message) in lines[0]
    if absent:
        assert absent not in lines[0]
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # refused before the loop was set up


def bad_jsonl_line(folder):
    path = folder / "bad.jsonl"
    path.write_text('{"text": "some text"}\n' * 20 + "{not json\n")
    return path


def small_text(folder):
    path = folder / "small.txt"
    # 1,700 bytes, one document: the held-out split is its last 18 tokens (1%)
    path.write_text("a short document " * 100)
    return path


@pytest.mark.parametrize(
    "data, message, works",
    [
        (
            "{bad_jsonl_line}",
            "--data {tmp}/bad.jsonl: the line at byte 440 is not JSON (Expecting property name enclosed in double "
            'quotes); each line must be one JSON object, e.g. {"text": "..."}: fix or remove that line',
            None,
        ),
        (
            "{corpus}:1,small={small_text}:1",
            "--data {corpus}:1,small={tmp}/small.txt:1: the held-out split of small ({tmp}/small.txt) has 18 tokens, "
            "fewer than one sequence of --seq-len 64 + 1; use --seq-len 16, a larger --heldout or more data",
            ["--seq-len", "16"],
        ),
    ],
    ids=["bad-line", "mixture-too-small"],
)
def test_data_found_bad_while_reading_stops_before_the_model_is_built(
    tmp_path, corpus, cache, capsys, monkeypatch, data, message, works
):
    """Faults found only by reading a raw source (a bad line) or by opening its splits (one too short for a
    sequence) stop the run before the model is built; the suggested value gets past the data."""

    def model_built(*_):
        raise RuntimeError("the model was built")

    monkeypatch.setattr(train, "build_trainer", model_built)

    def fill(text):
        for name, build in (("bad_jsonl_line", bad_jsonl_line), ("small_text", small_text)):
            text = text.replace("{" + name + "}", str(build(tmp_path)))
        return text.replace("{tmp}", str(tmp_path)).replace("{corpus}", str(corpus))

    argv = [*BASE, "--data", fill(data), "--data-cache", str(cache), "--run-dir", str(tmp_path / "r")]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == [f"error: {fill(message)}"] and "Traceback" not in err, err
    if works:
        assert train.main([*argv, *works]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == "error: the model was built"


def test_ctrl_c_before_the_loop_is_one_line_and_leaves_the_folder_free(tmp_path, corpus, cache, capsys, monkeypatch):
    """SIGINT outside the training loop (here while the model is built), where no step can be finished and saved,
    ends the run with one line and status 130 instead of a KeyboardInterrupt traceback; the run folder's lock is
    released, so the same command can run again at once."""

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "build_trainer", interrupted)
    run = tmp_path / "r"
    argv = [*BASE, "--data", str(corpus), "--data-cache", str(cache), "--run-dir", str(run)]
    assert train.main(argv) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: {train.INTERRUPTED}"], err
    assert not (run / "run.lock").exists() and not (run / "metrics.jsonl").exists()


def test_a_mesh_beyond_the_cpu_devices_suggests_simulating_them(tmp_path, corpus, cache):
    """A mesh of fixed sizes larger than the one CPU device JAX sees without --cpu-devices (a resume onto another
    mesh typed without it) is refused naming --cpu-devices, not with a one-device mesh; the suggestion is accepted."""
    import jax

    from train.setup import cli

    argv = [*BASE, "--data", str(corpus), "--data-cache", str(cache), "--run-dir", str(tmp_path / "r")]
    argv += ["--mesh", "data=2,tensor=4"]
    with pytest.raises(ValueError) as refused:
        train.prepare(cli.parse(argv), jax.devices()[:1], lambda _: None)
    assert str(refused.value) == (
        "--mesh data=2,tensor=4 needs 8 devices, JAX sees 1 CPU device(s); simulate them, e.g. --cpu-devices 8"
    )
    train.prepare(cli.parse([*argv, "--cpu-devices", "8"]), jax.devices(), lambda _: None)
