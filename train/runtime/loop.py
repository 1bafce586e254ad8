"""The training loop: batches in, metrics and checkpoints out.

The host never waits on the step it just dispatched: step ``n`` is enqueued
first, then the metrics of step ``n - 1`` are read (their device work is
finished or nearly so), so data loading and logging overlap device compute.
Batches come from the input pipeline (`train.data.TrainBatches`), read ahead in background threads; the
seconds each step waited for its batch are the ``perf/input_wait`` metric. Only process 0 prints and writes
metrics; every process takes part in
checkpoints (each writes its own shards).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from sharding.devices import peak_flops
from train.data import Dataset, local_rows, to_global_arrays
from train.runtime.divergence import DivergenceGuard
from train.runtime.profile import StepProfiler

# Tells apart the event files of writers opened in the same second by one process: tensorboardX names a
# file by the second and the host only, so a second writer in that second would overwrite the first's file.
_WRITER_SERIAL = itertools.count()


@dataclasses.dataclass
class LoopOptions:
    """What the loop does and when.

    Attributes:
      steps: train until the state's step reaches this.
      global_batch: B, sequences per step.
      seq_len: T, positions per sequence in the batch's arrays (tokens, plus padding with uneven context
        shares).
      tokens_per_sequence: real tokens per sequence where it is fewer than ``seq_len`` (uneven context
        shares), for the tokens counted; None: ``seq_len``.
      log_every: steps between log lines.
      eval_every: steps between held-out evaluations (0: only first and last).
      eval_batches: held-out batches per evaluation (0: none; the evaluation step is never compiled).
      ckpt_every: steps between checkpoints (0: only the last).
      flops_per_token: model FLOPs per trained token (for MFU).
      peak_flops: summed peak FLOP/s of all devices, or None when unknown.
      progress: show a progress bar.
      skip_nonfinite: steps with a non-finite loss that may be skipped before
        the run stops.
      max_loss: ``--max-loss``: a finite loss above it stops the run as a non-finite one does (None: auto,
        `train.runtime.divergence.auto_max_loss`; ``inf``: off).
      vocab_size: the model's vocabulary (for the auto ``max_loss``).
      profile_steps: ``--profile-steps``: the first and last step traced (`train.runtime.profile`), or None.
      run_dir: the run folder (where the trace goes).
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
    max_loss: float | None = None
    vocab_size: int = 0
    profile_steps: tuple[int, int] | None = None
    run_dir: str = "."
    tokens_per_sequence: int | None = None

    @classmethod
    def of(cls, run, positions: int | None = None) -> LoopOptions:
        """The options of a `train.setup.config.RunConfig` (MFU against the devices' summed peak, when known);
        ``positions``: positions per sequence when the layout pads it (`sharding.parallel.Parallelism.padded_length`)."""
        import jax

        peaks = [peak_flops(d) for d in jax.devices()]
        loop, data = run.loop, run.data
        return cls(
            steps=loop.steps,
            global_batch=data.batch_size,
            seq_len=positions or data.seq_len,
            tokens_per_sequence=data.seq_len if positions else None,
            log_every=loop.log_every,
            eval_every=loop.eval_every,
            eval_batches=loop.eval_batches,
            ckpt_every=run.checkpoint.every,
            flops_per_token=run.model.flops_per_token(data.seq_len),
            peak_flops=None if any(p is None for p in peaks) else float(sum(peaks)),
            progress=loop.progress,
            skip_nonfinite=loop.skip_nonfinite,
            max_loss=loop.max_loss,
            vocab_size=run.model.vocab_size,
            profile_steps=loop.profile_steps,
            run_dir=run.checkpoint.run_dir,
        )


