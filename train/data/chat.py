"""Chat and instruction data: conversations rendered into text with a chat template, and where the assistant
speaks (the only tokens a chat example is trained on).

A conversation is a JSONL line with a ``messages`` list of ``{"role": ..., "content": ...}`` objects. It is
rendered as Hugging Face transformers renders ``apply_chat_template`` (``PreTrainedTokenizerBase``'s
documented behaviour): the tokenizer folder's template, from ``chat_template.jinja`` beside the
``tokenizer.json`` or else the ``chat_template`` of its ``tokenizer_config.json`` (a string, or a list of
``{"name", "template"}`` of which the one named ``default`` is used), compiled by jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``tojson`` filter that keeps non-ASCII characters, the globals ``raise_exception`` and ``strftime_now``, the
special tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...) as variables, and
``add_generation_prompt``. transformers' ``{% generation %}...{% endgeneration %}`` tag renders its body and
marks it as the assistant's (what ``apply_chat_template(..., return_assistant_tokens_mask=True)`` reads).

A tokenizer without a template (the bytes tokenizer, or a folder without one) uses `FALLBACK_TEMPLATE`: each
message as ``<|ROLE|>`` on a line of its own followed by the content and a newline.

The assistant's characters: in a template with ``{% generation %}`` blocks, the characters those blocks
render, as transformers reads them; in one without, for each assistant message ``k``, the text that rendering
``messages[:k + 1]`` adds to rendering ``messages[:k]`` with the generation prompt (its content and the
template's end-of-turn marker). That prefix method needs a template that renders earlier turns the same
whatever follows them (the usual case); one that rewrites history (e.g. drops earlier reasoning) is refused,
naming the template, unless it marks its assistant turns with ``{% generation %}``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from datetime import datetime
from pathlib import Path

JINJA_EXTRA = "pip install 'meshwork[data]'"

FALLBACK_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# Around what a {% generation %} block renders, removed from the text once its place is read (Unicode
# private-use characters: no tokenizer's text holds them, and a conversation that does is refused).
GENERATION_OPEN, GENERATION_CLOSE = "\uf8f0", "\uf8f1"
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class ChatTemplate:
    """A compiled chat template and the variables it renders with.

    Args:
      source: the template text (jinja2).
      origin: where it came from (a file, or ``fallback``), for messages.
      variables: extra variables (the special tokens).

    Raises:
      ImportError: jinja2 is missing (names the extra that installs it).
      ValueError: the template does not compile (names ``origin``).
    """

    def __init__(self, source: str, origin: str, variables: dict | None = None):
        self.source, self.origin, self.variables = source, origin, dict(variables or {})
        self.marks_generation = bool(GENERATION_TAG.search(source))
        """Whether the template marks the assistant's turns with ``{% generation %}`` (read instead of the
        prefix method)."""
        method = "generation" if self.marks_generation else "prefix"  # how masks were found is part of the tokens
        self.fingerprint = hashlib.sha256(json.dumps([source, self.variables, method]).encode()).hexdigest()[:16]
        self._template = _compile(source, origin)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The text of ``messages``.

        Raises:
          ValueError: the template raised (``raise_exception``) or failed (names ``origin``).
        """
        return self._render_marked(messages, add_generation_prompt)[0]

    def _render_marked(self, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the text and the ``[start, stop)`` character ranges ``{% generation %}`` blocks
        rendered (the blocks' marks removed from the text)."""
        try:
            marked = self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.variables,
            )
        except Exception as e:  # jinja2 and the template's own raise_exception
            raise ValueError(f"the chat template {self.origin} failed on a conversation ({e})") from None
        if not self.marks_generation:
            return marked, []
        pieces, spans, at, inside = [], [], 0, False
        for part in re.split(f"([{GENERATION_OPEN}{GENERATION_CLOSE}])", marked):
            if part in (GENERATION_OPEN, GENERATION_CLOSE):
                if inside == (part == GENERATION_OPEN):
                    raise ValueError(
                        f"the chat template {self.origin}: its {{% generation %}} blocks cannot be located (nested "
                        "blocks, or a conversation holding the characters U+F8F0/U+F8F1)"
                    )
                inside = part == GENERATION_OPEN
                if inside:
                    spans.append((at, at))
                else:
                    spans[-1] = (spans[-1][0], at)
                continue
            pieces.append(part)
            at += len(part)
        if inside:
            raise ValueError(f"the chat template {self.origin}: a {{% generation %}} block is not closed")
        return "".join(pieces), [span for span in spans if span[1] > span[0]]

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the rendered conversation and the ``[start, stop)`` character ranges of its
        assistant turns (see the module docstring): what its ``{% generation %}`` blocks render, or else found
        by the prefix method.

        Raises:
          ValueError: the template fails, or (prefix method) renders an earlier turn differently once later
            turns follow it.
        """
        if self.marks_generation:
            return self._render_marked(messages, False)
        text = self.render(messages)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:k], add_generation_prompt=True) if k else self._prompt_only()
            through = self.render(messages[: k + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(
                    f"the chat template {self.origin} renders earlier turns differently once later ones follow, so "
                    "the assistant's tokens cannot be located; use a template that keeps earlier turns as they are"
                )
            spans.append((len(before), len(through)))
        return text, spans

    def _prompt_only(self) -> str:
        try:
            return self.render([], add_generation_prompt=True)
        except ValueError:  # a template that refuses an empty conversation: the assistant opens the text
            return ""


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    import markupsafe

    return markupsafe.Markup(
        json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    )


def _raise(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError(f"rendering chat data needs jinja2; {JINJA_EXTRA}") from None

    class Generation(jinja2.ext.Extension):
        """transformers' ``{% generation %}`` block: renders its body between `GENERATION_OPEN` and
        `GENERATION_CLOSE` (`ChatTemplate` reads and removes them)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return GENERATION_OPEN + caller() + GENERATION_CLOSE

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile(source: str, origin: str):
    try:
        return _environment().from_string(source)
    except ImportError:
        raise
    except Exception as e:  # jinja2's TemplateSyntaxError
        raise ValueError(f"the chat template {origin} does not compile ({e})") from None


def load_chat_template(tokenizer) -> ChatTemplate:
    """The chat template of a `train.data.tokenizer` tokenizer: its folder's (see the module docstring), else
    `FALLBACK_TEMPLATE`.

    Raises:
      ValueError: an unreadable ``tokenizer_config.json`` or a template that does not compile (named).
      ImportError: jinja2 is missing.
    """
    name = getattr(tokenizer, "name", "bytes")
    folder = None if name == "bytes" else Path(name).parent
    if folder is None:
        return ChatTemplate(FALLBACK_TEMPLATE, "fallback")
    config_path = folder / "tokenizer_config.json"
    config = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except ValueError as e:
            raise ValueError(f"--tokenizer {name}: {config_path} is not JSON ({e})") from None
    variables = {}
    for key in SPECIAL_TOKENS:
        token = config.get(key)
        if isinstance(token, dict):  # an AddedToken written out
            token = token.get("content")
        if isinstance(token, str):
            variables[key] = token
    jinja_file = folder / "chat_template.jinja"
    source = config.get("chat_template")
    if isinstance(source, list):
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(), str(jinja_file), variables)
    if isinstance(source, str):
        return ChatTemplate(source, str(config_path), variables)
    return ChatTemplate(FALLBACK_TEMPLATE, "fallback", variables)


def check_messages(messages, where: str) -> list[dict]:
    """``messages`` checked to be a non-empty list of objects with string ``role`` and ``content``.

    Raises:
      ValueError: naming ``where`` (the file and byte offset) and what is wrong.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': ..., 'content': ...}} objects")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(
                f"{where}: message {i} needs string 'role' and 'content' fields, e.g. "
                '{"role": "user", "content": "Hello"}'
            )
    return messages
