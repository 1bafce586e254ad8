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
      skip_nonfinite: steps with a non-finite loss that may be skipped before
        the run stops.
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
    skip_nonfinite: int = 0


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


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite more often than ``--skip-nonfinite`` allows."""


def train_loop(
    *,
    trainer,
    state: dict,
    dataset: Dataset,
    options: LoopOptions,
    samples: int,
    checkpoints,
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
      checkpoints: has ``save(state, step, samples)`` (starts an asynchronous
        save) and ``check()`` (raises the error of a failed save).
      writer: metrics sink.
      log: prints a line (process 0).
      stop: a `StopFlag`. A stop request of any process reaches every process
        through the next step's ``stop`` metric, so all processes stop after
        the same step and save it.

    Returns:
      ``(state, summary)`` with the final step, samples, the held-out losses,
      the signal that stopped the run (or None) and the steps skipped as
      non-finite.

    Raises:
      NonFiniteLossError: when more than ``options.skip_nonfinite`` steps had
        a non-finite loss; nothing is saved after the last good checkpoint.
    """
    B, T = options.global_batch, options.seq_len
    sharding = trainer.batch_sharding(B, T)
    step_fn = trainer.train_step(B, T)
    eval_fn = trainer.eval_step(B, T)
    start = int(jax.device_get(state["step"]))
    summary: dict[str, Any] = {"start_step": start, "eval": [], "skipped": [], "stopped_by": None}

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
        summary.update(step=start, samples=samples)
        return state, summary

    t0 = time.perf_counter()
    compiled = step_fn.lower(state, batch_at(samples), trainer.signals(False)).compile()
    log(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
    run_eval(start)  # the starting point of the run's held-out curve (also after a resume)

    bar = _progress(options, start)
    pending: tuple[int, Any] | None = None
    interval_start, interval_steps = time.perf_counter(), 0
    step = start
    stop_after_this = False
    while step < options.steps:
        state, metrics = compiled(state, batch_at(samples), trainer.signals(bool(stop)))
        step += 1
        samples += B
        interval_steps += 1
        checkpoints.check()
        if pending is not None:  # the previous step's metrics; this step keeps the device busy
            stop_after_this |= _handle(pending, writer, options, summary, log)
        pending = (step, metrics)
        if bar is not None:
            bar.update(1)
        save_now = (options.ckpt_every and step % options.ckpt_every == 0) or step == options.steps
        if save_now or stop_after_this or step % options.log_every == 0:
            # Read this step's metrics before saving it: a non-finite step is never checkpointed.
            values = _read(pending)
            stop_after_this |= _handle(pending, writer, options, summary, log, values)
            pending = None
            elapsed = time.perf_counter() - interval_start
            tok_s = interval_steps * B * T / elapsed
            mfu = tok_s * options.flops_per_token / options.peak_flops if options.peak_flops else None
            writer.write(step, {"tokens_per_second": tok_s, "step_time": elapsed / interval_steps}, prefix="perf")
            log(_format_line(step, options.steps, values["loss"], values["lr"], tok_s, elapsed / interval_steps, mfu))
            interval_start, interval_steps = time.perf_counter(), 0
        last = step == options.steps or stop_after_this
        if options.eval_every and step % options.eval_every == 0 and not last:
            run_eval(step)
        if save_now or stop_after_this:
            checkpoints.save(state, step, samples)
        if stop_after_this:
            summary["stopped_by"] = stop.signal_name or "a stop request from another process"
            log(f"stopping after step {step} ({summary['stopped_by']})")
            break
    if pending is not None:
        _handle(pending, writer, options, summary, log)
    if bar is not None:
        bar.close()
    if summary["stopped_by"] is None and (not summary["eval"] or summary["eval"][-1][0] != step):
        run_eval(step)
    summary.update(step=step, samples=samples)
    return state, summary


def _read(pending) -> dict[str, float]:
    _, metrics = pending
    return {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}


def _handle(pending, writer: MetricsWriter, options: LoopOptions, summary, log, values=None) -> bool:
    """Records a step's metrics; returns whether the processes agreed to stop.

    Raises:
      NonFiniteLossError: past the allowed number of non-finite steps.
    """
    step = pending[0]
    values = values if values is not None else _read(pending)
    if not values.pop("finite"):
        summary["skipped"].append(step)
        log(f"step {step}: loss {values['loss']} / grad norm {values['grad_norm']} is not finite; the update was "
            f"skipped ({len(summary['skipped'])} of --skip-nonfinite {options.skip_nonfinite})")
        if len(summary["skipped"]) > options.skip_nonfinite:
            raise NonFiniteLossError(
                f"the loss or its gradient became non-finite at step {step} (loss {values['loss']}, gradient norm "
                f"{values['grad_norm']}); training stopped and the last complete checkpoint is kept "
                f"(pass --skip-nonfinite N to skip up to N such steps, or lower --lr)"
            )
    stop_requested = bool(values.pop("stop"))
    writer.write(step, values)
    return stop_requested


def _progress(options: LoopOptions, start: int):
    if not (options.progress and jax.process_index() == 0 and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=options.steps, initial=start, unit="step", dynamic_ncols=True, leave=False)
