"""Every remedy an error names is one the same command accepts: the suggestion is applied and checked again.

Each case is a train.train command line that is refused with a suggestion (``e.g. --flag VALUE``, ``pass --flag
VALUE``); the test takes the flags the message suggests, puts them into the command line (replacing the same
flags' values), and runs the same parse and checks (`train.setup.cli.parse`, `train.train.prepare`) again: they must pass.
"""

import json
import re
import shlex
from types import SimpleNamespace

import jax
import pytest

from train.setup import cli
from train.setup.flagnames import render
from train.train import prepare

BASE = ["--model", "test", "--seq-len", "64", "--batch-size", "8", "--steps", "2"]


def refusal(argv):
    """The message of the error parse or checks raise for ``argv``, or None when both accept it."""
    try:
        prepare(cli.parse(argv), jax.devices(), lambda _: None)
    except (ValueError, FileNotFoundError) as e:
        return render(e)
    return None


def suggested(message: str) -> list[str]:
    """The flags of the message's suggestion: what follows its last ``e.g.``, ``pass`` or ``use``, up to ``;``,
    a parenthesis or ``, or``."""
    found = re.findall(r"(?:e\.g\.|pass|use) (--[^;)]*?)(?:;| \(|\)|, or |$)", message)
    assert found, f"no suggestion in: {message}"
    return shlex.split(found[-1].rstrip(". "))


def applied(argv: list[str], flags: list[str]) -> list[str]:
    """``argv`` with each suggested ``--flag [value]`` put in place of the same flag's value (or appended)."""
    out = list(argv)
    i = 0
    while i < len(flags):
        flag = flags[i]
        value = flags[i + 1 : i + 2] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else []
        i += 1 + len(value)
        if flag in out and flag not in ("--rule", "--set"):  # repeatable flags are added, the others replaced
            at = out.index(flag)
            has_value = at + 1 < len(out) and not out[at + 1].startswith("--")
            out[at : at + 1 + has_value] = [flag, *value]
        else:
            out += [flag, *value]
    return out


CASES = [
    ["--heldout", "1"],
    ["--seed", "-1"],
    ["--decay-steps", "0"],
    ["--warmup", "-1"],
    ["--mesh", "data=2,sequence=4", "--attention", "ring", "--seq-len", "66"],
    ["--mesh", "sequence=8", "--attention", "ulysses"],  # 4 query heads: sequence=4, data=2
    ["--mesh", "context=2,sequence=4", "--attention", "usp", "--set", "num_heads=6", "--set", "num_kv_heads=2"],
    ["--mesh", "stage=-1"],
    ["--mesh", "stage=8", "--microbatches", "4"],  # 4 layers: the whole mesh suggested, stage=4,fsdp=2
    ["--mesh", "stage=8"],  # the same with one microbatch: the suggestion brings --microbatches 4 along
    ["--mesh", "stage=8", "--set", "num_layers=6", "--microbatches", "4"],  # 6 layers: stage=4, not 6
    ["--mesh", "data=4,context=2", "--context-shares", "2,1"],  # the length already split: the mesh is kept
    ["--context-shares", "2,1"],
    ["--pipeline-schedule", "circular", "--mesh", "stage=2,fsdp=4"],
    ["--microbatches", "3", "--mesh", "stage=2,fsdp=4"],
    ["--mesh", "stage=2,fsdp=4", "--microbatches", "4", "--batch-size", "6"],
    ["--pipeline-repeats", "2", "--mesh", "stage=2,fsdp=4", "--microbatches", "2"],
    ["--pipeline-schedule", "zb"],  # no stage axis: the mesh suggested brings the microbatches its stages need
    ["--pipeline-gather", "microbatch"],
    ["--stage-layers", "1,3"],
    ["--pipeline-repeats", "2", "--pipeline-schedule", "1f1b"],
    ["--rebalance-every", "5"],
    ["--resume-step", "3"],
    ["--hetero-max-share", "4"],
    ["--hetero-batch", "1,2,3", "--mesh", "data=8"],
    ["--batch-size", "16", "--hetero-batch", "3,3,2,2,2,2,1,1", "--mesh", "data=8", "--hetero-max-share", "2"],
    ["--mesh", "stage=2,fsdp=4", "--microbatches", "2", "--hetero-batch", "auto"],
    ["--model", "7b", "--set", "num_layers=256", "--mesh", "fsdp=8", "--dry-run"],  # over any host's memory
    ["--model", "moe-test", "--mesh", "stage=2,fsdp=4", "--microbatches", "2"],  # a dense first layer
    ["--attention", "cudnn"],  # float32: flash (bfloat16 would be refused next on this CPU)
    ["--attention", "cudnn", "--dtype", "bfloat16"],  # cuDNN on CPU devices
    ["--attention", "cudnn", "--dtype", "bfloat16", "--set", "head_dim=36"],
    ["--plan", "auto"],  # CPU devices have no figures to plan with: --simulate-cluster
    ["--model", "moe-test", "--set", "num_experts=6", "--mesh", "expert=4,fsdp=2"],  # the whole mesh: 8 devices
    ["--mesh", "expert=2,fsdp=4"],  # a dense model: the expert axis's devices to data
    ["--batch-size", "0"],  # a count below 1: its default
    ["--seq-len", "0"],
    ["--microbatches", "0"],
    ["--log-every", "0"],
    ["--steps", "0"],
    ["--cpu-devices", "0"],
    ["--pipeline-repeats", "0", "--mesh", "stage=2,fsdp=4", "--microbatches", "2"],
    # circular needs 2 chunks or more: the example was 1, which circular refuses
    ["--pipeline-repeats", "0", "--pipeline-schedule", "circular", "--mesh", "stage=2,fsdp=4", "--microbatches", "2"],
    ["--simulate-cluster", "h100:4@400Gbps,a100:4@100Gbps"],  # one bandwidth for all hosts, named by its flag
    ["--pipeline-schedule", "circular", "--mesh", "stage=4,fsdp=2", "--microbatches", "4"],  # 1 layer a stage
    ["--model", "moe-test", "--set", "first_dense_layers=0", "--set", "capacity_factor=1.25"]
    + ["--mesh", "stage=2,fsdp=4", "--microbatches", "2"],
]


