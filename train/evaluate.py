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

import numpy as np

from checkpoints.argparser import Parser
from sharding import axes as ax
from sharding.devices import device_memory
from train.data import FIELDS, check_data_cache, load_dataset, model_inputs, to_global_arrays
from train.reports.fit import check_peak, step_peak
from train.reports.units import human_bytes
from train.runtime.inference import add_device_args, add_source_args, load_model, run_main, setup


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m train.evaluate",
        description=__doc__.split("\n\n")[0],
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
    g.add_argument(
        "--data-cache",
        default=None,
        help="tokenized-corpus cache folder (default $MESHWORK_CACHE or ~/.cache/meshwork)",
    )
    add_device_args(p)
    return p


def _check(args) -> None:
    for name in ("seq_len", "batch_size"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be positive, e.g. 16")
    if args.batches < 0:
        raise ValueError(f"--batches {args.batches}: must be >= 0 (0: the whole held-out split)")


def loss_function(model, par, batch_size: int, seq_len: int):
    """``(sums, sharding)``: the jitted ``(params, batch) -> (loss_sum, weight)`` of ``[batch_size, seq_len]``
    batches (`models.transformer.loss_sums`) and the batch fields' sharding."""
    import jax

    from models.transformer import loss_sums  # slow: jax

    sharding = par.sharding((ax.BATCH, ax.LENGTH), (batch_size, seq_len))

    @jax.jit
    def sums(params, batch):
        return loss_sums(model.graphdef, params, *model_inputs(batch), par=par)

    return sums, sharding


def compile_fitting(model, par, batch_size: int, seq_len: int):
    """The loss function compiled for ``[batch_size, seq_len]`` batches, checked to fit the devices' memory
    before any batch is read (`train.reports.fit.check_peak` on the compiled memory analysis, as training's
    step). When it does not fit, the error suggests the longest halving of ``--seq-len`` that does (tried by
    compiling it).

    Raises:
      ValueError: The compiled peak exceeds the device's memory, naming ``--seq-len`` and ``--batch-size``.
    """
    import jax

    budget, source = device_memory(jax.local_devices())

    def compiled(length):
        sums, sharding = loss_function(model, par, batch_size, length)
        abstract = {
            f: jax.ShapeDtypeStruct(
                (batch_size, length), np.float32 if f == "loss_mask" else np.int32, sharding=sharding
            )
            for f in FIELDS
        }
        return sums.lower(model.params, abstract).compile()

    chosen = compiled(seq_len)
    peak = step_peak(chosen)
    if peak is None or budget is None or peak <= budget:
        return chosen
    length, remedy = seq_len // 2, "use a smaller --seq-len or --batch-size, or more devices"
    while length >= 16:
        smaller = step_peak(compiled(length))
        if smaller is not None and smaller <= budget:
            remedy = f"use --seq-len {length} (its peak is {human_bytes(smaller)}) or a smaller --batch-size"
            break
        length //= 2
    check_peak(
        peak,
        budget,
        source,
        ("evaluation", f"--seq-len {seq_len} x --batch-size {batch_size}: evaluation"),
        "compiled memory_analysis",
        remedy,
    )
    return chosen


def evaluate(
    model, par, dataset, batch_size: int, seq_len: int, batches: int, source: int = 0, sums=None
) -> tuple[float, int]:
    """Mean held-out cross-entropy (nats per token) of ``source`` (of a mixture) and the number of tokens it
    covers.

    Args:
      model: a `train.runtime.inference.LoadedModel`.
      par: the layout its parameters are on.
      dataset: a `train.data.Dataset` whose ``global_batch`` is ``batch_size``.
      batch_size, seq_len: B and T.
      batches: held-out batches to evaluate, each of B windows in order.
      sums: the loss function (`loss_function`, or `compile_fitting`'s); None builds it.
    """
    jitted, sharding = loss_function(model, par, batch_size, seq_len)
    sums = sums or jitted
    total = count = 0.0
    for b in range(batches):
        batch = to_global_arrays(lambda rows, b=b: dataset.eval_rows(b, rows, source), batch_size, seq_len, sharding)
        loss, weight = sums(model.params, batch)
        total += float(loss)
        count += float(weight)
    return total / count, int(count)


def run(args) -> int:

    _check(args)
    check_data_cache(args.data_cache)  # before the model is read and compiled
    par = setup(args, "evaluation")
    model = load_model(args, par)
    sums = compile_fitting(model, par, args.batch_size, args.seq_len)  # before the data is read or prepared
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
        loss, tokens = evaluate(model, par, dataset, args.batch_size, args.seq_len, batches, k, sums)
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
