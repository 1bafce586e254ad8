"""The training loop: batches in, metrics and checkpoints out.

The host never waits on the step it just dispatched: step ``n`` is enqueued
first, then the metrics of step ``n - 1`` are read (their device work is
finished or nearly so), so data loading and logging overlap device compute.
Only process 0 prints and writes metrics; every process takes part in
checkpoints (each writes its own shards).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from train.data import Dataset, to_global_arrays


@dataclasses.dataclass
class LoopOptions:
    """What the loop does and when.

    Attributes:
      steps: train until the state's step reaches this.
      global_batch: B, sequences per step.
      seq_len: T, tokens per sequence.
      log_every: steps between log lines.
      eval_every: steps between held-out evaluations (0: only first and last).
      eval_batches: held-out batches per evaluation.
      ckpt_every: steps between checkpoints (0: only the last).
      flops_per_token: model FLOPs per trained token (for MFU).
      peak_flops: summed peak FLOP/s of all devices, or None when unknown.
      progress: show a progress bar.
    """

    steps: int
    global_batch: int
    seq_len: int
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    ckpt_every: int = 100
    flops_per_token: float = 0.0
    peak_flops: float | None = None
    progress: bool = True


class MetricsWriter:
    """``metrics.jsonl`` plus TensorBoard event files in the run folder (process 0 only)."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        self._jsonl = (run_dir / "metrics.jsonl").open("a")
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            print("note: tensorboardX is not installed; TensorBoard logs are off", file=sys.stderr)

    def write(self, step: int, values: dict[str, float], prefix: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": step, **{f"{prefix}/{k}": v for k, v in values.items()}, "time": time.time()}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


class StopFlag:
    """Set by SIGTERM/SIGINT: the loop finishes the current step, saves and exits."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, _frame):
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __bool__(self) -> bool:
        return self.signal_name is not None


def _format_line(step: int, steps: int, loss: float, lr: float, tok_s: float, step_s: float, mfu: float | None) -> str:
    mfu_text = f"MFU {mfu:.1%}" if mfu is not None else "MFU n/a (device peak unknown, e.g. CPU)"
    return (
        f"step {step:>6}/{steps} | loss {loss:.4f} | lr {lr:.2e} | {tok_s:,.0f} tok/s | "
        f"{step_s * 1000:.0f} ms/step | {mfu_text}"
    )


def evaluate(eval_step, params, dataset: Dataset, options: LoopOptions, sharding) -> float:
    """Mean held-out loss (nats/token) over the fixed evaluation batches."""
    loss_sum = weight = 0.0
    for index in range(options.eval_batches):
        batch = to_global_arrays(
            lambda rows, i=index: dataset.eval_rows(i, rows), options.global_batch, options.seq_len, sharding
        )
        s, w = eval_step(params, batch)
        loss_sum += float(s)
        weight += float(w)
    return loss_sum / max(weight, 1.0)


def train_loop(
    *,
    trainer,
    state: dict,
    dataset: Dataset,
    options: LoopOptions,
    samples: int,
    save: Callable[[dict, int, int], None],
    writer: MetricsWriter,
    log: Callable[[str], None],
    stop: StopFlag,
) -> tuple[dict, dict[str, Any]]:
    """Runs training from ``state`` to ``options.steps``.

    Args:
      trainer: the `train.step.Trainer`.
      state: the sharded train state (its ``step`` says where to start).
      dataset: train and held-out windows.
      options: see `LoopOptions`.
      samples: global sample number of the next batch (the data position).
      save: ``save(state, step, samples)`` starts a checkpoint.
      writer: metrics sink.
      log: prints a line (process 0).
      stop: a `StopFlag`; when set, the loop ends after the current step.

    Returns:
      ``(state, summary)`` with the final step, samples, the first and last
      held-out losses and whether a signal stopped the run.
    """
    B, T = options.global_batch, options.seq_len
    sharding = trainer.batch_sharding(B, T)
    step_fn = trainer.train_step(B, T)
    eval_fn = trainer.eval_step(B, T)
    start = int(jax.device_get(state["step"]))
    summary: dict[str, Any] = {"start_step": start, "eval": []}

    def batch_at(first_sample):
        return to_global_arrays(lambda rows: dataset.train_rows(first_sample, rows), B, T, sharding)

    def run_eval(step):
        loss = evaluate(eval_fn, state["params"], dataset, options, sharding)
        summary["eval"].append((step, loss))
        writer.write(step, {"loss": loss}, prefix="eval")
        log(f"eval   {step:>6}/{options.steps} | held-out loss {loss:.4f}")

    if start >= options.steps:
        log(f"the run is at step {start}, which already reaches --steps {options.steps}; nothing to train "
            f"(raise --steps to continue)")
        summary.update(step=start, samples=samples, stopped_by=None)
        return state, summary

    t0 = time.perf_counter()
    compiled = step_fn.lower(state, batch_at(samples)).compile()
    log(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
    if start == 0:
        run_eval(0)

    bar = _progress(options, start)
    pending: tuple[int, Any] | None = None
    interval_start, interval_steps = time.perf_counter(), 0
    step = start
    while step < options.steps:
        batch = batch_at(samples)
        state, metrics = compiled(state, batch)
        step += 1
        samples += B
        if pending is not None:
            _record(pending, writer)
        pending = (step, metrics)
        interval_steps += 1
        if bar is not None:
            bar.update(1)
        last = step == options.steps or bool(stop)
        if step % options.log_every == 0 or last:
            values = _record(pending, writer)
            pending = None
            elapsed = time.perf_counter() - interval_start
            tok_s = interval_steps * B * T / elapsed
            mfu = tok_s * options.flops_per_token / options.peak_flops if options.peak_flops else None
            writer.write(step, {"tokens_per_second": tok_s, "step_time": elapsed / interval_steps}, prefix="perf")
            log(_format_line(step, options.steps, values["loss"], values["lr"], tok_s, elapsed / interval_steps, mfu))
            interval_start, interval_steps = time.perf_counter(), 0
        if options.eval_every and step % options.eval_every == 0 and not last:
            run_eval(step)
        if (options.ckpt_every and step % options.ckpt_every == 0) or last:
            save(state, step, samples)
        if stop:
            log(f"received {stop.signal_name}: stopping after step {step}")
            break
    if pending is not None:
        _record(pending, writer)
    if bar is not None:
        bar.close()
    if not stop and (not summary["eval"] or summary["eval"][-1][0] != step):
        run_eval(step)
    summary.update(step=step, samples=samples, stopped_by=stop.signal_name)
    return state, summary


def _record(pending, writer: MetricsWriter) -> dict[str, float]:
    step, metrics = pending
    values = {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}
    writer.write(step, values)
    return values


def _progress(options: LoopOptions, start: int):
    if not (options.progress and jax.process_index() == 0 and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=options.steps, initial=start, unit="step", dynamic_ncols=True, leave=False)
