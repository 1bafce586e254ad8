"""Generation with a key/value cache: against full forward passes and against transformers' greedy continuation."""

import jax
import numpy as np
import pytest
from _cli_errors import raises_as_cli
from test_hf import FIXTURES, load, reference

from models.generation import Generator, Sampling, sample
from models.transformer import apply


@pytest.fixture(scope="module")
def gqa():
    config, graphdef, params, par = load(FIXTURES / "llama_gqa", "data=2,tensor=4")
    return config, graphdef, params, par, Generator(config, graphdef, params, par)


@pytest.mark.parametrize(
    "name, mesh",
    [
        ("llama_gqa", "data=2,tensor=4"),
        ("llama_tied", "fsdp=4,tensor=2"),
        ("qwen2", "fsdp=8"),
        # dense and MoE layers alternating (decoding scans their periods), query/key norms, experts' mlp split
        ("qwen3_moe", "tensor=8"),
    ],
)
def test_greedy_reproduces_the_transformers_continuation(name, mesh):
    config, graphdef, params, par = load(FIXTURES / name, mesh)
    ref = reference(name)
    out = Generator(config, graphdef, params, par).generate(ref["prompt"].tolist(), ref["greedy"].shape[1])
    assert out == ref["greedy"].tolist()


def test_greedy_equals_argmax_of_a_full_forward_pass_at_every_step(gqa):
    config, graphdef, params, par, generator = gqa
    prompt = [5, 17, 99, 3, 250, 41, 8]
    new = generator.generate([prompt], 10)[0]
    forward = jax.jit(lambda p, t: apply(graphdef, p, t, par=par))
    sequence = list(prompt)
    for token in new:
        logits = np.asarray(forward(params, np.array([sequence], np.int32)))[0, -1]
        assert token == int(np.argmax(logits))
        sequence.append(token)


def test_cached_logits_equal_the_full_forward_pass(gqa):
    """Prefill + steps: each step's logits are the full pass's at that position (not only the argmax)."""
    from models.generation import init_cache
    from models.transformer import extend

    config, graphdef, params, par, _ = gqa
    tokens = reference("llama_gqa")["tokens"][:2, :12]
    full = np.asarray(apply(graphdef, params, tokens, par=par))
    cache = init_cache(config, 2, 16, par)
    logits, cache = extend(graphdef, params, cache, tokens[:, :8], np.zeros(2, np.int32), par)
    np.testing.assert_allclose(np.asarray(logits), full[:, :8], rtol=1e-5, atol=1e-5)
    for t in range(8, 12):
        logits, cache = extend(graphdef, params, cache, tokens[:, t : t + 1], np.full(2, t, np.int32), par)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[:, t], rtol=1e-5, atol=1e-5)


def test_prompts_of_different_lengths_give_what_each_gives_alone(gqa):
    *_, generator = gqa
    prompts = [[7, 8, 9], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [42], [3, 3, 3, 3, 3]]
    together = generator.generate(prompts, 6)
    alone = [generator.generate([p], 6)[0] for p in prompts]
    assert together == alone


def test_rows_stop_at_the_end_of_document_token(gqa):
    *_, generator = gqa
    prompts = [[5, 17, 99], [1, 2, 3, 4]]
    free = generator.generate(prompts, 8)
    eod = free[0][2]  # pretend the third token of row 0 ends a document
    stopped = generator.generate(prompts, 8, eod_id=eod)
    assert stopped[0] == free[0][:3]
    cut = free[1].index(eod) + 1 if eod in free[1] else len(free[1])
    assert stopped[1] == free[1][:cut]


def test_streaming_callback_sees_each_step():
    seen = []
    config, graphdef, params, par = load(FIXTURES / "llama_tied", "fsdp=8")
    out = Generator(config, graphdef, params, par).generate(
        [[1, 2], [3]], 4, on_tokens=lambda tokens, active: seen.append(tokens[active].tolist())
    )
    assert [step[0] for step in seen] == out[0] and [step[1] for step in seen] == out[1]


def test_sampling_is_seeded_and_respects_top_k():
    logits = jax.numpy.asarray(np.random.default_rng(0).normal(size=(64, 50)).astype(np.float32))
    key = jax.random.key(1)
    a = sample(logits, key, Sampling(temperature=1.0, top_k=3))
    assert np.array_equal(a, sample(logits, key, Sampling(temperature=1.0, top_k=3)))
    top3 = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
    assert all(t in row for t, row in zip(np.asarray(a), top3))
    assert np.array_equal(sample(logits, key, Sampling(temperature=1.0, top_k=1)), np.argmax(logits, -1))


def test_top_p_keeps_the_smallest_nucleus():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two, 0.5 only the first
    logits = jax.numpy.log(jax.numpy.asarray([[0.05, 0.5, 0.15, 0.3]] * 400))
    drawn = np.asarray(sample(logits, jax.random.key(0), Sampling(temperature=1.0, top_p=0.7)))
    assert set(drawn.tolist()) == {1, 3}
    drawn = np.asarray(sample(logits, jax.random.key(0), Sampling(temperature=1.0, top_p=0.5)))
    assert set(drawn.tolist()) == {1}


def test_bad_sampling_values_are_refused():
    with raises_as_cli(ValueError, match="--top-p 0: must be in"):
        Sampling(top_p=0)
    with raises_as_cli(ValueError, match="--temperature -1"):
        Sampling(temperature=-1)