class _WandbSink:
    """A Weights & Biases run of this session: named after the run folder and grouped by it, its files under
    ``RUN_DIR/wandb``; the project, entity and mode (``WANDB_MODE=offline``) come from wandb's own
    environment variables (``WANDB_PROJECT``...)."""

    def __init__(self, run_dir: Path, config: dict | None):
        import wandb

        self._run = wandb.init(name=run_dir.name, group=run_dir.name, dir=str(run_dir), config=config)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class _MlflowSink:
    """An MLflow run of this session, named after the run folder and tagged ``meshwork.run_dir`` with its
    path, the flags as parameters; the tracking server and experiment come from MLflow's own environment
    variables (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``); with no server named, the store is the
    SQLite database ``RUN_DIR/mlflow.db`` (MLflow's recommended local backend; ``mlflow ui
    --backend-store-uri sqlite:///RUN_DIR/mlflow.db`` shows it)."""

    def __init__(self, run_dir: Path, config: dict | None):
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri(f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
        self._mlflow = mlflow
        self._run = mlflow.start_run(run_name=run_dir.name, tags={"meshwork.run_dir": str(run_dir.resolve())})
        if config:
            mlflow.log_params({k: json.dumps(v) if not isinstance(v, str) else v for k, v in config.items()})

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


TRACKERS = {"wandb": _WandbSink, "mlflow": _MlflowSink}
"""The experiment trackers `MetricsWriter` can log to, by name; each needs the package of the same name."""


HISTOGRAMS = frozenset({"moe_expert_share"})
"""Vector metrics TensorBoard shows as a histogram (``metrics.jsonl`` keeps the list) rather than as one
scalar per entry; trackers do not get them."""


class MetricsWriter:
    """``metrics.jsonl`` plus TensorBoard event files in the run folder, and the trackers asked for (``--wandb``,
    ``--mlflow``; process 0 only).

    The trackers get the same scalars as TensorBoard, at the same steps; each session (a fresh start or a
    resume) is a run of its own there, named after the run folder, with the flags as its configuration.

    Records stay true across a crash and a resume: the records of steps after ``restored_step`` (the step
    the run restored; None for a fresh start, which drops every earlier record) are dropped from ``metrics.jsonl`` by an atomic rewrite, and
    TensorBoard is told to discard events from step ``restored_step + 1`` on (tensorboardX's ``purge_step``: a
    ``SessionLog.START`` event at that step, which TensorBoard reads as "drop the earlier sessions' events
    from here"). Kinds of record already kept at ``restored_step`` (the held-out loss the resumed run
    evaluates again) are not written twice.
    """

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        restored_step: int | None = None,
        trackers: tuple[str, ...] = (),
        config: dict | None = None,
    ):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._sinks: list = []
        if not enabled:
            return
        for name in trackers:  # first: a tracker that cannot start leaves the records untouched
            try:
                self._sinks.append(TRACKERS[name](Path(run_dir), config))
            except Exception as e:  # a login, server or network failure of the tracker's own
                self.close()
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise RuntimeError(f"starting the {name} run failed: {first}") from e
        self.start_step = -1 if restored_step is None else restored_step
        self.dropped, self._present = truncate_metrics(run_dir / "metrics.jsonl", self.start_step)
        self._jsonl = (run_dir / "metrics.jsonl").open("a")
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(
                str(run_dir / "tensorboard"),
                purge_step=self.start_step + 1,
                # zero-padded: TensorBoard reads a folder's files in name order, and a resumed run's purge mark
                # must come after the run it purges (".9" sorts after ".10")
                filename_suffix=f".{os.getpid()}.{next(_WRITER_SERIAL):06d}",
            )
        except ImportError:
            print("note: tensorboardX is not installed; TensorBoard logs are off", file=sys.stderr)

    def write(self, step: int, values: dict[str, float], prefix: str = "train") -> None:
        if not self.enabled:
            return
        if step == self.start_step and prefix in self._present:
            return  # kept from before the resume (see the class docstring)
        record = {"step": step, **{f"{prefix}/{k}": v for k, v in values.items()}, "time": time.time()}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        scalars = {
            f"{prefix}/{key}" + ("" if index is None else f"/{index}"): item
            for key, value in values.items()
            if key not in HISTOGRAMS
            for index, item in (enumerate(value) if isinstance(value, list) else ((None, value),))
        }
        if self._tb is not None:
            for key, item in scalars.items():
                self._tb.add_scalar(key, item, step)
            for key in HISTOGRAMS & values.keys():
                self._tb.add_histogram(f"{prefix}/{key}", np.asarray(values[key], np.float32), step)
        for sink in self._sinks:
            sink.log(step, scalars)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self._sinks:
            sink.close()
        self._sinks = []