@pytest.mark.parametrize("flags", CASES, ids=[" ".join(c) for c in CASES])
def test_the_suggested_flags_are_accepted(tmp_path, corpus, cache, flags):
    base = [*BASE, "--data", str(corpus), "--data-cache", str(cache), "--run-dir", str(tmp_path / "r")]
    argv = applied(base, flags)
    message = refusal(argv)
    assert message is not None, f"accepted: {argv}"
    fixed = applied(argv, suggested(message))
    assert refusal(fixed) is None, f"{message}\n-> {shlex.join(fixed[len(BASE) :])}\n-> {refusal(fixed)}"


def test_a_resume_with_another_model_is_named_a_different_model_before_its_layout(tmp_path, corpus, cache):
    """``--model moe-test --resume`` on a ``--model test`` run saved on a pipeline was refused for the pipeline
    (moe-test's dense first layer) before the checkpoint was compared: the different model is named first, and
    the model it says to resume with is accepted."""
    from checkpoints.meta import RunMeta
    from train.data.tokenizer import load_tokenizer

    run_dir = tmp_path / "r"
    base = [*BASE, "--data", str(corpus), "--data-cache", str(cache), "--run-dir", str(run_dir)]
    saved = cli.parse(applied(base, ["--mesh", "stage=2,fsdp=2,data=2", "--microbatches", "2"]))
    tokenizer = load_tokenizer(saved.data.tokenizer, saved.data.eod_token)
    par = saved.parallelism
    meta = RunMeta.create(saved.model, "test", par.mesh_shape, par.rules, {}, tokenizer, None).at(2, 16)
    (run_dir / "checkpoints" / "2" / "meta").mkdir(parents=True)
    (run_dir / "checkpoints" / "2" / "meta" / "metadata").write_text(json.dumps(meta.to_json()))
    argv = applied(base, ["--mesh", "stage=2,fsdp=2,data=2", "--microbatches", "2"])
    argv = applied(argv, ["--model", "moe-test", "--resume"])
    message = refusal(argv)
    assert message.startswith("the checkpoint at step 2 was saved with a different model: "), message
    fixed = applied(argv, shlex.split(message.split("; resume with ")[1].split(", or use another")[0]))
    assert "moe-test" not in fixed and refusal(fixed) is None, fixed


def test_the_suggestion_reader_reads_each_form():
    """The parsing the test above relies on, on messages of each form (so a broken reader cannot pass it)."""
    assert suggested("--seed -1: must be in 0..9, e.g. --seed 0") == ["--seed", "0"]
    assert suggested("x; pass --set vocab_size=384 (or not)") == ["--set", "vocab_size=384"]
    assert suggested("--microbatches 1: fewer; use --microbatches 2") == ["--microbatches", "2"]
    assert suggested("e.g. --mesh data=2 --rules dp, or --hetero-batch off") == ["--mesh", "data=2", "--rules", "dp"]
    assert applied(["--mesh", "a=1", "--set", "x=1"], ["--mesh", "b=2", "--set", "y=2", "--resume"]) == [
        "--mesh",
        "b=2",
        "--set",
        "x=1",
        "--set",
        "y=2",
        "--resume",
    ]


