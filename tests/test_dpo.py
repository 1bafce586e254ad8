"""DPO (`train.runtime.dpo`, `train.data.preference`): the step's loss, metrics and adapter gradients on a sharded
mesh equal a plain computation on one device (each reply run alone, the reference the base weights, the loss
``log(1 + exp(-margin))``); pairs are laid out side by side with the chat template's assistant mask; DPO
without adapters is refused naming the flag."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli_errors import raises_as_cli
from test_chat import fixture
from test_lora import DENSE, _plain_merge, _random_factors

from checkpoints.meta import DPO, NEXT_TOKEN, RunMeta
from models import lora
from models.config import LORA_TARGETS
from models.transformer import abstract_model, apply, init_params
from sharding.errors import ConfigError
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import UNSHARDED, Parallelism
from sharding.rules import get_rules
from train import dpo as dpo_cli
from train.data.chat import load_chat_template
from train.data.preference import load_pairs
from train.data.prepare import chat_tokens
from train.runtime.dpo import DPOTrainer, check_dpo
from train.runtime.optimizer import OptimizerConfig

BETA, HALF, PAIRS = 0.5, 8, 8


def _pairs(seed=0):
    """Rows ``[chosen | rejected]`` of random tokens; each side's reply is its last 3-5 targets."""
    rng = np.random.default_rng(seed)
    fields = {k: [] for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids")}
    for _ in range(PAIRS):
        for segment in (1, 2):
            ids = rng.integers(0, DENSE.vocab_size, HALF + 1)
            mask = np.zeros(HALF, np.float32)
            mask[HALF - rng.integers(3, 6) :] = 1.0
            fields["tokens"].append(ids[:-1])
            fields["targets"].append(ids[1:])
            fields["loss_mask"].append(mask)
            fields["positions"].append(np.arange(HALF))
            fields["segment_ids"].append(np.full(HALF, segment))
    dtypes = {"loss_mask": np.float32}
    return {k: np.stack(v).reshape(PAIRS, 2 * HALF).astype(dtypes.get(k, np.int32)) for k, v in fields.items()}


def _plain(config, params, rows):
    """One device: ``(loss_sum, margins, grads)`` of the summed DPO loss, each reply run as its own sequence."""
    base = config.replace(lora_rank=0, lora_targets="")
    graphdef = abstract_model(base)[0]
    halves = {k: v.reshape(2 * PAIRS, HALF) for k, v in rows.items()}  # chosen, rejected, chosen, ...

    def reply_logps(weights):
        logits = apply(graphdef, weights, halves["tokens"], par=UNSHARDED)
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, halves["targets"][..., None], axis=-1)[..., 0]
        sums = jnp.sum(picked * halves["loss_mask"], axis=1)
        return sums[0::2], sums[1::2]

    reference = reply_logps(_base(params))

    def loss(part):
        chosen, rejected = reply_logps(_plain_merge(lora.with_trainable(config, params, part), lora.scale(config)))
        margins = BETA * ((chosen - reference[0]) - (rejected - reference[1]))
        return jnp.sum(jnp.log1p(jnp.exp(-margins))), margins

    (total, margins), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(lora.trainable(config, params))
    return total, margins, grads


def _base(tree):
    return {k: _base(v) if isinstance(v, dict) else v for k, v in tree.items() if not lora.is_adapter(k)}


