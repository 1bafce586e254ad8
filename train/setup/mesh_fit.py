"""A ``--mesh`` refusal whose example is a mesh the run's own checks accept, found by trying candidates.

`sharding.mesh.parse_mesh` knows only the device count, so its example (``fsdp=6,tensor=2`` for 12 devices)
may be refused next by a check it cannot see (a batch of 16 that 6 does not divide, heads that 2 does not
divide). `resolve_mesh_or_suggest` tries shapes over the same device count through the checks that read the
mesh (batch, strategy, model sharding, experts) and names the first that passes; when none passes with the
run's batch, the first shape that passes with a rounded-up ``--batch-size``, both flags named.
"""

from __future__ import annotations

import dataclasses

from sharding import axes as ax
from sharding.errors import ConfigError, Field
from sharding.mesh import format_mesh
from train.setup.checks import check_batch, check_experts, check_model_sharding, check_strategy
from train.setup.config import RunConfig, resolve_mesh


def candidate_shapes(num_devices: int, given: dict[str, int]) -> list[dict[str, int]]:
    """Shapes of ``num_devices`` devices to try, in order: the given stage count kept when it divides the
    devices, the rest split as fsdp x tensor (tensor 2, 1, 4, 8, then the other divisors), then data x fsdp."""
    stage = given.get(ax.STAGE, 1)
    stage = stage if stage > 1 and num_devices % stage == 0 else 1
    rest = num_devices // stage
    divisors = [d for d in range(1, rest + 1) if rest % d == 0]
    tensors = [t for t in (2, 1, 4, 8) if t in divisors] + [t for t in divisors if t not in (1, 2, 4, 8)]
    shapes = [{ax.STAGE: stage, ax.FSDP: rest // t, ax.TENSOR: t} for t in tensors]
    shapes += [{ax.STAGE: stage, ax.DATA: d, ax.FSDP: rest // d} for d in divisors if d > 1]
    return [{axis: size for axis, size in shape.items() if size > 1} or {ax.FSDP: 1} for shape in shapes]


def _accepted(run: RunConfig, shape: dict[str, int]) -> bool:
    sizes = {axis: shape.get(axis, 1) for axis in run.parallelism.mesh_shape}
    trial = run.replace(parallelism=run.parallelism.replace(mesh_shape=sizes))
    try:
        check_batch(trial)
        check_strategy(trial)
        check_model_sharding(trial.model, trial.parallelism)
        check_experts(trial.model, trial.parallelism)
    except ValueError:
        return False
    return True


def fitting_mesh(run: RunConfig, num_devices: int) -> tuple[str, int | None] | None:
    """``(mesh, batch_size)``: the first candidate shape the run's checks accept (``batch_size`` None: the
    run's own), or with the batch rounded up to a multiple of the shape's data-parallel size; None if no
    candidate passes either way."""
    shapes = candidate_shapes(num_devices, run.parallelism.mesh_shape)
    for shape in shapes:
        if _accepted(run, shape):
            return format_mesh(shape), None
    for shape in shapes:
        rows = shape.get(ax.DATA, 1) * shape.get(ax.FSDP, 1)
        batch = -(-run.data.batch_size // rows) * rows
        bigger = run.replace(data=dataclasses.replace(run.data, batch_size=batch))
        if _accepted(bigger, shape):
            return format_mesh(shape), batch
    return None


def resolve_mesh_or_suggest(run: RunConfig, num_devices: int) -> RunConfig:
    """`train.setup.config.resolve_mesh`, whose refusal's example is replaced by `fitting_mesh`'s.

    Raises:
      ConfigError: As `resolve_mesh`, with an example the same checks accept when one is found.
    """
    try:
        return resolve_mesh(run, num_devices)
    except ConfigError as e:
        parts = e.parts
        example = parts[-2] if len(parts) >= 2 else None
        if not (isinstance(example, Field) and example.name == "mesh" and parts[-1] == ")"):
            raise
        found = fitting_mesh(run, num_devices)
        if found is None:
            raise
        mesh, batch = found
        tail = (")",) if batch is None else (" with ", Field("batch_size", batch), ")")
        raise ConfigError(*parts[:-2], Field("mesh", mesh), *tail) from None
