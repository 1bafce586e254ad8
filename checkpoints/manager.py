"""Sharded, asynchronous checkpoints with Orbax.

A checkpoint step holds two items:

* ``state``: the train state pytree (parameters, optimizer state, step, RNG),
  every process writing its own shards (`orbax.checkpoint.args.StandardSave`);
* ``meta``: JSON with the model config, the mesh and rules it was saved
  from, the data position (samples consumed) and the input pipeline's iterator
  state, tokenizer and batch settings,
  and the stage layout (``pipeline``; None for the canonical one).

Stacked layer arrays are stored as the run held them: ``[layers, ...]``
without a pipeline, ``[stage, slot, ...]`` (padded, see
`sharding.pipeline.StageLayout`) with one. A run with another layout restores
them in the saved layout onto its own mesh and re-lays them on device
(`restore_state` onto a `train.runtime.state.StateLayout`), so saves never pay for a re-layout and a
checkpoint resumes across stage counts and splits.

Restoring reads ``state`` onto abstract targets (`jax.ShapeDtypeStruct` with
the *current* run's shardings), so a checkpoint saved on one mesh restores
onto any other: Orbax reads each device's slice, and no full copy of the
model is ever built on one device.

Saves are asynchronous: `CheckpointManager.save` returns once the arrays are
copied off the devices; writing continues in the background and a step only
becomes visible once complete (Orbax writes to a temporary folder and renames
it), so a crash mid-save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from checkpoints import library_log
from checkpoints.meta import RunMeta
from checkpoints.names import META, STATE
from checkpoints.verify import latest_verified_step, saved_steps, set_aside, set_aside_later, verify_step
from sharding.errors import ConfigError, Field, FieldText
from sharding.pipeline.storage import layout_from_meta


class _ReadOnlyNotices(logging.Filter):
    """Drops Orbax's warnings that a read-only manager is read-only ("CheckpointManagerOptions.read_only=True,
    setting save_interval_steps=0", "Given directory is read only=..."): generate, evaluate and export ask for
    exactly that, and the lines read as a problem on their stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("read_only=True" in message or message.startswith("Given directory is read only"))


logging.getLogger("absl").addFilter(_ReadOnlyNotices())

# Test hooks, unset in real runs: seconds every asynchronous save waits before it may be committed, so that
# tests can kill a process in the middle of a save; or a file whose appearance lets the saves commit (at most
# SAVE_HOLD_LIMIT seconds after each started), so that a test holds a run in its save for exactly as long as it needs.
SAVE_PAUSE_ENV = "MESHWORK_TEST_SAVE_PAUSE"
SAVE_UNTIL_ENV = "MESHWORK_TEST_SAVE_UNTIL"
SAVE_HOLD_LIMIT = 300.0


class _PauseFuture:
    """An Orbax commit future that completes ``seconds`` after it was created, or once the file ``until``
    exists (polled every 50 ms; at most `SAVE_HOLD_LIMIT` seconds)."""

    def __init__(self, seconds: float, until: str | None = None):
        self._deadline = time.monotonic() + (SAVE_HOLD_LIMIT if until else seconds)
        self._until = until

    def result(self, timeout: float | None = None) -> None:
        del timeout
        while self._until and not os.path.exists(self._until) and time.monotonic() < self._deadline:
            time.sleep(0.05)
        if not self._until:
            time.sleep(max(0.0, self._deadline - time.monotonic()))

    def cancel(self) -> None:
        pass


def _finalizing() -> bool:
    """Whether Orbax's save-finalize thread is still running.

    Orbax (0.11-0.12) runs each asynchronous save's commit in a thread named
    ``save_finalize``; when it has ended, the save has either committed its step
    or failed. If a future Orbax renames the thread, this reads as "ended" and
    a save still writing would be misjudged, so the name is checked in a test.
    """
    return any(t.name == "save_finalize" and t.is_alive() for t in threading.enumerate())


def _state_handler():
    """Orbax's standard handler; with `SAVE_PAUSE_ENV` (seconds) or `SAVE_UNTIL_ENV` (a file) set, its saves
    commit no sooner than that (tests)."""
    handler = ocp.StandardCheckpointHandler()
    pause = float(os.environ.get(SAVE_PAUSE_ENV, "0") or 0)
    until = os.environ.get(SAVE_UNTIL_ENV) or None
    if pause > 0 or until:
        save = handler.async_save

        async def paused_async_save(*args, **kwargs):
            futures = await save(*args, **kwargs)
            return [*(futures or []), _PauseFuture(pause, until)]

        handler.async_save = paused_async_save
    return handler