def test_dpo_loss_metrics_and_gradients_on_a_mesh_equal_the_plain_computation():
    params = _random_factors(DENSE, init_params(DENSE, jax.random.key(0)))
    rows = _pairs()
    want_loss, margins, want_grads = _plain(DENSE, params, rows)
    par = Parallelism.of(make_mesh(parse_mesh("data=2,fsdp=4", 8)), get_rules("fsdp"))
    trainer = DPOTrainer(DENSE, OptimizerConfig(decay_steps=8, warmup=1), par, BETA)
    placed = jax.device_put(params, trainer.param_shardings)
    batch = jax.device_put({k: jnp.asarray(v) for k, v in rows.items()}, trainer.batch_sharding(PAIRS, 2 * HALF))
    loss_sum, pairs, grads, metrics = jax.jit(lambda p, b: trainer.gradients(p, b))(placed, batch)
    np.testing.assert_allclose(float(loss_sum), float(want_loss), rtol=1e-5)
    assert float(pairs) == PAIRS
    np.testing.assert_allclose(float(metrics["reward_margin"]), float(jnp.mean(margins)), rtol=1e-5, atol=1e-6)
    assert float(metrics["reward_accuracy"]) == float(jnp.mean(margins > 0))
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_pairs_are_laid_out_side_by_side_with_the_assistant_mask(tmp_path):
    tokenizer, _ = fixture("chatml")
    record = {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "I will not."}
    (tmp_path / "p.jsonl").write_text(json.dumps(record) + "\n")
    rows = load_pairs(tmp_path / "p.jsonl", tokenizer, half=64, heldout=0.0)["train"]
    template, messages = load_chat_template(tokenizer), [{"role": "user", "content": record["prompt"]}]
    for side, reply in enumerate((record["chosen"], record["rejected"])):
        ids, mask = chat_tokens(messages + [{"role": "assistant", "content": reply}], template, tokenizer, "test")
        n, cut = len(ids) - 1, slice(side * 64, side * 64 + 64)
        np.testing.assert_array_equal(rows["tokens"][0, cut][:n], ids[:-1])
        np.testing.assert_array_equal(rows["targets"][0, cut][:n], ids[1:])
        np.testing.assert_array_equal(rows["loss_mask"][0, cut][:n], np.asarray(mask[1:], np.float32))
        assert rows["loss_mask"][0, cut][n:].sum() == 0 and rows["loss_mask"][0, cut].sum() > 0
        np.testing.assert_array_equal(rows["positions"][0, cut], np.arange(64))
        assert set(rows["segment_ids"][0, cut]) == {side + 1}


def test_pairs_too_long_name_a_seq_len_that_fits_every_pair(tmp_path):
    """Sides over --seq-len are refused once for the file, naming the longest (a later line than the first
    too long) and a --seq-len that loads the whole file (it named the first line's length, refused next)."""
    tokenizer, _ = fixture("chatml")
    records = [{"prompt": "count", "chosen": " ".join(map(str, range(n))), "rejected": "no"} for n in (8, 30, 20)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError, match=r"p\.jsonl:2: the longest side, \d+ tokens, does not fit --seq-len 16; "):
        load_pairs(tmp_path / "p.jsonl", tokenizer, half=16, heldout=0.0)
    with pytest.raises(ValueError) as refused:
        load_pairs(tmp_path / "p.jsonl", tokenizer, half=16, heldout=0.0)
    fits = int(str(refused.value).split("e.g. --seq-len ")[1])
    assert len(load_pairs(tmp_path / "p.jsonl", tokenizer, half=fits, heldout=0.0)["train"]["tokens"]) == 3
    with pytest.raises(ValueError, match=f"p\\.jsonl:2: .*e\\.g\\. --seq-len {fits}$"):
        load_pairs(tmp_path / "p.jsonl", tokenizer, half=fits - 1, heldout=0.0)  # the least that fits


