"""Tokenizers: raw UTF-8 bytes by default, or a ``tokenizer.json`` via the `tokenizers` library.

Both expose ``vocab_size``, ``eod_id`` (the end-of-document token that
separates packed documents), ``encode_batch``, ``encode_offsets``, ``decode`` and a
``fingerprint`` (compared when a run resumes).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# Candidates for the end-of-document token, in order of preference.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


class ByteTokenizer:
    """Each UTF-8 byte is a token (0..255); token 256 ends a document."""

    name = "bytes"
    vocab_size = 257
    eod_id = 256
    fingerprint = "bytes-v1"

    def encode_batch(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        """UTF-8 encoded documents -> uint32 token arrays (without the EOD token)."""
        return [np.frombuffer(doc, dtype=np.uint8).astype(np.uint32) for doc in docs]

    def encode_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        """Prompts' UTF-8 bytes as token ids (no special tokens: this tokenizer has none to add)."""
        return [list(text.encode("utf-8")) for text in texts]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, starts)``: uint32 tokens of ``text`` and the index of the character each token starts in."""
        data = text.encode("utf-8")
        widths = [len(c.encode("utf-8")) for c in text]
        return np.frombuffer(data, np.uint8).astype(np.uint32), np.repeat(np.arange(len(text)), widths)

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def save_json(self, path: str | Path) -> Path:
        """Writes the same tokenizer as a ``tokenizer.json`` that `tokenizers` and ``transformers`` load.

        A BPE model with no merges whose vocabulary is the 256 byte tokens ``<0x00>``..``<0xFF>`` (ids 0..255,
        as here) and byte fallback, so every character becomes its UTF-8 bytes, as in Llama's tokenizer for
        characters outside its vocabulary; ``<|endoftext|>`` is the special token 256. Decoding fuses the bytes
        back into text.

        Args:
          path: the file to write.

        Returns:
          ``path``.
        """
        from tokenizers import AddedToken, Tokenizer, decoders, models

        tok = Tokenizer(models.BPE(vocab={f"<0x{b:02X}>": b for b in range(256)}, merges=[], byte_fallback=True))
        tok.add_special_tokens([AddedToken(EOD_CANDIDATES[0], special=True)])
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
        tok.save(str(path))
        return Path(path)


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the Hugging Face `tokenizers` library.

    Args:
      path: the ``tokenizer.json`` file.
      eod_token: the token that ends documents; default: the first of
        `EOD_CANDIDATES` the vocabulary has.

    Raises:
      FileNotFoundError: when the file does not exist.
      ValueError: when the file cannot be parsed, or no end-of-document token
        is found (the message says to pass ``--eod-token``).
    """

    def __init__(self, path: str | Path, eod_token: str | None = None):
        from tokenizers import Tokenizer

        path = Path(path)
        if path.is_dir() and (path / "tokenizer.json").is_file():  # a model folder given for its tokenizer
            raise FileNotFoundError(
                f"--tokenizer {path}: a folder; give its tokenizer.json, e.g. --tokenizer {path / 'tokenizer.json'}"
            )
        if not path.is_file():
            raise FileNotFoundError(f"--tokenizer {path}: no such file (give a tokenizer.json)")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own exception types
            raise ValueError(f"--tokenizer {path}: cannot load it as a tokenizer.json ({e})") from None
        self.name = str(path)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        candidates = (eod_token,) if eod_token else EOD_CANDIDATES
        for token in candidates:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                self.eod_id = int(token_id)
                self.eod_token = token
                break
        else:
            raise ValueError(self._no_eod(path, eod_token))
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        self.fingerprint = f"hf-{digest}-eod{self.eod_id}"

    def _no_eod(self, path: Path, eod_token: str | None) -> str:
        """The message for a vocabulary without the end-of-document token, with one it has if any."""
        found = [t for t in EOD_CANDIDATES if self._tokenizer.token_to_id(t) is not None and t != eod_token]
        if eod_token is None:
            return (
                f"--tokenizer {path}: no end-of-document token among {', '.join(EOD_CANDIDATES)}; pass "
                f"--eod-token with a token of its vocabulary"
            )
        hint = f"e.g. --eod-token '{found[0]}'" if found else "give a token of its vocabulary"
        return f"--eod-token {eod_token}: not in the vocabulary of --tokenizer {path}; {hint}"

    def encode_batch(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        """UTF-8 documents -> uint32 token arrays (without the EOD token)."""
        texts = [doc.decode("utf-8", errors="replace") for doc in docs]
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def encode_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        """Prompts tokenized as transformers' fast tokenizers do by default (``tokenizer(text)``, that is
        ``add_special_tokens=True``): the ``tokenizer.json`` post-processor adds its special tokens (a
        beginning-of-sequence token, or none), and ``add_bos_token`` of a ``tokenizer_config.json`` beside the
        file, when set, adds or removes its ``bos_token`` in front (as ``LlamaTokenizerFast`` rebuilds its
        post-processor from it). So a model folder whose ``config.json`` names a ``bos_token_id`` that its
        tokenizer does not add gets no BOS, as in transformers."""
        ids = [list(e.ids) for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=True)]
        add, bos = self._bos_setting()
        if add is None or bos is None:
            return ids
        if add:
            return [p if p[:1] == [bos] else [bos, *p] for p in ids]
        return [p[1:] if p[:1] == [bos] else p for p in ids]

    def _bos_setting(self) -> tuple[bool | None, int | None]:
        """``(add_bos_token, bos id)`` of the ``tokenizer_config.json`` beside the file (None: not set)."""
        config_path = Path(self.name).with_name("tokenizer_config.json")
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except (OSError, ValueError) as e:
            raise ValueError(f"--tokenizer {self.name}: {config_path} is not JSON ({e})") from None
        add, token = config.get("add_bos_token"), config.get("bos_token")
        token = token.get("content") if isinstance(token, dict) else token
        bos = self._tokenizer.token_to_id(token) if isinstance(token, str) else None
        return (add if isinstance(add, bool) else None), bos

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, starts)``: uint32 tokens of ``text`` (special tokens written in it included, as transformers
        tokenizes a rendered chat template) and the character offset each token starts at."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return np.asarray(encoding.ids, np.uint32), np.asarray([s for s, _ in encoding.offsets], np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


def load_tokenizer(path: str | None, eod_token: str | None = None):
    """`ByteTokenizer` when ``path`` is None or ``bytes``, else `HFTokenizer`."""
    if path in (None, "", "bytes"):
        return ByteTokenizer()
    return HFTokenizer(path, eod_token)


def tokenizer_of(saved: dict):
    """The tokenizer a checkpoint's metadata names (`checkpoints.meta.RunMeta.tokenizer`), with its end-of-document id.

    Raises:
      FileNotFoundError: The ``tokenizer.json`` it names is gone (pass ``--tokenizer``).
    """
    name = saved.get("name")
    if name in (None, "", "bytes"):
        return ByteTokenizer()
    eod = None
    if saved.get("eod_id") is not None and Path(name).is_file():
        from tokenizers import Tokenizer

        try:
            eod = Tokenizer.from_file(str(name)).id_to_token(int(saved["eod_id"]))
        except Exception:  # not a tokenizer (any more): HFTokenizer below says so in one line
            eod = None
    return HFTokenizer(name, eod)
