"""meshwork's trainer: ``python -m train.train [flags]`` (``--help`` lists them; README has examples).

Flags -> `train.setup.config.RunConfig` (`train.setup.cli`) -> checks (`train.setup.checks`) -> `run`: build the mesh and
the `train.runtime.step.Trainer`, restore or initialize the state, and train (`train.runtime.loop`) or dry-run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from checkpoints import library_log
from checkpoints.manager import CheckpointFailure, open_resumable
from checkpoints.verify import saved_steps
from train.launcher.distributed import initialize, setup_devices
from train.launcher.orphan import watch_launcher
from train.launcher.output import close_output_filters
from train.launcher.peers import exit_lost, watch_peers
from train.reports import report
from train.runtime import training
from train.runtime.loop import NonFiniteLossError
from train.setup import cli
from train.setup.config import RunConfig
from train.setup.flagnames import render
from train.setup.parser import build_parser
from train.setup.startup import build_trainer, prepare


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
        print(f"error: {render(e)}", file=sys.stderr)
        return 1
    except CheckpointFailure as e:
        print(f"error: {render(e)}", file=sys.stderr)
        if exit_hard:
            sys.stdout.flush()
            sys.stderr.flush()
            close_output_filters()
            os._exit(2)
        return 2
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        print(f"error: {render(e)}", file=sys.stderr)
        return 2
    # inside the loop a SIGINT stops and saves (`train.runtime.loop.StopFlag`); this is outside it
    except KeyboardInterrupt:
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
    folder = Path(config.checkpoint.run_dir) / "checkpoints"
    watch_launcher(lambda: newest_note(folder), exit_lost)  # under train.launch: its death, in words
    setup_devices(config.cluster.cpu_devices)
    processes = initialize(config.cluster.distributed())
    import jax

    log = report.logger(jax.process_index() == 0)
    config, tokenizer = prepare(config, jax.devices(), log)
    lock = None
    if not config.loop.dry_run:  # refuses a folder another run holds
        lock = training.hold_run_folder(
            config.checkpoint.run_dir, config.checkpoint.break_lock, jax.process_index(), log
        )
    try:
        return _run_prepared(config, tokenizer, processes, log)
    finally:
        if lock is not None:
            lock.release()


def newest_note(folder: Path) -> str:
    """The newest step saved under ``folder``, in words, read from the folder's listing alone (no checkpoint is
    read: the line must be out before JAX's own abort); the resume verifies it."""
    steps = saved_steps(folder)
    return f"the newest checkpoint is step {steps[-1]} in {folder}" if steps else f"no checkpoint in {folder} yet"


def _run_prepared(config: RunConfig, tokenizer, processes: str, log) -> int:
    import jax

    folder, ckpt, latest = Path(config.checkpoint.run_dir) / "checkpoints", None, None
    if not config.loop.dry_run:
        library_log.capture(config.checkpoint.run_dir, jax.process_index())  # Orbax's threads: to a file
        ckpt, latest = open_resumable(
            folder,
            config.checkpoint.keep,
            config.checkpoint.resume_step,
            config.model,
            tokenizer,
            lambda line: log(render(line)),  # its notes name fields
            config.checkpoint.discard_later,
        )
    watch = watch_peers(config.cluster.distributed(), folder)  # a lost process ends the others with one line
    log(f"{processes}; {jax.local_device_count()} local devices")
    if config.loop.dry_run:
        return report.dry_run(config, build_trainer(config, log), log, watch)
    try:
        # The data before the model: a raw source is prepared (every line read) and each split checked to hold
        # a sequence here, so a bad line or a source too small for --seq-len stops the run before anything is built.
        dataset = training.open_dataset(config, tokenizer, log)
        trainer = build_trainer(config, log)
        code = training.train(config, trainer, ckpt, latest, tokenizer, dataset, log)
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


__all__ = ["build_parser", "main", "run"]


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main(exit_hard=True))