INFERENCE_CASES = [
    ("evaluate", ["--data", "{prepared_bytes}"]),  # prepared with bytes: "pass --tokenizer bytes"
    ("generate", ["--max-new-tokens", "100000000"]),  # beyond the 256 positions
    ("generate", ["--mesh", "stage=2,tensor=4"]),  # no pipeline in generation: the stage's devices to fsdp
]


@pytest.mark.parametrize("entry, flags", INFERENCE_CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in INFERENCE_CASES])
def test_the_suggestions_of_evaluate_and_generate_are_accepted(tmp_path, capsys, entry, flags):
    """The same round trip through the other entry points' own main (exit 2 and one line, then exit 0)."""
    from test_hf import FIXTURES

    from train import evaluate, generate
    from train.data.prepare import prepare as prepare_data
    from train.data.tokenizer import ByteTokenizer

    if "{prepared_bytes}" in flags:
        (tmp_path / "src").mkdir()
        for i in range(8):
            (tmp_path / "src" / f"{i}.txt").write_text(f"document {i} of some text " * 20)
        quiet = dict(workers=1, heldout=0.5, log=lambda _: None, progress=False)
        prepare_data([str(tmp_path / "src")], tmp_path / "p", ByteTokenizer(), **quiet)
        flags = [str(tmp_path / "p") if f == "{prepared_bytes}" else f for f in flags]
    main = {"evaluate": evaluate.main, "generate": generate.main}[entry]
    base = ["--hf", str(FIXTURES / "llama_gqa")]
    base += ["--seq-len", "16", "--batch-size", "2", "--batches", "1"] if entry == "evaluate" else ["--prompt", "hi"]
    argv = applied(base, flags)
    assert main(argv) == 2
    message = capsys.readouterr().err.strip()
    assert message.count("\n") == 0, message
    fixed = applied(argv, suggested(message))
    if entry == "generate":  # a suggested length is accepted by the checks; generating it all is not needed here
        fixed = applied(fixed, ["--max-new-tokens", "2"]) if "--max-new-tokens" not in flags else fixed
    assert main(fixed) == 0, f"{message}\n-> {shlex.join(fixed)}\n-> {capsys.readouterr().err}"


@pytest.mark.parametrize(
    "saved, now",
    [
        (["--init-from", "{llama}", "--lora-rank", "8"], ["--init-from", "{llama}", "--lora-rank", "4"]),
        (["--init-from", "{llama}", "--lora-rank", "8"], ["--init-from", "{tied}", "--lora-rank", "8"]),
        (["--model", "test", "--lora-rank", "8"], ["--model", "test", "--set", "num_layers=2", "--lora-rank", "2"]),
        (["--model", "test"], ["--model", "test", "--lora-rank", "4", "--lora-targets", "q,v"]),
    ],
    ids=["imported, another rank", "imported, another folder", "preset, another rank and depth", "adapters added"],
)
def test_the_resume_checks_suggestion_is_accepted(tmp_path, corpus, cache, saved, now):
    """A resume refused for another model suggests flags that the command accepts and that rebuild the saved
    model: an imported model's folder as --init-from (not a --model it refuses), adapters by their own flags."""
    from test_hf import FIXTURES

    from checkpoints.meta import RunMeta

    no_tokenizer = SimpleNamespace(name="", fingerprint="", vocab_size=0)  # the metadata records none to compare
    folders = {"{llama}": str(FIXTURES / "llama_gqa"), "{tied}": str(FIXTURES / "llama_tied")}
    base = ["--seq-len", "16", "--batch-size", "8", "--steps", "2", "--data", str(corpus), "--data-cache", str(cache)]
    base += ["--run-dir", str(tmp_path / "r")]

    def config(flags):
        return cli.parse([*base, *(folders.get(f, f) for f in flags)])

    first = config(saved)
    meta = RunMeta(first.model.to_dict(), first.preset, {}, {}, {}, {})
    argv = [*base, *(folders.get(f, f) for f in now)]
    with pytest.raises(ValueError) as refused:
        meta.check_compatible(cli.parse(argv).model, no_tokenizer, step=2)
    message = render(refused.value)
    flags = re.search(r"resume with (--.*?), or use another", message).group(1)
    flags, _, dropped = flags.partition(", leaving out ")
    fixed = applied(argv, flags.split())
    for flag in dropped.split():  # each with its value
        at = fixed.index(flag)
        del fixed[at : at + 2]
    assert refusal(fixed) is None, f"{message}\n-> {shlex.join(fixed)}\n-> {refusal(fixed)}"
    meta.check_compatible(cli.parse(fixed).model, no_tokenizer, step=2)  # the saved model again
