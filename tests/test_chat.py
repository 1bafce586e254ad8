"""Chat data: rendering equals transformers' apply_chat_template on the fixture tokenizers (made by
tests/fixtures/chat/make_fixtures.py), the assistant-token mask equals transformers' generation mask, and a
prepared chat corpus trains only on the assistant's tokens, one example per segment."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from train.data import load_dataset, pack_windows
from train.data.chat import FALLBACK_TEMPLATE, load_chat_template
from train.data.corpus import is_heldout
from train.data.prepare import chat_tokens, prepare
from train.data.tokenizer import ByteTokenizer, load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "chat"
QUIET = dict(log=lambda _: None, progress=False)


def fixture(name):
    tokenizer = load_tokenizer(str(FIXTURES / name / "tokenizer.json"))
    return tokenizer, json.loads((FIXTURES / name / "reference.json").read_text())


@pytest.mark.parametrize("name", ["chatml", "headers"])
def test_rendering_and_tokens_equal_transformers(name):
    tokenizer, reference = fixture(name)
    template = load_chat_template(tokenizer)
    assert template.origin.endswith("tokenizer_config.json")
    for entry in reference:
        assert template.render(entry["messages"]) == entry["text"]
        assert template.render(entry["messages"], add_generation_prompt=True) == entry["prompt"]
        ids, mask = chat_tokens(entry["messages"], template, tokenizer, "here")
        assert ids.tolist() == entry["ids"]
        if "assistant_masks" in entry:  # the template marks the assistant's turns for transformers
            assert mask.astype(int).tolist() == entry["assistant_masks"]
        else:
            # Found by searching the text instead: each reply and its end-of-turn token, after its header.
            _, starts = tokenizer.encode_offsets(entry["text"])
            expected, at = np.zeros(len(ids), bool), 0
            for m in entry["messages"]:
                if m["role"] == "assistant":
                    turn = f"assistant<|end_header_id|>\n\n{m['content']}<|eot_id|>"
                    at = entry["text"].index(turn, at) + len("assistant<|end_header_id|>\n\n")
                    expected |= (starts >= at) & (starts < at + len(turn) - len("assistant<|end_header_id|>\n\n"))
            assert mask.tolist() == expected.tolist() and mask.sum() > 4


def test_template_errors_name_the_template(tmp_path):
    tokenizer, reference = fixture("headers")
    template = load_chat_template(tokenizer)
    with pytest.raises(ValueError, match=r"chat template .*tokenizer_config.json failed .*unknown role"):
        template.render([{"role": "tool", "content": "x"}])
    folder = tmp_path / "rewrites"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((FIXTURES / "chatml" / "tokenizer.json").read_bytes())
    # A template that shows only the last assistant turn rewrites history: refused, not mis-masked.
    rewrite = "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}|{% endif %}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": rewrite}))
    messages = reference[1]["messages"]
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        load_chat_template(load_tokenizer(str(folder / "tokenizer.json"))).assistant_spans(messages)


def test_generation_blocks_give_the_assistant_span_where_the_template_has_them(tmp_path):
    """A template with ``{% generation %}`` is read for its blocks (the chatml fixture: transformers' mask is
    checked above), so one that rewrites history is accepted when it marks the assistant's turn; blocks that
    cannot be located are refused, naming the template."""
    tokenizer, reference = fixture("chatml")
    assert load_chat_template(tokenizer).marks_generation
    assert not load_chat_template(fixture("headers")[0]).marks_generation
    folder = tmp_path / "rewrites"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((FIXTURES / "chatml" / "tokenizer.json").read_bytes())
    rewrite = (
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}|"
        "{% elif loop.last %}<{% generation %}{{ m['content'] }}|{%- endgeneration %}>{% endif %}{% endfor %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": rewrite}))
    template = load_chat_template(load_tokenizer(str(folder / "tokenizer.json")))
    messages = reference[1]["messages"]  # system, user, assistant, user, assistant
    text, spans = template.assistant_spans(messages)
    contents = [m["content"] for m in messages]
    expected = "|".join(contents[:2]) + "|" + contents[3] + "|<" + contents[4] + "|>"
    assert text == expected == template.render(messages)
    assert spans == [(expected.index("<") + 1, len(expected) - 1)]
    tokenizer = load_tokenizer(str(folder / "tokenizer.json"))
    ids, mask = chat_tokens(messages, template, tokenizer, "here")
    _, starts = tokenizer.encode_offsets(text)
    (learned,) = np.nonzero(mask)  # the tokens of the last reply and its "|", one run of them
    assert learned.tolist() == list(range(learned[0], len(ids) - 1))  # every token up to the closing ">"
    assert (starts[learned[0]], starts[learned[-1] + 1]) == spans[0]
    nested = "{% generation %}{% generation %}{{ messages[0]['content'] }}{% endgeneration %}{% endgeneration %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": nested}))
    with pytest.raises(
        ValueError, match=r"chat template .*tokenizer_config.json: its \{% generation %\} blocks cannot"
    ):
        load_chat_template(load_tokenizer(str(folder / "tokenizer.json"))).assistant_spans(messages)


def test_fallback_template_for_the_bytes_tokenizer():
    template = load_chat_template(ByteTokenizer())
    assert template.source == FALLBACK_TEMPLATE
    messages = [{"role": "user", "content": "hé?"}, {"role": "assistant", "content": "oui"}]
    assert template.render(messages) == "<|user|>\nhé?\n<|assistant|>\noui\n"
    ids, mask = chat_tokens(messages, template, ByteTokenizer(), "here")
    assert bytes(ids[mask].astype(np.uint8)) == b"oui\n"
    assert bytes(ids.astype(np.uint8)).decode() == template.render(messages)


def write_chat(path, n=24):
    lines = []
    for i in range(n):
        messages = [
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"{2 * i}."},
        ]
        if i % 3 == 0:
            messages += [{"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes, sure."}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return [json.loads(line)["messages"] for line in lines]


def test_prepared_chat_trains_only_on_assistant_tokens(tmp_path):
    tokenizer, _ = fixture("chatml")
    conversations = write_chat(tmp_path / "chat.jsonl")
    manifest = prepare([str(tmp_path / "chat.jsonl")], tmp_path / "p", tokenizer, heldout=0.2, workers=1, **QUIET)
    assert manifest["loss_mask"] and manifest["chat_template"].endswith("tokenizer_config.json")
    # The same tokens in memory: each training conversation's tokens and mask, then the EOD (never learned).
    template = load_chat_template(tokenizer)
    lines = (tmp_path / "chat.jsonl").read_bytes().splitlines(keepends=True)
    offsets = np.cumsum([0] + [len(line) for line in lines])
    ids, mask = [], []
    for offset, messages in zip(offsets, conversations):
        if not is_heldout(f"chat.jsonl@{offset}", 0, 0.2):
            i, m = chat_tokens(messages, template, tokenizer, "here")
            ids += [i, [tokenizer.eod_id]]
            mask += [m, [False]]
    stream, stream_mask = np.concatenate(ids).astype(np.int64), np.concatenate(mask)
    T, B = 16, 4
    ds = load_dataset(str(tmp_path / "p"), tokenizer, T, B, seed=0, log=lambda _: None)
    assert ds.train.num_windows == (len(stream) - 1) // T
    for step in range(3):
        batch = ds.train_rows(step * B, range(B))
        starts = [ds.train_orders[0][step * B + r] * T for r in range(B)]
        windows = np.stack([stream[s : s + T + 1] for s in starts])
        expected = pack_windows(windows, tokenizer.eod_id, np.stack([stream_mask[s : s + T + 1] for s in starts]))
        for field, value in expected.items():
            np.testing.assert_array_equal(batch[field], value, err_msg=f"step {step} {field}")
        # Loss only on assistant tokens: every learned target is one the mask marks, and some are.
        learned = batch["targets"][batch["loss_mask"] > 0]
        assert learned.size and tokenizer.eod_id not in learned
    user = [m for c in conversations for m in c if m["role"] == "user"]
    assert user  # the user's words are never a learned target
    for step in range(ds.train.num_windows // B):
        batch = ds.train_rows(step * B, range(B))
        assert not (batch["loss_mask"][batch["targets"] == tokenizer.eod_id]).any()


def test_bad_chat_lines_and_missing_jinja2_are_refused(tmp_path, monkeypatch):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" + '{"messages": "hi"}\n')
    with pytest.raises(ValueError, match=r"chat.jsonl: the line at byte \d+: 'messages' must be a non-empty list"):
        prepare([str(path)], tmp_path / "p", ByteTokenizer(), workers=1, **QUIET)
    path.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(ValueError, match="message 0 needs string 'role' and 'content'"):
        prepare([str(path)], tmp_path / "q", ByteTokenizer(), workers=1, **QUIET)
    import train.data.chat as chat

    chat._environment.cache_clear()
    monkeypatch.setitem(sys.modules, "jinja2", None)
    try:
        with pytest.raises(ImportError, match=r"needs jinja2; pip install 'meshwork\[data\]'"):
            load_chat_template(ByteTokenizer())
    finally:
        chat._environment.cache_clear()


def test_chat_data_without_assistant_text_is_refused_and_partial_drops_are_counted(tmp_path, capsys):
    path = tmp_path / "noassist.jsonl"
    user_only = [{"role": "user", "content": f"hello {i}"} for i in range(3)]
    path.write_text("".join(json.dumps({"messages": [m]}) + "\n" for m in user_only))
    with pytest.raises(ValueError, match=r"noassist.jsonl: none of its 3 conversations has an assistant turn"):
        prepare([str(path)], tmp_path / "p", ByteTokenizer(), workers=1, **QUIET)
    # Training reads the same preparation: the same line before any device work.
    from train.data.prepare import main as prepare_main

    assert prepare_main(["prepare", str(path), "--out", str(tmp_path / "cli"), "--workers", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: SRC {path}: none of its 3 conversations")
    conversations = write_chat(tmp_path / "some.jsonl", n=12)
    with (tmp_path / "some.jsonl").open("a") as f:
        f.write(json.dumps({"messages": user_only[:1]}) + "\n")
        f.write(json.dumps({"messages": user_only[1:]}) + "\n")
    lines = []
    manifest = prepare(
        [str(tmp_path / "some.jsonl")], tmp_path / "q", ByteTokenizer(), workers=1, log=lines.append, progress=False
    )
    assert manifest["dropped_docs"] == 2 and manifest["train_docs"] + manifest["heldout_docs"] == len(conversations)
    assert "dropped 2 of 14 conversations with no assistant text (no token to train on)" in lines
