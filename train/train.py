"""meshwork's trainer: ``python -m train.train [flags]`` (``--help`` lists them; README has examples).

Flags -> `train.setup.config.RunConfig` (`train.setup.cli`) -> checks (`train.setup.checks`) -> `run`: build the mesh and
the `train.runtime.step.Trainer`, restore or initialize the state, and train (`train.runtime.loop`) or dry-run.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

from checkpoints.lock import RunFolderLocked, RunLock
from checkpoints.manager import CheckpointFailure, LoopCheckpoints, open_resumable, restore_state
from checkpoints.meta import RunMeta
from checkpoints.verify import restore_falling_back
from models.attention import layout_shards
from sharding.mesh import make_mesh
from train.data import context_permutation, load_dataset
from train.data.tokenizer import load_tokenizer
from train.launcher.distributed import (
    any_process,
    close_output_filters,
    initialize,
    setup_devices,
    sync_processes,
    watch_peers,
)
from train.plan import apply_plan
from train.reports import fit, report
from train.runtime import step
from train.runtime.inference import fresh_state
from train.runtime.loop import DivergedLossError, LoopOptions, MetricsWriter, NonFiniteLossError, StopFlag, train_loop
from train.setup import cli, strategy_setup
from train.setup.calibrate import resolve_context_shares, resolve_counts
from train.setup.checks import check_simulated_devices, validate
from train.setup.config import RunConfig, resolve_mesh
from train.setup.configfile import write_record
from train.setup.parser import build_parser


def main(argv: list[str] | None = None, *, exit_hard: bool = False) -> int:
    """Entry point; returns the process exit code (1: non-finite loss, 2: any other error, 130: Ctrl-C outside the
    training loop).

    Args:
      argv: The flags (default ``sys.argv[1:]``).
      exit_hard: After a failed checkpoint save, end the process with `os._exit` (Orbax may leave
        non-daemon threads blocked); the command line sets it, tests do not.
    """
    try:
        return run(cli.parse(argv))
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except CheckpointFailure as e:
        print(f"error: {e}", file=sys.stderr)
        if exit_hard:
            sys.stdout.flush()
            sys.stderr.flush()
            close_output_filters()
            os._exit(2)
        return 2
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (
        KeyboardInterrupt
    ):  # inside the loop a SIGINT stops and saves (`train.runtime.loop.StopFlag`); this is outside it
        print(f"error: {INTERRUPTED}", file=sys.stderr)
        return 130


INTERRUPTED = (
    "interrupted (Ctrl-C) before the training loop started or while its last checkpoint was written; the "
    "checkpoints already complete in --run-dir are kept (--resume continues from the newest)"
)
"""The one line of a SIGINT outside the loop (start-up, data preparation, compilation, the final save), where
there is no step to finish and save."""


def run(config: RunConfig) -> int:
    """Checks ``config`` against the machine, then trains (or dry-runs); returns the exit code."""

    setup_devices(config.cluster.cpu_devices)
    processes = initialize(config.cluster.distributed())
    import jax

    log = report.logger(jax.process_index() == 0)
    config, tokenizer = prepare(config, jax.devices(), log)
    lock = None
    if not config.loop.dry_run:  # refuses a folder another run holds
        lock = hold_run_folder(config.checkpoint.run_dir, config.checkpoint.break_lock, jax.process_index(), log)
    try:
        return _run_prepared(config, tokenizer, processes, log)
    finally:
        if lock is not None:
            lock.release()


def hold_run_folder(run_dir: str, break_lock: bool, process_index: int, log):
    """The `checkpoints.lock.RunLock` of ``--run-dir``, taken by process 0 before anything in it is touched
    (None for the other processes, which share the folder by design); every process learns whether it was
    refused. ``break_lock`` is ``--break-lock``.

    Raises:
      checkpoints.lock.RunFolderLocked: (a ValueError) another run holds the folder.
    """

    lock, error = None, None
    if process_index == 0:
        try:
            lock = RunLock.acquire(run_dir, log, break_lock)
        except ValueError as e:
            error = e
    if any_process(error is not None):  # the other processes stop with process 0, not at its first collective
        if error is not None:
            raise error
        raise RunFolderLocked(
            f"--run-dir {run_dir}: process 0 could not take the folder's lock (its error is in its log)"
        )
    return lock


def _run_prepared(config: RunConfig, tokenizer, processes: str, log) -> int:
    import jax

    folder, ckpt, latest = Path(config.checkpoint.run_dir) / "checkpoints", None, None
    if not config.loop.dry_run:
        ckpt, latest = open_resumable(
            folder,
            config.checkpoint.keep,
            config.checkpoint.resume_step,
            config.model,
            tokenizer,
            log,
            config.checkpoint.discard_later,
        )
    watch = watch_peers(config.cluster.distributed(), folder)  # a lost process ends the others with one line
    log(f"{processes}; {jax.local_device_count()} local devices")
    if config.loop.dry_run:
        return report.dry_run(config, build_trainer(config, log), log, watch)
    try:
        # The data before the model: a raw source is prepared (every line read) and each split checked to hold
        # a sequence here, so a bad line or a source too small for --seq-len stops the run before anything is built.
        dataset = open_dataset(config, tokenizer, log)
        trainer = build_trainer(config, log)
        code = train(config, trainer, ckpt, latest, tokenizer, dataset, log)
    except BaseException:
        try:
            ckpt.close()
        except Exception as e:  # keep the first error; this one is a consequence
            print(f"note: closing the checkpoints also failed: {e}", file=sys.stderr)
        raise
    ckpt.close_or_fail()
    if watch is not None:
        watch.close()
    return code


def prepare(config: RunConfig, devices, log):
    """Resolves what needs the devices (``--plan auto``, the ``-1`` mesh axis, the context layout), loads
    the tokenizer and runs every check; returns ``(config, tokenizer)``.

    Raises:
      ValueError: As `train.setup.checks.validate`.
    """

    config = apply_plan(config, devices, log)
    check_simulated_devices(config.parallelism.mesh_shape, devices, config.cluster.cpu_devices)
    config = resolve_mesh(config, len(devices))
    tokenizer = load_tokenizer(config.data.tokenizer, config.data.eod_token)
    validate(config, len(devices), tokenizer)
    config = fit.resolve_budget(config, devices)
    fit.check_estimate(config)  # a state that cannot fit any layout is refused before anything is built
    return config, tokenizer


def build_trainer(config: RunConfig, log):
    """The mesh and the `train.runtime.step.Trainer` of ``config``, with the start-up report.

    Resolves what the strategy left to measure (e.g. uneven counts) and, where it asks, checks the compiled step
    (`train.setup.strategy_setup.check_compiled`: a pipeline's skipped slots), rebuilding the trainer with its fallback.
    """
    import jax

    par = config.parallelism
    outer = par.outer
    if outer is not None and jax.process_count() == 1:
        log("note: one process, so --mesh-outer has no effect")
        outer = None
    mesh = make_mesh(par.mesh_shape, outer=outer)
    par, speeds = resolve_counts(config, par.on(mesh), log)  # --hetero-batch auto measures, kinds reads datasheets
    par = resolve_context_shares(config, par, log)  # --context-shares auto measures the ring's devices
    trainer = step.Trainer(config.model, config.optimizer, par)
    notes = []
    if (checked_for := strategy_setup.compiled_check(trainer.par)) is not None:
        log(f"compiling the train step ({checked_for}) ...")
        t0 = time.perf_counter()
        compiled = trainer.compile_train_step(config.data.batch_size, trainer.par.positions(config.data.seq_len))
        log(f"compiled the train step in {time.perf_counter() - t0:.1f} s (later compilations of it are cached)")
        checked, note = strategy_setup.check_compiled(trainer.par, compiled.as_text())
        if note:
            notes.append(note)
            trainer = step.Trainer(config.model, config.optimizer, checked)
    for line in report.startup(config, trainer, speeds, notes):
        log(line)
    return trainer


def open_dataset(config: RunConfig, tokenizer, log):
    """The run's `train.data.Dataset`: ``--data`` opened (a raw source prepared on first use, in the cache).

    Raises:
      ValueError, FileNotFoundError, ImportError: as `train.data.load_dataset` (a bad line of a raw source, a
        split shorter than one sequence), naming the flag or the file.
    """

    data = config.data
    return load_dataset(
        data.spec,
        tokenizer,
        data.seq_len,
        data.batch_size,
        data.seed,
        data.heldout,
        data.cache_dir,
        log,
        permutation=_context_permutation(config, config.parallelism),
        text_field=data.text_field,
    )


def train(config: RunConfig, trainer, ckpt, latest, tokenizer, dataset, log) -> int:
    """Restores or initializes the state and runs the loop to ``--steps`` over ``dataset`` (`open_dataset`);
    returns 0."""
    import jax
    import numpy as np

    data = config.data
    with StopFlag() as stop:
        # The order along the length follows the trainer's context layout: measured shares
        # (--context-shares auto) are known only now, after the data was opened and checked.
        permutation = _context_permutation(config, trainer.par)
        if (permutation is None) != (dataset.permutation is None) or (
            permutation is not None and not np.array_equal(permutation, dataset.permutation)
        ):
            dataset = dataclasses.replace(dataset, permutation=permutation)
        state, (samples, iterator), latest = start_state(config, trainer, ckpt, latest, log)
        if jax.process_index() == 0 and config.record is not None:
            # Only once the run is accepted (resume checks passed): a refused command leaves the folder as it was.
            write_record(config.checkpoint.run_dir, config.record)
        writer = MetricsWriter(
            Path(config.checkpoint.run_dir),
            jax.process_index() == 0,
            latest,
            config.loop.trackers,
            None if config.record is None else config.record["flags"],
        )
        meta = RunMeta.create(
            config.model,
            config.preset,
            trainer.par.mesh_shape,
            trainer.rules,
            {
                "spec": data.spec,
                "seq_len": data.seq_len,
                "global_batch": data.batch_size,
                "seed": data.seed,
                "heldout": data.heldout,
            },
            tokenizer,
            trainer.state_layout.layout_meta(),
            config.schedule,
        )
        checkpoints = LoopCheckpoints(ckpt, meta)
        try:
            state, summary = train_loop(
                trainer=trainer,
                state=state,
                dataset=dataset,
                options=LoopOptions.of(config, trainer.par.padded_length),
                samples=samples,
                iterator=iterator,
                checkpoints=checkpoints,
                writer=writer,
                log=log,
                stop=stop,
                check_compiled=lambda compiled: fit.check_compiled(config, compiled),
            )
        except DivergedLossError as e:  # the parameters of step N-1 gave step N's loss: not a state to keep
            if e.step - 1 > (latest or 0):
                checkpoints.set_aside(e.step - 1, "diverged", log)
            raise
        finally:
            writer.close()
    t0 = time.perf_counter()
    checkpoints.finish(summary["step"])
    for line in report.summary_lines(summary, ckpt.directory, time.perf_counter() - t0):
        log(line)
    return 0


def start_state(config: RunConfig, trainer, ckpt, latest, log):
    """``(state, (samples, iterator), step)``: the latest checkpoint re-laid onto this run's mesh and layout, or a fresh
    state (`train.runtime.inference.fresh_state`: ``--init-from``'s weights or a random init; step None); ``samples`` and
    ``iterator`` are the saved data position and input pipeline state (`train.data.TrainBatches.state`). A step whose
    arrays do not read is set aside and the next older one restored (`checkpoints.verify.restore_falling_back`)."""
    import jax

    if latest is None:
        return fresh_state(config, trainer.state_layout, ckpt.directory, log), (0, None), None
    _check_optimizer(config, ckpt, latest)
    t0 = time.perf_counter()
    (state, meta), latest = restore_falling_back(
        ckpt.directory,
        latest,
        lambda step: restore_state(ckpt, trainer.state_layout, step),
        log,
        explicit=config.checkpoint.resume_step is not None,
        any_failed=any_process,
        reload=ckpt.reload,
        sync=sync_processes,
        leader=jax.process_index() == 0,
    )
    for line in report.resume_lines(config, trainer, meta, latest, time.perf_counter() - t0):
        log(line)
    return state, (meta.samples, meta.data.get("iterator")), latest


def _check_optimizer(config: RunConfig, ckpt, step: int) -> None:
    """Refuses to resume with another ``--optimizer``: its state has another structure (a checkpoint saved before
    the optimizer was recorded holds AdamW's).

    Raises:
      ValueError: Naming the saved optimizer and the flag that resumes it.
    """
    try:
        saved = (ckpt.read_meta(step).get("schedule") or {}).get("optimizer", "adamw")
    except Exception:  # an unreadable step is the restore's to report (and fall back from)
        return
    if saved != config.optimizer.name:
        raise ValueError(
            f"--optimizer {config.optimizer.name}: the checkpoint of step {step} in {ckpt.directory} "
            f"holds {saved}'s optimizer state; resume with --optimizer {saved}, or use another --run-dir"
        )


def _context_permutation(config: RunConfig, par):
    """The token order of ``par``'s context layout (the trainer's, uneven shares measured) along ``--seq-len``
    (None: natural)."""

    shares = par.context_shares if isinstance(par.context_shares, tuple) else None
    return context_permutation(
        config.data.seq_len, layout_shards(config.model.attention, par), par.context_layout, shares
    )


__all__ = ["build_parser", "main", "run"]


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main(exit_hard=True))