@pytest.mark.parametrize(
    "record, words",
    [
        ({"prompt": 3, "chosen": "a", "rejected": "b"}, "'prompt' must be a string or a list of chat messages"),
        ({"prompt": ["hi"], "chosen": "a", "rejected": "b"}, "'prompt' must be a string or a list of chat messages"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_a_malformed_pair_names_its_line(tmp_path, record, words):
    """A prompt that is neither text nor messages, or a line that is not an object, is one error naming the
    line (a number as the prompt was a TypeError out of the command)."""
    tokenizer, _ = fixture("chatml")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x", "chosen": "a", "rejected": "b"}) + "\n")
    (tmp_path / "p.jsonl").write_text((tmp_path / "p.jsonl").read_text() + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=rf"p\.jsonl:2: {re.escape(words)}"):
        load_pairs(tmp_path / "p.jsonl", tokenizer, half=64, heldout=0.0)


class _PastTheChecks(Exception):
    """Raised in place of the device set-up: the command line passed every check before it."""


@pytest.mark.parametrize("lines, remedy", [(3, "e.g. --batch-size "), (0, "give more pairs, or another --heldout")])
def test_too_few_pairs_for_the_batch_suggest_a_batch_that_is_accepted(tmp_path, capsys, monkeypatch, lines, remedy):
    """Fewer pairs on a side than --batch-size: the suggested batch is the smaller side's count, which the same
    check then accepts (it was always --batch-size 2: the refused value itself for 2, and any for an empty file)."""

    def past(*_args):
        raise _PastTheChecks

    monkeypatch.setattr(dpo_cli, "setup", past)
    pairs = tmp_path / "p.jsonl"
    record = {"prompt": "count", "chosen": "1 2", "rejected": "no"}
    pairs.write_text("".join(json.dumps(record) + "\n" for _ in range(lines)))
    argv = ["--init-from", "tests/fixtures/hf/llama_gqa", "--data", str(pairs), "--run-dir", str(tmp_path / "r")]
    argv += ["--heldout", "0.5", "--seq-len", "32", "--batch-size", "8"]
    assert dpo_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "fewer" in err and remedy in err, err
    if lines:
        fewest = int(err.split("e.g. --batch-size ")[1])
        assert 1 <= fewest < lines
        with pytest.raises(_PastTheChecks):
            dpo_cli.main([*argv, "--batch-size", str(fewest)])


def test_dpo_holds_the_frozen_base_in_the_dtype_lora_base_dtype_names(tmp_path, capsys, monkeypatch):
    """train.dpo had no --lora-base-dtype (train.train has it, from the same definition): the base stayed
    float32. With bfloat16 the model's field is set, and a short run trains and evaluates on it."""
    from train.runtime import dpo as dpo_runtime

    seen, held = [], set()
    checked, make_step = dpo_runtime.check_dpo, dpo_runtime.DPOTrainer.train_step

    def train_step(trainer, *args):
        step = make_step(trainer, *args)

        def recorded(state, *rest):  # the parameters the step is given: the base's dtype, the factors'
            held.update((lora.is_adapter(k), str(x.dtype)) for k, x in _flat(state["params"]).items())
            return step(state, *rest)

        return recorded

    monkeypatch.setattr(dpo_runtime, "check_dpo", lambda config, beta: (seen.append(config), checked(config, beta)))
    monkeypatch.setattr(dpo_runtime.DPOTrainer, "train_step", train_step)
    pairs = tmp_path / "p.jsonl"
    record = {"prompt": "count", "chosen": "1 2", "rejected": "no"}
    pairs.write_text("".join(json.dumps(record) + "\n" for _ in range(8)))
    argv = ["--init-from", "tests/fixtures/hf/llama_gqa", "--data", str(pairs), "--cpu-devices", "8"]
    argv += ["--heldout", "0.5", "--seq-len", "48", "--batch-size", "2", "--steps", "1", "--lora-rank", "2"]
    assert dpo_cli.main([*argv, "--lora-base-dtype", "bfloat16"]) == 0, capsys.readouterr().err
    assert "held-out preference accuracy" in capsys.readouterr().out
    assert dpo_cli.build_parser().parse_args(argv).lora_base_dtype is None  # not given: the field's float32
    assert seen and {c.lora_base_dtype for c in seen} == {"bfloat16"}
    assert held == {(False, "bfloat16"), (True, "float32")}


def _flat(tree, prefix=""):
    """A nested dict of arrays as ``{"a/b/c": array}``."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {k: v for name, sub in tree.items() for k, v in _flat(sub, f"{prefix}/{name}" if prefix else name).items()}


@pytest.mark.parametrize("beta", [0.0, float("nan")])
def test_dpo_without_adapters_or_with_a_bad_beta_is_refused_naming_the_flag(beta):
    with raises_as_cli(ConfigError, r"add --lora-rank 16"):
        check_dpo(DENSE.replace(lora_rank=0, lora_targets=""), 0.1)
    with raises_as_cli(ConfigError, r"--dpo-beta .*: must be a finite number > 0, e.g. --dpo-beta 0.1"):
        check_dpo(DENSE, beta)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--eval-every", "0"], "--eval-every 0: must be >= 1, e.g. --eval-every 10"),  # was a ZeroDivisionError
        (["--batch-size", "0"], "--batch-size 0: must be >= 1, e.g. --batch-size 8"),
        (["--lora-rank", "0"], "--lora-rank 0: must be >= 1, e.g. --lora-rank 16"),
        (["--steps", "-1"], "--steps -1: must be >= 0, e.g. --steps 100"),
        (["--heldout", "1.5"], "--heldout 1.5: must be a fraction > 0 and < 1, e.g. --heldout 0.2"),
        (["--data", "missing.jsonl"], "--data missing.jsonl: no such file"),
    ],
)
def test_bad_dpo_flags_are_refused_in_one_line_before_any_work(flags, message, tmp_path, capsys):
    """Each bad count or fraction ends as one ``error:`` line naming the flag (exit 2), before the model or
    the data is read; the value each suggests passes the same check."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("")
    base = ["--init-from", "tests/fixtures/hf/missing", "--data", str(pairs)]
    assert dpo_cli.main([*base, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}") and "\n" not in err
    if "e.g. " in message:
        suggested = message.split("e.g. ")[1].split()
        dpo_cli.check_args(dpo_cli.build_parser().parse_args([*base, *suggested]))


class _Saved:
    """A run folder's checkpoint manager, as far as train.dpo reads it before restoring."""

    def __init__(self, config):
        self.meta = {"model": config.architecture(), "preset": "hf:fixture", "objective": "dpo"}

    def latest_step(self):
        return 3

    def read_meta(self, step):
        return self.meta


def _check_resumable(manager, config, run_dir):
    """train.dpo's check of the run folder's newest checkpoint (`checkpoints.meta.RunMeta.check_compatible`)."""
    step = manager.latest_step()
    RunMeta.from_json(manager.read_meta(step)).check_compatible(config, None, step, DPO, run_dir)


def test_dpo_resume_with_other_adapters_names_the_flags_to_resume_with():
    """A resume whose adapters differ from the checkpoint's is refused naming the adapter flags with their
    saved values (it used to fail inside the checkpoint library on the factors' shapes)."""
    saved = _Saved(DENSE)
    _check_resumable(saved, DENSE, "runs/dpo")  # the same adapters continue
    with raises_as_cli(
        ValueError,
        match=r"^--run-dir runs/dpo: its step 3 holds other adapters: --lora-rank "
        r"\(saved 4, now 8\); resume with --lora-rank 4, or use another --run-dir$",
    ):
        _check_resumable(saved, DENSE.replace(lora_rank=8), "runs/dpo")


def test_dpo_resume_with_other_adapters_is_refused_in_one_line_by_the_command(tmp_path, capsys, monkeypatch):
    """train.dpo checks its run folder's newest checkpoint before restoring it, with the one check every
    resume makes (`checkpoints.meta.RunMeta.check_compatible`): other adapters are named with their flags."""
    from checkpoints import hf
    from checkpoints import manager as checkpoints_manager

    base = "tests/fixtures/hf/llama_gqa"
    saved = _Saved(hf.init_config(base, lora_rank=4, lora_alpha=16.0, lora_targets=",".join(LORA_TARGETS)))

    def refuse_restore(*args, **kwargs):
        raise AssertionError("restored a checkpoint whose adapters differ")

    monkeypatch.setattr(checkpoints_manager, "CheckpointManager", lambda *args, **kwargs: saved)
    monkeypatch.setattr(checkpoints_manager, "restore_state", refuse_restore)
    pairs = tmp_path / "p.jsonl"
    record = {"prompt": "count", "chosen": "1 2", "rejected": "no"}
    pairs.write_text("".join(json.dumps(record) + "\n" for _ in range(8)))
    run_dir = tmp_path / "r"
    argv = ["--init-from", base, "--data", str(pairs), "--run-dir", str(run_dir), "--cpu-devices", "8"]
    argv += ["--heldout", "0.5", "--seq-len", "32", "--batch-size", "2", "--lora-rank", "8"]
    assert dpo_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: --run-dir {run_dir}: its step 3 holds other adapters: --lora-rank (saved 4, now 8); resume with "
        "--lora-rank 4, or use another --run-dir"
    )


def test_dpo_and_next_token_runs_do_not_continue_each_other():
    """A run folder of the other command is refused naming the command that continues it and --run-dir:
    continuing it would carry on its step count, and retention deleted the other run's steps. Checkpoints
    saved before the objective was recorded are told apart by their data record (DPO's holds the seed only)."""
    trained = _Saved(DENSE)
    trained.meta = {**trained.meta, "objective": None, "data": {"spec": "corpus", "seq_len": 64, "seed": 0}}
    del trained.meta["objective"]
    assert RunMeta.from_json(trained.meta).objective == NEXT_TOKEN
    with raises_as_cli(ConfigError, r"from a next-token run \(python -m train.train\).*use another --run-dir$"):
        _check_resumable(trained, DENSE, "runs/sft")
    old_dpo = {"model": DENSE.architecture(), "preset": "hf:fixture", "data": {"seed": 0}}
    assert RunMeta.from_json(old_dpo).objective == DPO
    with raises_as_cli(ConfigError, r"from a dpo run \(python -m train.dpo\).*use another --run-dir$"):
        RunMeta.from_json(old_dpo).check_compatible(DENSE, None, 3)  # as train.train --resume checks it
    RunMeta.from_json(old_dpo).check_compatible(DENSE, None, 3, DPO)  # train.dpo continues it
