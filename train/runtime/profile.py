"""``--profile-steps A:B``: a `jax.profiler` trace of training steps A to B under ``RUN_DIR/profile``.

JAX writes ``profile/plugins/profile/<time>/<host>.xplane.pb`` (TensorBoard's profile plugin reads the folder:
``tensorboard --logdir RUN_DIR/profile``) and ``<host>.trace.json.gz`` (opens in Perfetto, ui.perfetto.dev).
The trace starts before step A is dispatched and stops once step B's state is computed, so it holds exactly
those steps' device work (and the host's work around them); every process writes its own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

PROFILE_FOLDER = "profile"
"""The trace's folder inside the run folder."""


def parse_profile_steps(text: str | None, steps: int) -> tuple[int, int] | None:
    """``--profile-steps A:B`` (or ``A``: that step alone) -> ``(A, B)``; None when not given.

    Raises:
      ValueError: Not ``A:B`` with ``1 <= A <= B <= --steps``; naming the flag.
    """
    if text is None:
        return None
    first, colon, last = str(text).partition(":")
    try:
        a, b = int(first), int(last if colon else first)
    except ValueError:
        a, b = 0, 0
    if not 1 <= a <= b:
        raise ValueError(f"--profile-steps {text}: expected A:B with 1 <= A <= B (steps), e.g. --profile-steps 5:8")
    if a > steps:
        raise ValueError(
            f"--profile-steps {text}: starts after --steps {steps}; e.g. --profile-steps {max(steps - 1, 1)}:{steps}"
        )
    return a, b


class StepProfiler:
    """Starts and stops the trace around the chosen steps (does nothing without them).

    Args:
      steps: ``(A, B)``, the first and last step traced (1-based global step numbers), or None.
      run_dir: the run folder (the trace goes to its `PROFILE_FOLDER`).
      log: called with one line when the trace starts and when it is written.
    """

    def __init__(self, steps: tuple[int, int] | None, run_dir: str | Path, log: Callable[[str], None]):
        self.steps, self.folder, self.log = steps, Path(run_dir) / PROFILE_FOLDER, log
        self.active = False

    def before(self, step: int) -> None:
        """Called before step ``step`` is dispatched: starts the trace at A (or at the first step run, when a
        resume starts inside A..B)."""
        if self.steps is None or self.active or not self.steps[0] <= step <= self.steps[1]:
            return
        import jax

        self.folder.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.folder))
        self.active = True
        self.log(f"profiling steps {step}..{self.steps[1]} into {self.folder}")

    def after(self, step: int, state) -> None:
        """Called once step ``step`` is dispatched; at B waits for its ``state`` and writes the trace."""
        if self.active and step >= self.steps[1]:
            import jax

            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        """Writes the trace if one is running (a run that stops inside A..B keeps what it traced)."""
        if not self.active:
            return
        import jax

        jax.profiler.stop_trace()
        self.active = False
        self.log(
            f"wrote the profile to {self.folder} (tensorboard --logdir {self.folder}, or its .trace.json.gz in "
            "Perfetto)"
        )