def test_cli_prints_the_greedy_continuation(capsys, tmp_path):
    from tokenizers import Tokenizer

    from train.generate import main

    ref = reference("llama_gqa")
    tok = Tokenizer.from_file(str(FIXTURES / "llama_gqa" / "tokenizer.json"))
    prompt = tok.decode(ref["prompt"][0].tolist())
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{prompt}\n\nab\n")
    assert (
        main(
            [
                "--hf",
                str(FIXTURES / "llama_gqa"),
                "--prompt-file",
                str(prompts),
                "--max-new-tokens",
                "12",
                "--mesh",
                "data=2,tensor=4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "--- prompt 0" and out[1] == prompt + tok.decode(ref["greedy"][0].tolist())
    assert out[2] == "--- prompt 1" and out[3].startswith("ab")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top-k", "-1"], "--top-k -1: must be >= 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be positive"),
        (["--mesh", "data=3"], "--mesh"),
        (
            ["--mesh", "stage=2,tensor=4"],
            "--mesh stage=2,tensor=4: generation runs without pipeline stages; e.g. --mesh fsdp=2,tensor=4",
        ),
        (["--prompt-file", "/nonexistent"], "--prompt-file /nonexistent: no such file"),
        (["--prompt-file", str(FIXTURES)], f"--prompt-file {FIXTURES}: a folder; give a text file of prompts"),
        (["--cpu-devices", "0"], "--cpu-devices 0: must be positive, e.g. --cpu-devices 8"),
    ],
)
def test_cli_bad_flags_end_in_one_line(capsys, flags, message):
    from train.generate import main

    assert main(["--hf", str(FIXTURES / "llama_tied"), "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_an_empty_prompt_file_is_named(capsys, tmp_path):
    from train.generate import main

    (tmp_path / "empty.txt").write_text("\n  \n")
    assert main(["--hf", str(FIXTURES / "llama_tied"), "--prompt-file", str(tmp_path / "empty.txt")]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"error: --prompt-file {tmp_path / 'empty.txt'}: the file has no prompt (it is empty or blank); write one a line\n"
    )


def test_too_many_new_tokens_are_refused_before_the_cache_and_the_suggestion_passes(capsys, gqa, monkeypatch):
    import train.generate as gen
    from train.data.tokenizer import HFTokenizer
    from train.runtime.inference import LoadedModel

    assert gen.main(["--hf", str(FIXTURES / "llama_gqa"), "--prompt", "hi", "--max-new-tokens", "100000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exceed the model's 256 positions (max_position_embeddings)" in err
    suggested = int(err.split("use --max-new-tokens ")[1])
    config, graphdef, params, par, _ = gqa
    tokenizer = HFTokenizer(FIXTURES / "llama_gqa" / "tokenizer.json")
    model = LoadedModel(config, graphdef, params, tokenizer, tokenizer.eod_id, None)
    prompts = gen.prompt_ids(model, ["hi"], special_tokens=True)
    gen.check_length(model, par, prompts, suggested)  # accepted by the same check
    with pytest.raises(ValueError, match="exceed the model's 256 positions"):
        gen.check_length(model, par, prompts, suggested + 1)
    # Memory: a budget that holds the parameters and a cache of 100 positions (by hand: k and v, float32,
    # [layers, 1, S, kv_heads, head_dim] per device on data=2,tensor=4: one row and 2 kv heads split over neither).
    weights = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
    per_position = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    monkeypatch.setattr(gen, "device_memory", lambda devices: (weights + 100 * per_position, "a test budget"))
    with pytest.raises(ValueError, match=r"--max-new-tokens 200: generation cannot fit: .* of a test budget") as e:
        gen.check_length(model, par, prompts, 200)
    fits = int(str(e.value).split("use --max-new-tokens ")[1])
    assert fits == 100 - len(prompts[0])
    gen.check_length(model, par, prompts, fits)
    with pytest.raises(ValueError, match="generation cannot fit"):
        gen.check_length(model, par, prompts, fits + 1)


def test_prompts_start_with_bos_only_when_the_tokenizer_adds_it(tmp_path):
    """transformers' fast tokenizer adds what its post-processor adds (add_special_tokens=True), and
    tokenizer_config.json's add_bos_token overrides it; config.json's bos_token_id alone adds nothing."""
    import json
    import shutil

    from tokenizers import Tokenizer, processors

    from train.data.tokenizer import HFTokenizer
    from train.generate import prompt_ids
    from train.runtime.inference import LoadedModel

    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama_gqa", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "bos_token_id": 1}))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos, texts = tok.id_to_token(1), ["def main(", "x = 1"]
    plain = [tok.encode(t, add_special_tokens=False).ids for t in texts]

    def ids():
        tokenizer = HFTokenizer(folder / "tokenizer.json")
        return prompt_ids(LoadedModel(None, None, None, tokenizer, 0, 1), texts, special_tokens=True)

    assert ids() == plain  # no post-processor, no add_bos_token: no BOS, whatever config.json says
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "add_bos_token": True}))
    assert ids() == [[1, *p] for p in plain]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos}))
    assert ids() == [[1, *p] for p in plain]  # the post-processor's BOS
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "add_bos_token": False}))
    assert ids() == plain
