"""Sharded, asynchronous checkpoints with Orbax.

A checkpoint step holds two items:

* ``state``: the train state pytree (parameters, optimizer state, step, RNG),
  every process writing its own shards (`orbax.checkpoint.args.StandardSave`);
* ``meta``: JSON with the model config, the mesh and rules it was saved
  from, the data position (samples consumed), tokenizer and batch settings.

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

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

STATE = "state"
META = "meta"


class CheckpointManager:
    """Saves and restores train states under ``directory``.

    Args:
      directory: the checkpoint folder (created if missing).
      keep: how many most recent checkpoints to keep (older ones are deleted).
      async_save: write in a background thread.
    """

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        if keep < 1:
            raise ValueError(f"--keep {keep}: must be at least 1")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=async_save,
        )
        handlers = {STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any], force: bool = True) -> bool:
        """Starts saving ``state`` and ``meta`` as ``step`` (returns before the write ends).

        Returns:
          Whether a save was started.
        """
        args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)})
        return self._manager.save(step, args=args, force=force)

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
        args = ocp.args.Composite(
            **{STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}
        )
        restored = self._manager.restore(step, args=args)
        return restored[STATE], dict(restored[META])

    def state_metadata(self, step: int | None = None) -> Any:
        """Orbax's metadata tree (shapes, dtypes) of the saved state."""
        step = self._resolve(step)
        return self._manager.item_metadata(step)[STATE]

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.close()

    def _resolve(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return step