def truncate_metrics(path: Path, start_step: int) -> tuple[int, set[str]]:
    """Drops the records of steps after ``start_step`` (see `MetricsWriter`).

    Rewrites ``path`` atomically (a temporary file, then `os.replace`), so a crash meanwhile leaves either
    the old file or the new one. A line that is not a JSON record (a torn last line) is dropped too.

    Returns:
      ``(dropped, present)``: how many records were dropped, and the prefixes (``train``, ``eval``, ...)
      of the records kept at ``start_step``.
    """
    if not path.is_file():
        return 0, set()
    kept, dropped, present = [], 0, set()
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            dropped += 1
            continue
        if step > start_step:
            dropped += 1
            continue
        kept.append(line)
        if step == start_step:
            present |= {key.split("/")[0] for key in record if "/" in key}
    if dropped:
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with temporary.open("w") as f:
            f.write("".join(line + "\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    return dropped, present


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


def _format_line(
    step: int, steps: int, loss: float, lr: float, tok_s: float, step_s: float, mfu: float | None, grad_norm: float
) -> str:
    mfu_text = f"MFU {mfu:.1%}" if mfu is not None else "MFU n/a (device peak unknown, e.g. CPU)"
    return (
        f"step {step:>6}/{steps} | loss {loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3g} | {tok_s:,.0f} tok/s | "
        f"{step_s * 1000:.0f} ms/step | {mfu_text}"
    )


def evaluate(eval_step, params, dataset: Dataset, options: LoopOptions, sharding, source: int = 0) -> float:
    """Mean held-out loss (nats/token) over the fixed evaluation batches of ``source``."""
    loss_sum = weight = 0.0
    for index in range(options.eval_batches):
        batch = to_global_arrays(
            lambda rows, i=index: dataset.eval_rows(i, rows, source), options.global_batch, options.seq_len, sharding
        )
        s, w = eval_step(params, batch)
        loss_sum += float(s)
        weight += float(w)
    return loss_sum / max(weight, 1.0)


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite more often than ``--skip-nonfinite`` allows.

    Attributes:
      step: the step whose loss stopped the run (its loss was computed from the parameters of ``step - 1``).
    """

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


class DivergedLossError(NonFiniteLossError):
    """A finite loss grew past ``--max-loss`` (`train.runtime.divergence`); stops the run as a non-finite loss does."""


def train_loop(
    *,
    trainer,
    state: dict,
    dataset: Dataset,
    options: LoopOptions,
    samples: int,
    checkpoints,
    iterator: dict | None = None,
    writer: MetricsWriter,
    log: Callable[[str], None],
    stop: StopFlag,
    check_compiled: Callable[[Any], str] | None = None,
    compiler_options: dict[str, Any] | None = None,
) -> tuple[dict, dict[str, Any]]:
    """Runs training from ``state`` (its ``step`` says where to start) to ``options.steps``.

    ``samples`` is the data position (global sample number of the next batch) and ``iterator`` the input
    pipeline's state a checkpoint recorded (None: derived from ``samples``); ``checkpoints`` has
    ``save(state, step, samples, iterator)`` (starts an asynchronous save) and ``check()`` (raises a failed save's
    error); ``stop`` is a `StopFlag`, whose request reaches every process through the next step's ``stop``
    metric, so all stop after the same step and save it; ``check_compiled`` gets the compiled step before
    it runs and returns a line to log (`train.reports.fit.check_compiled` raises for a step that cannot fit);
    ``compiler_options`` are XLA options the step is compiled with (`train.runtime.agreement.mixed_kind_options`).

    Returns:
      ``(state, summary)``: the final step and samples, held-out losses, the signal that stopped the run
      (or None) and the steps skipped as non-finite.

    Raises:
      NonFiniteLossError: More than ``options.skip_nonfinite`` non-finite steps, or (`DivergedLossError`) a
        loss past ``options.max_loss``; nothing is saved after the last good checkpoint.
    """
    start = int(jax.device_get(state["step"]))
    run = _Run(trainer, dataset, options, writer, log, start)
    if start < options.steps:
        run.open_input(samples, iterator)
    if start >= options.steps:
        log(
            f"the run is at step {start}, which already reaches --steps {options.steps}; nothing to train "
            f"(raise --steps to continue)"
        )
        run.summary.update(step=start, samples=samples)
        return state, run.summary
    B = options.global_batch
    batch = run.next_batch()
    compiled = _compile(trainer, state, batch, options, log, check_compiled, compiler_options)
    run.batches.take_wait()  # the first batch's wait is start-up, not a step's
    run.evaluate(state, start)  # the starting point of the run's held-out curve (also after a resume)
    bar = _progress(options, start)
    step, stop_after_this = start, False
    profiler = StepProfiler(options.profile_steps, options.run_dir, log)
    while step < options.steps:
        profiler.before(step + 1)
        batch = run.next_batch() if batch is None else batch
        state, metrics = compiled(state, batch, trainer.signals(bool(stop), *run.inputs))
        batch = None
        step, samples = step + 1, samples + B
        profiler.after(step, state)
        checkpoints.check()
        stop_after_this |= run.record(step, metrics)
        if bar is not None:
            bar.update(1)
        save_now = (options.ckpt_every and step % options.ckpt_every == 0) or step == options.steps
        if save_now or stop_after_this or step % options.log_every == 0:
            stop_after_this |= run.log_interval(step, samples)  # read before saving: a non-finite step is never saved
        if options.eval_every and step % options.eval_every == 0 and not (step == options.steps or stop_after_this):
            run.evaluate(state, step)
        if save_now or stop_after_this:
            checkpoints.save(state, step, samples, run.batches.state())
        if stop_after_this:
            run.summary["stopped_by"] = stop.signal_name or "a stop request from another process"
            log(f"stopping after step {step} ({run.summary['stopped_by']})")
            break
    profiler.close()
    run.flush()
    if bar is not None:
        bar.close()
    if run.summary["stopped_by"] is None and (not run.summary["eval"] or run.summary["eval"][-1][0] != step):
        run.evaluate(state, step)
    run.summary.update(step=step, samples=samples)
    return state, run.summary


def _compile(trainer, state, batch, options: LoopOptions, log, check_compiled, compiler_options=None):
    """The compiled train step (with XLA's ``compiler_options``), checked (``check_compiled``) before it runs."""
    log("compiling the train step ...")  # the run's start-up ends here (a long compilation is not a hang)
    t0 = time.perf_counter()
    compiled = (
        trainer.train_step(options.global_batch, options.seq_len)
        .lower(state, batch, trainer.signals(False))
        .compile(compiler_options or None)
    )
    log(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
    if check_compiled is not None:
        log(check_compiled(compiled))
    return compiled


class _Run:
    """The loop's bookkeeping: batches, evaluations, the pending step's metrics, the log interval."""

    def __init__(self, trainer, dataset: Dataset, options: LoopOptions, writer: MetricsWriter, log, start: int):
        self.dataset, self.options, self.writer, self.log = dataset, options, writer, log
        self.sharding = trainer.batch_sharding(options.global_batch, options.seq_len)
        self.eval_fn = trainer.eval_step(options.global_batch, options.seq_len)
        self.summary: dict[str, Any] = {"start_step": start, "eval": [], "skipped": [], "stopped_by": None}
        self.pending: tuple[int, Any] | None = None
        self.interval_start, self.interval_steps = time.perf_counter(), 0
        self.controller = trainer.strategy.controller()
        """The strategy's host-side controller of its step inputs (`GradientStrategy.controller`), or None."""
        self.guard = DivergenceGuard(options.max_loss, options.vocab_size)
        self.batches = None
        """The input pipeline (`open_input`)."""

    def open_input(self, samples: int, iterator: dict | None) -> None:
        """Starts the input pipeline at the data position ``samples`` (`train.data.TrainBatches`), restoring
        the checkpoint's ``iterator`` state where it applies; this process reads only its own rows."""
        options = self.options
        rows = local_rows(self.sharding, (options.global_batch, options.seq_len))
        self.batches = self.dataset.train_batches(rows, samples, iterator)

    def next_batch(self) -> dict:
        """The next step's global batch, each process loading its own rows (read ahead in the background)."""
        local = next(self.batches)
        return to_global_arrays(lambda rows: local, self.options.global_batch, self.options.seq_len, self.sharding)

    def evaluate(self, state, step: int) -> None:
        """The held-out loss; of a mixture, each source's (``eval/loss_NAME``) and their mean weighted as the
        training tokens are (``eval/loss``). None with ``eval_batches`` 0."""
        if not self.options.eval_batches:
            return
        sources = self.dataset.sources
        losses = [
            evaluate(self.eval_fn, state["params"], self.dataset, self.options, self.sharding, k)
            for k in range(len(sources))
        ]
        loss = sum(s.weight * x for s, x in zip(sources, losses)) / sum(s.weight for s in sources)
        self.summary["eval"].append((step, loss))
        values = {"loss": loss} | ({f"loss_{s.name}": x for s, x in zip(sources, losses)} if len(sources) > 1 else {})
        self.writer.write(step, values, prefix="eval")
        each = "".join(f" | {s.name} {x:.4f}" for s, x in zip(sources, losses)) if len(sources) > 1 else ""
        self.log(f"eval   {step:>6}/{self.options.steps} | held-out loss {loss:.4f}{each}")

    def record(self, step: int, metrics) -> bool:
        """Keeps this step's metrics pending and records the previous step's (this step keeps the device
        busy meanwhile); returns whether the processes agreed to stop."""
        self.interval_steps += 1
        stop = self.flush()
        self.pending = (step, metrics)
        return stop

    def flush(self) -> bool:
        """Records the pending step's metrics, if any; returns whether the processes agreed to stop."""
        if self.pending is None:
            return False
        pending, self.pending = self.pending, None
        values = _read(pending)
        self.observe(pending[0], values)
        return _handle(pending, self.writer, self.options, self.summary, self.log, values, self.guard)

    @property
    def inputs(self) -> tuple:
        """The values of the strategy's step inputs the next step runs (empty: their defaults)."""
        return () if self.controller is None else tuple(self.controller.inputs)

    def observe(self, step: int, values: dict) -> None:
        """Shows a step's metrics on the host (``values``) to the strategy's controller, which may change the
        step inputs (the step after next runs them: metrics are read one step late) and add metrics."""
        if self.controller is not None:
            self.controller.observe(step, values, self.log)

    def log_interval(self, step: int, samples: int) -> bool:
        """Records this step's metrics now and logs the interval's speed (and, of a mixture, the training
        tokens each source has given up to the data position ``samples``: ``data/tokens_NAME``); returns the
        stop agreement."""
        options, pending = self.options, self.pending
        values = _read(pending)
        self.pending = None
        self.observe(step, values)
        stop = _handle(pending, self.writer, options, self.summary, self.log, values, self.guard)
        elapsed = time.perf_counter() - self.interval_start
        tokens = options.tokens_per_sequence or options.seq_len
        tok_s = self.interval_steps * options.global_batch * tokens / elapsed
        mfu = tok_s * options.flops_per_token / options.peak_flops if options.peak_flops else None
        step_time = elapsed / self.interval_steps
        input_wait = self.batches.take_wait() / self.interval_steps
        perf = {"tokens_per_second": tok_s, "step_time": step_time, "input_wait": input_wait}
        self.writer.write(step, perf, prefix="perf")
        if len(self.dataset.sources) > 1:
            counts = self.dataset.source_samples(samples)
            seen = {f"tokens_{s.name}": n * tokens for s, n in zip(self.dataset.sources, counts)}
            self.writer.write(step, seen, prefix="data")
        self.log(
            _format_line(step, options.steps, values["loss"], values["lr"], tok_s, step_time, mfu, values["grad_norm"])
        )
        self.interval_start, self.interval_steps = time.perf_counter(), 0
        return stop


def _read(pending) -> dict[str, float | list]:
    """A step's metrics on the host: scalars as floats, per-device vectors (uneven counts) as lists."""
    _, metrics = pending
    values = {}
    for key, value in jax.device_get(metrics).items():
        array = np.asarray(value)
        values[key] = float(array) if array.ndim == 0 else array.tolist()
    return values


def _handle(pending, writer: MetricsWriter, options: LoopOptions, summary, log, values=None, guard=None) -> bool:
    """Records a step's metrics; returns whether the processes agreed to stop.

    Raises:
      NonFiniteLossError: past the allowed number of non-finite steps.
      DivergedLossError: a finite loss past ``guard``'s limit.
    """
    step = pending[0]
    values = values if values is not None else _read(pending)
    if not values.pop("finite"):
        summary["skipped"].append(step)
        log(
            f"step {step}: loss {values['loss']} / grad norm {values['grad_norm']} is not finite; the update was "
            f"skipped ({len(summary['skipped'])} of --skip-nonfinite {options.skip_nonfinite})"
        )
        if len(summary["skipped"]) > options.skip_nonfinite:
            raise NonFiniteLossError(
                f"the loss or its gradient became non-finite at step {step} (loss {values['loss']}, gradient norm "
                f"{values['grad_norm']}); training stopped and the last complete checkpoint is kept "
                f"(pass --skip-nonfinite N to skip up to N such steps, or lower --lr)",
                step,
            )
    elif guard is not None and (diverged := guard.check(step, values["loss"])):
        raise DivergedLossError(diverged, step)
    stop_requested = bool(values.pop("stop"))
    writer.write(step, values)
    return stop_requested


def _progress(options: LoopOptions, start: int):
    if not (options.progress and jax.process_index() == 0 and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=options.steps, initial=start, unit="step", dynamic_ncols=True, leave=False)
