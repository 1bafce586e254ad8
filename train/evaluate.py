"""Held-out loss and perplexity of a model on a corpus, without training.

Uses the same held-out split as training (`train.data`: documents held out by a hash of
``--seed`` and their name, ``--heldout`` of them), packed into ``--seq-len`` windows with
per-document positions and masks, and the model's own loss (`models.transformer.loss_sums`):
the mean next-token cross-entropy in nats over every evaluated token, and its exponential, the
perplexity. So an imported model's numbers compare with a fine-tuned one's on the same
``--data``, ``--seed`` and ``--heldout``.

Examples:
    python -m train.evaluate --hf tests/fixtures/hf/llama_tied --data stdlib --seq-len 128 --batch-size 8
    python -m train.evaluate --hf MODEL --data corpus.jsonl --mesh fsdp=4,tensor=2 --cpu-devices 8

``--run-dir RUN [--step N]`` reads a meshwork checkpoint instead (model config and tokenizer from its
metadata, parameters restored onto ``--mesh``; see `train.runtime.inference`).
"""

from __future__ import annotations

import argparse
import math
import sys

from checkpoints.argparser import Parser
from sharding import axes as ax
from train.data import load_dataset, model_inputs, to_global_arrays
from train.runtime.inference import add_device_args, add_source_args, load_model, run_main, setup


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m train.evaluate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_source_args(p)
    g = p.add_argument_group("data")
    g.add_argument(
        "--data", default="stdlib", help="corpus as training's --data: a source, a prepared folder or a mixture"
    )
    g.add_argument("--text-field", default="text", help="JSONL field or Parquet column of a raw --data's text")
    g.add_argument("--heldout", type=float, default=0.01, help="held-out document fraction (as in training)")
    g.add_argument("--seed", type=int, default=0, help="the split's seed (as in training)")
    g.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per batch")
    g.add_argument("--batches", type=int, default=0, help="batches to evaluate (0: every whole batch of the split)")
    g.add_argument("--data-cache", default=None, help="tokenized-corpus cache folder (default ~/.cache/meshwork)")
    add_device_args(p)
    return p


def _check(args) -> None:
    for name in ("seq_len", "batch_size"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be positive, e.g. 16")
    if args.batches < 0:
        raise ValueError(f"--batches {args.batches}: must be >= 0 (0: the whole held-out split)")


def evaluate(model, par, dataset, batch_size: int, seq_len: int, batches: int, source: int = 0) -> tuple[float, int]:
    """Mean held-out cross-entropy (nats per token) of ``source`` (of a mixture) and the number of tokens it
    covers.

    Args:
      model: a `train.runtime.inference.LoadedModel`.
      par: the layout its parameters are on.
      dataset: a `train.data.Dataset` whose ``global_batch`` is ``batch_size``.
      batch_size, seq_len: B and T.
      batches: held-out batches to evaluate, each of B windows in order.
    """
    import jax

    from models.transformer import loss_sums  # slow: jax

    sharding = par.sharding((ax.BATCH, ax.LENGTH), (batch_size, seq_len))

    @jax.jit
    def sums(params, batch):
        return loss_sums(
            model.graphdef,
            params,
            *model_inputs(batch),
            par=par,
        )

    total = count = 0.0
    for b in range(batches):
        batch = to_global_arrays(lambda rows, b=b: dataset.eval_rows(b, rows, source), batch_size, seq_len, sharding)
        loss, weight = sums(model.params, batch)
        total += float(loss)
        count += float(weight)
    return total / count, int(count)


def run(args) -> int:

    _check(args)
    par = setup(args)
    model = load_model(args, par)
    dataset = load_dataset(
        args.data,
        model.tokenizer,
        args.seq_len,
        args.batch_size,
        args.seed,
        args.heldout,
        args.data_cache,
        log=lambda line: print(line, file=sys.stderr),
        text_field=args.text_field,
    )
    for k, source in enumerate(dataset.sources):
        name = f" {source.name}" if len(dataset.sources) > 1 else ""
        whole = source.heldout.num_windows // args.batch_size
        if whole == 0 and args.batches == 0:
            raise ValueError(
                f"the held-out split{name} has {source.heldout.num_windows} windows of --seq-len {args.seq_len}, "
                f"fewer than one --batch-size {args.batch_size}; use --batch-size "
                f"{max(source.heldout.num_windows, 1)} or more --heldout"
            )
        batches = args.batches or whole
        loss, tokens = evaluate(model, par, dataset, args.batch_size, args.seq_len, batches, k)
        print(
            f"held-out loss{name} {loss:.4f} nats/token, perplexity {math.exp(loss):.3f} over {tokens} tokens "
            f"({batches} batches of {args.batch_size} x {args.seq_len}; --data {source.path if name else args.data})"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    return run_main(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
