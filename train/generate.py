"""Generate text from a model: a key/value cache, a jitted prefill and a jitted one-token step.

Continues each prompt until the end-of-document token or ``--max-new-tokens``, with the
parameters and the cache sharded by the rules over ``--mesh`` (`models.generation`). With one
prompt and a terminal, the text streams as tokens arrive; otherwise each prompt's continuation
is printed after a ``--- prompt i`` line.

Examples:
    python -m train.generate --hf tests/fixtures/hf/llama_gqa --prompt "def main(" --max-new-tokens 20
    python -m train.generate --hf MODEL --prompt-file prompts.txt --temperature 0.8 --top-p 0.9 \\
        --mesh data=2,tensor=4 --cpu-devices 8

``--run-dir RUN [--step N]`` reads a meshwork checkpoint instead (model config and tokenizer from its
metadata, parameters restored onto ``--mesh``; see `train.runtime.inference`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from checkpoints.argparser import Parser
from sharding.devices import device_memory
from train.reports.fit import check_peak
from train.runtime.inference import add_device_args, add_source_args, load_model, run_main, setup


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m train.generate",
        description=__doc__.split("\n\n")[0],
    )
    add_source_args(p)
    g = p.add_argument_group("prompts and sampling")
    g.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt; repeatable (one batch)")
    g.add_argument(
        "--prompt-file",
        action="append",
        default=[],
        metavar="FILE",
        help="a file with one prompt per line (blank lines skipped); repeatable",
    )
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="the most new tokens per prompt")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1: all)")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="random seed of the draws")
    g.add_argument("--stats", action="store_true", help="print prefill and decoding throughput to stderr")
    add_device_args(p, default_mesh="data=-1")
    return p


def read_prompts(args) -> list[str]:
    """``--prompt`` texts, then the lines of each ``--prompt-file``.

    Raises:
      ValueError: no prompt at all, or an unreadable file.
    """
    prompts = list(args.prompt)
    for name in args.prompt_file:
        path = Path(name)
        if path.is_dir():
            raise ValueError(f"--prompt-file {name}: a folder; give a text file of prompts, one a line")
        if not path.is_file():
            raise ValueError(f"--prompt-file {name}: no such file; give a text file of prompts, one a line")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"--prompt-file {name}: not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x}); give a text "
                "file of prompts, one a line"
            ) from None
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"--prompt-file {name}: the file has no prompt (it is empty or blank); write one a line")
        prompts += lines
    if not prompts:
        raise ValueError("give --prompt TEXT or --prompt-file FILE")
    return prompts


def prompt_ids(model, texts: list[str], special_tokens: bool) -> list[list[int]]:
    """The prompts' token ids. With ``special_tokens`` (a Hugging Face folder), as transformers tokenizes them
    (`train.data.tokenizer.HFTokenizer.encode_prompts`: the tokenizer decides whether a BOS goes in front);
    else (a meshwork run, trained without one) the plain tokens."""
    if special_tokens:
        return model.tokenizer.encode_prompts(texts)
    return [[int(t) for t in ids] for ids in model.tokenizer.encode_batch([t.encode("utf-8") for t in texts])]


def check_length(model, par, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Refuses, before the key/value cache is allocated, a generation longer than the model's positions
    (``max_position_embeddings``) or whose parameters and cache cannot fit one device's memory
    (`train.reports.fit.check_peak`; the cache's bytes per device from its sharding, activations not
    counted, so a lower bound). Each refusal suggests the ``--max-new-tokens`` that passes both checks.

    Raises:
      ValueError: naming ``--max-new-tokens``, the figures and what fits.
    """
    import jax
    import numpy as np

    from models.generation import CACHE_NAMES, cache_shape  # slow: jax

    width, limit = max(len(p) for p in prompts), model.config.max_positions
    if width + max_new_tokens > limit:
        fix = (
            f"use --max-new-tokens {limit - width}"
            if limit > width
            else f"use prompts shorter than {limit} tokens (the longest has {width})"
        )
        raise ValueError(
            f"--max-new-tokens {max_new_tokens}: the longest prompt's {width} tokens + {max_new_tokens} new ones "
            f"exceed the model's {limit} positions (max_position_embeddings); {fix}"
        )
    budget, source = device_memory(jax.local_devices())
    params = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(model.params))
    one = cache_shape(model.config, len(prompts), 1)
    shard = par.sharding(CACHE_NAMES, one).shard_shape(one) if par.is_sharded else one
    per_position = 2 * int(np.prod(shard)) * np.dtype(model.config.dtype).itemsize
    need = params + per_position * (width + max_new_tokens)
    if budget is not None and need > budget:
        room = (budget - params) // per_position - width
        fix = f"use --max-new-tokens {room}" if room > 0 else "use fewer prompts, a smaller model or more devices"
        check_peak(
            need,
            budget,
            source,
            ("generation", f"--max-new-tokens {max_new_tokens}: generation"),
            "estimated: parameters + key/value cache, activations not counted",
            fix,
        )


class _Stream:
    """Prints one row's text as its tokens arrive (decoding the whole so far, printing the new suffix)."""

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out, self.ids, self.shown = tokenizer, out, [], ""

    def __call__(self, tokens, active) -> None:
        if not active[0]:
            return
        self.ids.append(int(tokens[0]))
        text = self.tokenizer.decode(self.ids)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):  # wait for a whole character
            self.out.write(text[len(self.shown) :])
            self.out.flush()
            self.shown = text


def run(args) -> int:
    from models.generation import Generator, Sampling  # slow: jax

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: must be positive, e.g. 64")
    texts = read_prompts(args)
    par = setup(args, "generation")
    model = load_model(args, par)
    prompts = prompt_ids(model, texts, special_tokens=args.hf is not None)
    check_length(model, par, prompts, args.max_new_tokens)
    generator = Generator(model.config, model.graphdef, model.params, par)
    stream = _Stream(model.tokenizer, sys.stdout) if len(prompts) == 1 and sys.stdout.isatty() else None
    if stream is not None:
        sys.stdout.write(texts[0])
        sys.stdout.flush()
    start = time.perf_counter()
    outputs = generator.generate(prompts, args.max_new_tokens, sampling, eod_id=model.eod_id, on_tokens=stream)
    seconds = time.perf_counter() - start
    if stream is not None:
        sys.stdout.write(model.tokenizer.decode(stream.ids)[len(stream.shown) :] + "\n")
    else:
        for i, (text, new) in enumerate(zip(texts, outputs)):
            new = new[:-1] if new and new[-1] == model.eod_id else new
            print(f"--- prompt {i}" if len(texts) > 1 else "", end="\n" if len(texts) > 1 else "")
            print(text + model.tokenizer.decode(new))
    if args.stats:
        produced = sum(len(o) for o in outputs)
        print(
            f"{len(prompts)} prompts, {produced} new tokens in {seconds:.2f} s (compilation included): "
            f"{produced / seconds:.1f} tokens/s",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    return run_main(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