class CheckpointManager:
    """Saves and restores train states under ``directory``.

    Args:
      directory: the checkpoint folder (created if missing).
      keep: how many most recent checkpoints to keep (older ones are deleted).
      async_save: write in a background thread.
      read_only: only read (``generate``, ``evaluate``, ``export``): nothing is created, cleaned up or
        deleted, so a run training in the folder keeps its save in progress.
    """

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True, read_only: bool = False):
        if keep < 1:
            raise ConfigError(Field("keep", keep), ": must be at least 1")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            create=not read_only,
            enable_async_checkpointing=async_save,
            # leftovers of a save killed midway; a reader leaves them: they may be a live run's save in progress
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
        )
        handlers = {STATE: _state_handler(), META: ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._pending: int | None = None

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def resume_choice(self, explicit: int | None = None, field: str = "resume_step"):
        """The step to resume from: ``explicit`` (given by ``field``) or the newest that reads completely.

        Checks each candidate with `checkpoints.verify.verify_step` (metadata
        parsed, array index walked, data files present; no array data read).

        Returns:
          A `checkpoints.verify.ResumeChoice`: ``step`` (None without
          checkpoints) and ``notes``, one line per newer damaged step skipped.

        Raises:
          checkpoints.verify.CheckpointDamaged: (a ValueError) when the
            explicit step is missing or damaged, or no step reads completely.
        """

        return latest_verified_step(self.directory, explicit, field)

    def save(self, step: int, state: Any, meta: dict[str, Any], force: bool = True) -> bool:
        """Starts saving ``state`` and ``meta`` as ``step`` (returns before the write ends).

        Returns:
          Whether a save was started.
        """
        args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)})
        started = self._manager.save(step, args=args, force=force)
        if started:
            self._pending = step
        return started

    def check_for_errors(self) -> None:
        """Raises if an asynchronous save has failed (does not block).

        Orbax's own finalizing thread may consume a background error and only
        log it, so a save that ended without its step becoming visible counts
        as failed too.

        Raises:
          RuntimeError: naming the step and folder of the failed save.
        """
        self._manager.check_for_errors()
        if self._pending is not None and not _finalizing():
            step, self._pending = self._pending, None
            if not (self.directory / str(step)).is_dir():  # Orbax lists a step before it is committed
                raise RuntimeError(
                    f"the asynchronous save of step {step} in {self.directory} did not complete "
                    "(Orbax's error is logged above)"
                )

    def wait(self) -> None:
        """Blocks until any asynchronous save has finished (raising its error, if any)."""
        self._manager.wait_until_finished()

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata of ``step`` (default: the latest).

        Raises:
          FileNotFoundError: when there is no checkpoint.
        """
        step = self._resolve(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
        return dict(restored[META])

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restores ``step`` (default: latest) onto the shardings in ``abstract_state``.

        Args:
          abstract_state: the state tree as `jax.ShapeDtypeStruct`s, each with
            the ``sharding`` the restored array should have.
          step: which checkpoint.

        Returns:
          ``(state, meta)``.

        Raises:
          FileNotFoundError: when there is no checkpoint.
        """
        step = self._resolve(step)
        args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()})
        restored = self._manager.restore(step, args=args)
        return restored[STATE], dict(restored[META])

    def reload(self) -> None:
        """Re-lists the steps on disk (after a step folder was renamed aside)."""
        self._manager.reload()

    def state_metadata(self, step: int | None = None) -> Any:
        """Orbax's metadata tree (shapes, dtypes) of the saved state."""
        step = self._resolve(step)
        return self._manager.item_metadata(step)[STATE]

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.close()

    def close_or_fail(self) -> None:
        """`close`, raising `CheckpointFailure` (the CLI then exits hard) when finishing the saves fails."""
        try:
            self.close()
        except Exception as e:
            raise CheckpointFailure(
                f"finishing the checkpoints in {self.directory} failed: {e}{library_log.note()}"
            ) from e

    def _resolve(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return step


# What the training loop uses --------------------------------------------------------------------


class CheckpointFailure(RuntimeError):
    """A checkpoint could not be written; Orbax's background threads may be stuck, so the CLI exits hard."""


class LoopCheckpoints:
    """What the training loop needs from checkpoints: start a save, surface a failed one.

    Args:
      manager: The `CheckpointManager`.
      meta: The run's `checkpoints.meta.RunMeta`; each save records its step and data position.
      kept: What of a state a save writes (``state -> state``, e.g.
        `train.runtime.state.StateLayout.adapters_state` where ``meta.base`` is set); None: all of it.
    """

    def __init__(self, manager: CheckpointManager, meta, kept=None):
        self.manager, self.meta = manager, meta
        self.kept = (lambda state: state) if kept is None else kept

    def save(self, state, step: int, samples: int, iterator: dict | None = None) -> None:
        """Starts saving ``state`` as ``step`` after ``samples`` sequences, with the input pipeline's
        ``iterator`` state in the ``meta`` item.

        Raises:
          CheckpointFailure: When the save cannot start (its error, with the step and folder).
        """
        try:
            self.manager.save(step, self.kept(state), self.meta.at(step, samples, iterator).to_json())
        except Exception as e:  # any failure to start a save ends the run with it
            raise CheckpointFailure(
                f"saving the checkpoint of step {step} in {self.manager.directory} failed: {e}{library_log.note()}"
            ) from e

    def check(self) -> None:
        """Raises `CheckpointFailure` at once if a background save has failed."""
        try:
            self.manager.check_for_errors()
        except Exception as e:  # the background save's own error, raised here at once
            raise CheckpointFailure(f"a checkpoint save failed, so training stopped: {e}{library_log.note()}") from e

    def set_aside(self, step: int, why: str, log) -> None:
        """Waits for the pending saves, then renames ``step``'s folder, if this run saved one, to
        ``STEP.WHY-TIME`` (`checkpoints.verify.set_aside`: nothing deleted, never resumed from); one line.

        For a run stopped by its loss: the loss of step N is computed from the parameters saved as step N-1.
        """
        try:
            self.manager.wait()
        except Exception:  # a failed save is reported when the manager closes; there is nothing to rename
            return
        if step not in self.manager.all_steps():
            return

        moved = set_aside(self.manager.directory, step, why)
        if moved is not None:
            log(f"the checkpoint of step {step} holds the parameters whose loss stopped the run; set aside as {moved}")

    def finish(self, step: int) -> None:
        """Waits for the pending save of ``step`` and raises `CheckpointFailure` if it failed."""
        try:
            self.manager.wait()
            self.manager.check_for_errors()
        except Exception as e:
            raise CheckpointFailure(
                f"the checkpoint of step {step} could not be written: {e}{library_log.note()}"
            ) from e


def open_resumable(directory, keep: int, explicit: int | None, config, tokenizer, log, discard_later: bool = False):
    """The run's `CheckpointManager` and the step to resume from (None: start fresh).

    The step is ``explicit`` (``--resume-step``) or the newest that reads completely
    (`checkpoints.verify.latest_verified_step`; each newer damaged step is logged with why), and its metadata
    must match the run (`checkpoints.meta.RunMeta.check_compatible`). Every damaged step is then set aside
    (`set_aside_damaged`) before the manager opens, so that ``keep`` counts only steps that read completely
    and retention never deletes a good step while a damaged one stays.

    With an explicit step below later steps, the later ones are set aside when ``discard_later``
    (``--discard-later``), else the run is refused (`checkpoints.verify.set_aside_later`).

    Raises:
      ValueError: A damaged or missing explicit step, later steps without ``discard_later``, no step that
        reads completely, or a checkpoint saved with another model, tokenizer or vocabulary; each naming
        what to do.
    """

    # Chosen, and damaged steps set aside, before Orbax lists the steps: its retention counts every step it lists.
    choice = latest_verified_step(directory, explicit)
    for note in choice.notes:
        log(note)
    set_aside_later(directory, explicit, discard_later, log)  # refused (ValueError) unless discard_later
    set_aside_damaged(directory, choice, log)
    manager = CheckpointManager(directory, keep=keep)
    if choice.step is not None:
        RunMeta.from_json(manager.read_meta(choice.step)).check_compatible(config, tokenizer, choice.step)
    return manager, choice.step


def set_aside_damaged(directory, choice, log) -> list[Path]:
    """Renames every damaged step folder but the chosen one to ``STEP.damaged-YYYYmmddTHHMMSSZ``, one line each.

    Orbax lists only folders named by an integer (or ``PREFIX_INTEGER``; the new name is neither, nor one of
    its temporary names), so a step set aside is no longer resumed from, counted by ``--keep`` or deleted by
    retention; its files stay untouched for inspection or repair. Checked with
    `checkpoints.verify.verify_step` (no array data read). Every process may call this at once: a
    folder another process has already moved is skipped.

    Args:
      directory: the checkpoint folder (``RUN_DIR/checkpoints``).
      choice: the `checkpoints.verify.ResumeChoice` of the run: its step is never moved, and the
        damage of the steps it skipped (already logged in its notes) is not repeated.
      log: called with each line.

    Returns:
      The new folders.
    """

    root, moved = Path(directory), []
    for step in saved_steps(root):
        verdict = verify_step(root, step)
        if step == choice.step or verdict.ok:
            continue
        target = set_aside(root, step, "damaged")
        if target is None:  # another process of this run moved it first
            continue
        moved.append(target)
        why = "" if step in choice.skipped else f"{verdict.line()}; "
        log(
            FieldText(
                f"{why}set damaged step {step} aside as {target} (not resumed from, not counted by ",
                Field("keep"),
                "; delete it once it is no longer needed)",
            )
        )
    return moved


def restore_state(manager: CheckpointManager, target, step: int | None = None, base_folder: str | None = None):
    """Restores a checkpoint onto a state layout's mesh and storage.

    Reads the saved stage layout from the checkpoint's metadata (``pipeline``; absent or None: canonical),
    restores onto targets in that layout with the current mesh's shardings (every device reads only its
    slice), then re-lays the stacked layer axis on device. A checkpoint whose base is by reference
    (`checkpoints.meta.RunMeta.base`: low-rank adapters on an imported model) holds the adapters' state
    alone: the base is read from its folder onto the mesh (`checkpoints.hf.load_params`) once the folder's
    weights are checked to be the ones the adapters were trained on (`check_base`).

    Args:
      manager: The `CheckpointManager`.
      target: What to restore onto: a `train.runtime.state.StateLayout` (``config.num_layers``,
        ``abstract_state(layout)`` and ``relayout_state(state, layout)``; not imported here, since
        checkpoints import nothing of train).
      step: The step (default: latest).
      base_folder: Where the base is now (``--init-from``), for a checkpoint whose base is by reference;
        None: the folder it records.

    Returns:
      ``(state, meta)``: the state in the target's layout and the `checkpoints.meta.RunMeta`.

    Raises:
      ValueError: A saved layout with another number of layers than the model; a base folder that is
        missing or holds other weights (`check_base`).
      FileNotFoundError: No checkpoint.
    """

    meta = RunMeta.from_json(manager.read_meta(step))
    src = layout_from_meta(meta.pipeline)
    if src is not None and src.num_layers != target.config.num_layers:
        raise ValueError(
            f"the checkpoint's stage layout {src.describe()} has {src.num_layers} layers; the model "
            f"has {target.config.num_layers}"
        )
    if meta.base is None:
        state, _ = manager.restore(target.abstract_state(src), step)
        return target.relayout_state(state, src), meta
    from checkpoints import hf  # slow: ml_dtypes

    folder = check_base(meta, base_folder, manager.directory)
    state, _ = manager.restore(target.abstract_state(src, adapters_only=True), step)
    state = target.relayout_state(state, src)
    return target.with_base(state, hf.load_params(folder, target.config, target.param_targets())), meta


def base_reference(folder: str | Path) -> dict[str, str]:
    """`checkpoints.meta.RunMeta.base` for adapters trained on the model in ``folder``: the folder and
    `checkpoints.peft.weights_digest` of its weights.

    Raises:
      ValueError: As `checkpoints.hf.weight_files`.
    """
    from checkpoints import peft  # slow: ml_dtypes

    return {"folder": str(folder), "sha256": peft.weights_digest(folder)}


def check_base(meta: RunMeta, folder: str | None, directory) -> str:
    """The base folder of a checkpoint whose base is by reference, checked to hold the weights its adapters
    were trained on (`checkpoints.peft.weights_digest` equal to the recorded one).

    Args:
      meta: The checkpoint's metadata (``base`` set).
      folder: Where the base is now, or None for the recorded folder.
      directory: The checkpoints' folder (for the message).

    Returns:
      The folder to read the base from.

    Raises:
      sharding.errors.ConfigError: One line naming the folder, the recorded one and what to pass (the
        ``init_from`` field): the folder is missing, or its weights differ from the recorded ones.
    """
    from checkpoints import peft  # slow: ml_dtypes

    recorded = meta.base["folder"]
    folder = recorded if folder is None else str(folder)
    where = (
        f"the checkpoint of step {meta.step} in {directory} keeps only adapters, trained on the base model {recorded}"
    )
    if not Path(folder).is_dir():
        raise ConfigError(
            f"{where}; {folder} is not a folder: put that model back there, or pass ",
            Field("init_from"),
            " with the folder it is in now",
        )
    digest = peft.weights_digest(folder)
    if digest != meta.base["sha256"]:
        raise ConfigError(
            f"{where} (weights sha256 {meta.base['sha256'][:16]}...); {folder} holds other weights "
            f"(sha256 {digest[:16]}...): pass ",
            Field("init_from"),
            " with the folder of the model the run started from",
        )
    return folder
