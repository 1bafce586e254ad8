"""The configuration of a run: one frozen `RunConfig`, built once from the command line and passed down.

``RunConfig = ModelConfig + Parallelism + DataConfig + OptimizerConfig + LoopConfig + CheckpointConfig +
ClusterConfig``. `train.setup.cli.parse` builds it from argv before JAX starts; what needs the devices (a ``-1``
mesh size, ``--context-layout auto``, uneven counts from device speeds, ``--plan auto``) is resolved once
they are known (`resolve_mesh`, `train.strategies.resolve_uneven`, `train.setup.auto_plan.apply_plan`), each
returning a new `RunConfig` with its `Parallelism` replaced. `train.setup.checks.validate` checks it.
"""

from __future__ import annotations

import dataclasses

from models.attention import resolve_context_layout
from models.config import ModelConfig
from sharding.mesh import parse_mesh
from sharding.parallel import Parallelism
from train.launcher.distributed import DistributedConfig
from train.runtime.optimizer import OptimizerConfig

DEFAULT_RUN_DIR = "runs/default"
DEFAULT_REBALANCE = 10
"""``--rebalance-every`` with ``--hetero-batch auto``: steps between recomputing the counts."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The corpus and the batches.

    Attributes:
      spec: ``--data``: one source (``stdlib``, a text file, a folder, a JSONL or Parquet file, a prepared
        folder) or a weighted mixture of several (`train.data.pipeline.parse_sources`).
      tokenizer: A ``tokenizer.json`` path, or None for UTF-8 bytes.
      eod_token: The tokenizer's end-of-document token (None: autodetect).
      heldout: Fraction of documents held out for evaluation.
      cache_dir: Folder for tokenized corpora (None: ``$MESHWORK_CACHE`` or ``~/.cache/meshwork``).
      seq_len: T, tokens per sequence.
      batch_size: B, sequences per step (global).
      seed: Seed of parameters, data order and the held-out split.
      text_field: JSONL field or Parquet column of a raw source's text.
    """

    spec: str = "stdlib"
    tokenizer: str | None = None
    eod_token: str | None = None
    heldout: float = 0.01
    cache_dir: str | None = None
    seq_len: int = 256
    batch_size: int = 16
    seed: int = 0
    text_field: str = "text"


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """What the training loop does and when (steps are global step numbers)."""

    steps: int = 150
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    skip_nonfinite: int = 0
    progress: bool = True
    dry_run: bool = False
    max_loss: float | None = None  # --max-loss: None auto (train.runtime.divergence), inf off
    profile_steps: tuple[int, int] | None = None  # --profile-steps A:B (train.runtime.profile)
    trackers: tuple[str, ...] = ()  # --wandb, --mlflow (train.runtime.loop.TRACKERS)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where the run lives, how often it is saved, and where it starts (``init_from``: a Hugging Face
    folder, read when there is no checkpoint to resume)."""

    run_dir: str = DEFAULT_RUN_DIR
    resume: bool = False
    every: int = 50
    keep: int = 3
    resume_step: int | None = None
    init_from: str | None = None
    discard_later: bool = False  # --discard-later: set steps after resume_step aside
    break_lock: bool = False  # --break-lock: take over a lock held on another host


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """The devices and processes of the run, and the flags that describe a heterogeneous cluster.

    Attributes:
      cpu_devices: Simulated CPU devices (``--cpu-devices``), applied before JAX starts.
      coordinator, num_processes, process_id, dist_timeout: ``jax.distributed`` (None: JAX's cluster
        detection); the timeout in seconds.
      cluster: ``--cluster`` (a spec or an inventory file), for ``--plan auto``.
      simulate_cluster: ``--simulate-cluster``: kinds to pretend the CPU devices are.
      plan: ``auto`` to let the planner choose the `Parallelism`, else None.
      device_memory: Bytes one device may use (``--device-memory``; None: detected, `train.reports.fit`).
      device_memory_source: Where ``device_memory`` comes from, in words.
      external_coordinator: The coordination service at ``coordinator`` runs outside the training processes
        (``--external-coordinator``, given by `train.launch`); process 0 does not start one.
    """

    cpu_devices: int | None = None
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    dist_timeout: int = 300
    cluster: str | None = None
    simulate_cluster: str | None = None
    plan: str | None = None
    device_memory: int | None = None
    device_memory_source: str = "--device-memory"
    external_coordinator: bool = False

    def distributed(self):
        """The `train.launcher.distributed.DistributedConfig` of these flags."""
        return DistributedConfig(
            self.coordinator, self.num_processes, self.process_id, self.dist_timeout, self.external_coordinator
        )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run needs; see the module docstring.

    Attributes:
      model: The model (architecture and execution fields).
      preset: The ``--model`` preset it came from (recorded in checkpoints).
      parallelism: Mesh, rules, gradient strategy and context layout.
      data, optimizer, loop, checkpoint, cluster: as their classes say.
      record: What ``RUN_DIR/config.json`` records (`train.setup.configfile`): ``command`` (the command line) and
        ``flags`` (every flag's value); None when the config was not made from a command line.
    """

    model: ModelConfig
    preset: str
    parallelism: Parallelism
    data: DataConfig
    optimizer: OptimizerConfig
    loop: LoopConfig
    checkpoint: CheckpointConfig
    cluster: ClusterConfig
    record: dict | None = dataclasses.field(default=None, compare=False)

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)

    @property
    def schedule(self) -> dict:
        """The flags of the learning-rate schedule (recorded in checkpoints: `checkpoints.meta.RunMeta`)."""
        opt = self.optimizer
        return {
            "steps": self.loop.steps,
            "decay_steps": opt.decay_steps,
            "warmup": opt.warmup,
            "lr": opt.lr,
            "optimizer": opt.name,
            "schedule": opt.schedule,
            "beta1": opt.b1,
            "beta2": opt.b2,
            "eps": opt.eps,
        }

    @property
    def microbatch_rows(self) -> int:
        """Sequences per microbatch of the strategy (the global batch over all microbatches)."""
        par = self.parallelism
        total = getattr(par.strategy, "total", None)
        if total:
            return self.data.batch_size // total
        return self.data.batch_size // par.microbatches


def resolve_mesh(run: RunConfig, num_devices: int) -> RunConfig:
    """Fills the ``-1`` mesh axis from the device count and resolves ``--context-layout auto``.

    Raises:
      ValueError: As `sharding.mesh.parse_mesh` (naming ``--mesh`` and a shape that fits).
    """
    par = run.parallelism
    spec = ",".join(f"{a}={n}" for a, n in par.mesh_shape.items() if n != 1) or "data=1"
    par = par.replace(mesh_shape=parse_mesh(spec, num_devices))
    layout = resolve_context_layout(par.context_layout, run.model.attention, par.length_shards)
    return run.replace(parallelism=par.replace(context_layout=layout))


__all__ = ["CheckpointConfig", "ClusterConfig", "DataConfig", "LoopConfig", "RunConfig", "resolve_mesh"]
