"""Preference pairs for DPO (`train.runtime.dpo`): JSONL records ``{"prompt", "chosen", "rejected"}``.

``prompt`` is a string (one user turn) or a list of chat messages (``{"role", "content"}``); ``chosen`` and
``rejected`` are the two assistant replies (strings). Each side is the conversation ``prompt + [reply]``
rendered by the tokenizer's chat template, and its loss mask marks the assistant's tokens, exactly as a chat
example for supervised fine-tuning (`train.data.prepare.chat_tokens`, docs/data.md). Assistant turns inside
the prompt are marked too; they are the same tokens on both sides, so they cancel in DPO's margin.

A pair becomes one row of ``2 * half`` tokens, ``[chosen | rejected]``, each side padded to ``half`` (its
inputs are its tokens but the last, its targets the tokens from the second on): segment ids 1 and 2, positions
from 0 on each side, ``loss_mask`` 1 on the targets inside the reply. A pair is held out when
`train.data.corpus.is_heldout` says so of ``PATH@LINE`` for the seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from train.data.chat import load_chat_template
from train.data.corpus import is_heldout
from train.data.prepare import chat_tokens


def _side(ids: np.ndarray, mask: np.ndarray, half: int, segment: int) -> dict[str, np.ndarray]:
    """One side's fields, ``[half]`` each, padded after its tokens."""
    n = len(ids) - 1
    out = {
        "tokens": np.zeros(half, np.int32),
        "targets": np.zeros(half, np.int32),
        "loss_mask": np.zeros(half, np.float32),
        "positions": np.arange(half, dtype=np.int32),
        "segment_ids": np.full(half, segment, np.int32),
    }
    out["tokens"][:n], out["targets"][:n] = ids[:-1], ids[1:]
    out["loss_mask"][:n] = mask[1:]
    return out


def _messages(record: dict, where: str) -> tuple[list[dict], str, str]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: not a JSON object; a preference record is {{'prompt', 'chosen', 'rejected'}}")
    for key in ("prompt", "chosen", "rejected"):
        if key not in record:
            raise ValueError(f"{where}: no {key!r}; a preference record is {{'prompt', 'chosen', 'rejected'}}")
    prompt = record["prompt"]
    if not (
        isinstance(prompt, str)
        or isinstance(prompt, list)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt)
    ):
        raise ValueError(f"{where}: 'prompt' must be a string or a list of chat messages {{'role', 'content'}}")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if not all(isinstance(record[k], str) for k in ("chosen", "rejected")):
        raise ValueError(f"{where}: 'chosen' and 'rejected' must be strings (the two assistant replies)")
    return messages, record["chosen"], record["rejected"]


def load_pairs(path: str | Path, tokenizer, half: int, seed: int = 0, heldout: float = 0.1) -> dict[str, dict]:
    """Reads, renders and lays out a preference JSONL file.

    Args:
      path: The JSONL file.
      tokenizer: The run's tokenizer (its chat template, `train.data.chat.load_chat_template`).
      half: Tokens of one side of a row (``--seq-len``); a row is ``2 * half``.
      seed, heldout: Which pairs are held out (module docstring).

    Returns:
      ``{"train": fields, "heldout": fields}``, each field ``[pairs, 2 * half]`` (module docstring).

    Raises:
      ValueError: A line that is not a preference record; or sides longer than ``half + 1`` tokens, naming
        the longest one's line and the ``--seq-len`` that fits every side of the file.
    """
    path = Path(path)
    template = load_chat_template(tokenizer)
    rows: dict[str, list] = {"train": [], "heldout": []}
    longest = None  # (tokens a side needs, where) of the longest side over --seq-len: one refusal for the file
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        messages, chosen, rejected = _messages(record, where)
        sides = []
        for segment, reply in ((1, chosen), (2, rejected)):
            ids, mask = chat_tokens(messages + [{"role": "assistant", "content": reply}], template, tokenizer, where)
            if len(ids) - 1 > half:
                if longest is None or len(ids) - 1 > longest[0]:
                    longest = (len(ids) - 1, where)
                continue
            sides.append(_side(np.asarray(ids), np.asarray(mask, np.float32), half, segment))
        if longest is not None:
            continue
        split = "heldout" if is_heldout(f"{path.name}@{number}", seed, heldout) else "train"
        rows[split].append({k: np.concatenate([sides[0][k], sides[1][k]]) for k in sides[0]})
    if longest is not None:  # a side's inputs are its tokens but the last: n tokens need --seq-len n - 1
        need, where = longest
        raise ValueError(
            f"{where}: the longest side, {need + 1} tokens, does not fit --seq-len {half}; e.g. --seq-len {need}"
        )
    return {
        split: {k: np.stack([r[k] for r in found]) for k in found[0]} if found else {} for split, found in rows.items()
    }
