"""Uneven data parallelism: devices of a faster kind run more microbatches per step.

On a cluster that mixes device kinds, giving every device the same share of the batch lets the
slowest kind pace the step. Here each device ``i`` along the batch axes (``data`` x ``fsdp``) runs
its own number of microbatches ``counts[i]`` per step, proportional to its speed (`speed_counts`),
inside one SPMD program:

1. The global batch ``[B, T]`` (``B = sum(counts) * microbatch_rows``, laid out as the uniform
   step lays it out) is re-laid inside the step into a padded per-device buffer of
   ``max(counts) * microbatch_rows`` rows per device: device ``i`` gets ``counts[i]`` consecutive
   microbatches of the batch, then padding it never reads.
2. Inside `jax.shard_map` over the mesh, each device gathers the parameters it holds a shard of
   (FSDP) once, marks them device-varying (`jax.lax.pcast` ``to="varying"``) so that `jax.grad`
   inserts no collective, and loops ``counts[i]`` times (a ``while`` loop whose trip count is a
   per-device input), summing token-level loss and gradients. No collective runs inside the loop:
   with per-device trip counts one would deadlock (GUIDE.md, "Pitfalls").
3. After the loop, one reduction: a ``psum`` over the batch axes (``psum_scatter`` over ``fsdp``
   for sharded parameters). The summed gradient is divided by the global token count, exactly as
   the uniform step divides it, so the update equals the uniform-batch update.

The step returns, besides the state and the usual metrics, each device's count of microbatches
processed (the loop's final counter), ``[devices along data x fsdp]`` int32.

Supported layouts: meshes whose only split axes are ``data`` and ``fsdp`` (``stage``,
``sequence`` and ``tensor`` of size 1) with rules that split parameters over ``data``/``fsdp``
only: the ``dp`` and ``fsdp`` presets. ``--hetero-batch`` refuses anything else with a message
naming the flag. Sources for the idea of shares proportional to speed: HAP (EuroSys'24), Metis
(USENIX ATC'24), FlashFlex (2024).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sharding import axes as ax
from train.data import FIELDS

__all__ = ["HeteroTrainer", "device_speeds", "parse_hetero_batch", "speed_counts"]

_HETERO_EXAMPLE = "--hetero-batch 3,3,3,3,1,1,1,1"


def speed_counts(speeds: Sequence[float], total: int) -> list[int]:
    """Microbatches per device proportional to speed, rounded by largest remainder.

    Each device gets ``floor(total * speed / sum(speeds))``; the microbatches left go one each to
    the devices with the largest fractional parts (ties: the faster device, then the lower index).
    The counts sum to ``total``.

    Args:
      speeds: Relative speed of each device (e.g. peak FLOP/s), all > 0.
      total: Microbatches per step over all devices (global batch / microbatch rows).

    Returns:
      One count per device.

    Raises:
      ValueError: On an empty or non-positive speed, or ``total < 0``.
    """
    if not speeds or any(not s > 0 for s in speeds):
        raise ValueError(f"device speeds must be positive, got {list(speeds)}")
    if total < 0:
        raise ValueError(f"total microbatches must be >= 0, got {total}")
    whole = sum(speeds)
    exact = [total * s / whole for s in speeds]
    counts = [math.floor(e) for e in exact]
    left = total - sum(counts)
    order = sorted(range(len(speeds)), key=lambda i: (-(exact[i] - counts[i]), -speeds[i], i))
    for i in order[:left]:
        counts[i] += 1
    return counts


def device_speeds(mesh, simulated: Mapping[int, Any] | None = None) -> list[float]:
    """Peak FLOP/s of each device along the batch axes, in the order of the step's counts.

    Args:
      mesh: The `jax.sharding.Mesh`.
      simulated: ``device.id -> DeviceKind`` from `sharding.devices.simulate_inventory`.

    Returns:
      One speed per position along ``data`` x ``fsdp`` (taken from the device at index 0 of the
      other axes).

    Raises:
      ValueError: When a device's peak is unknown (e.g. CPU without ``--simulate-cluster``).
    """
    from sharding.devices import peak_flops

    grid = _batch_grid(mesh)
    speeds = []
    for device in grid:
        peak = peak_flops(device, simulated)
        if peak is None:
            raise ValueError(
                f"--hetero-batch auto: the peak speed of device {device.id} ({device.device_kind}) is unknown; "
                f"give --simulate-cluster (e.g. h100:4,a100:4) or explicit counts ({_HETERO_EXAMPLE})"
            )
        speeds.append(peak)
    return speeds


def _batch_grid(mesh) -> list[Any]:
    """Devices along ``data`` x ``fsdp`` (data-major), the others at index 0."""
    names = list(mesh.axis_names)
    index = tuple(slice(None) if n in ax.BATCH_MESH_AXES else 0 for n in names)
    return list(np.asarray(mesh.devices[index]).reshape(-1))


def parse_hetero_batch(value: str, num_devices: int, total: int, speeds: Sequence[float] | None) -> list[int] | None:
    """Resolves ``--hetero-batch auto|off|COUNTS`` to per-device microbatch counts.

    Args:
      value: ``off`` (None: the uniform step), ``auto`` (`speed_counts` of ``speeds``) or comma
        separated counts, one per device along ``data`` x ``fsdp``.
      num_devices: Devices along ``data`` x ``fsdp``.
      total: Microbatches in the global batch (``--batch-size`` / microbatch rows).
      speeds: Device speeds for ``auto``.

    Returns:
      The counts, or None for ``off``.

    Raises:
      ValueError: On malformed counts, a wrong number of them, negative ones, counts that do not
        sum to ``total``, or ``auto`` without speeds; messages name the flag and a value that works.
    """
    value = value.strip().lower()
    if value == "off":
        return None
    if value == "auto":
        if speeds is None:
            raise ValueError(f"--hetero-batch auto needs device speeds: pass --cluster/--simulate-cluster, "
                             f"or give counts ({_HETERO_EXAMPLE})")
        return speed_counts(speeds, total)
    try:
        counts = [int(x) for x in value.split(",")]
    except ValueError:
        raise ValueError(f"--hetero-batch {value!r}: expected auto, off or comma-separated integers "
                         f"({_HETERO_EXAMPLE})") from None
    example = ",".join(map(str, speed_counts([1.0] * num_devices, total))) if total >= 0 else ""
    if len(counts) != num_devices:
        raise ValueError(f"--hetero-batch {value}: {len(counts)} counts for {num_devices} devices along data x fsdp; "
                         f"give one per device, e.g. --hetero-batch {example}")
    if any(c < 0 for c in counts) or sum(counts) != total:
        raise ValueError(f"--hetero-batch {value}: counts must be >= 0 and sum to the {total} microbatches of the "
                         f"batch (--batch-size / microbatch rows), e.g. --hetero-batch {example}")
    return counts


class HeteroTrainer:
    """A `train.step.Trainer`'s model, state and optimizer, stepped with uneven per-device batches.

    Everything but the train step (state shardings, init, eval step, signals, batch sharding) is
    the wrapped trainer's; attributes not defined here are read from it.

    Args:
      trainer: The uniform `train.step.Trainer` (its ``microbatches`` is ignored).
      counts: Microbatches per device along ``data`` x ``fsdp`` (data-major, as the mesh orders
        devices), summing to ``global_batch / microbatch_rows``.
      microbatch_rows: Sequences per microbatch.

    Raises:
      ValueError: When the mesh splits ``stage``, ``sequence`` or ``tensor``, the rules split a
        parameter over another axis, the counts do not match the devices, or are all zero.
    """

    def __init__(self, trainer, counts: Sequence[int], microbatch_rows: int):
        self.trainer = trainer
        self.counts = tuple(int(c) for c in counts)
        self.microbatch_rows = int(microbatch_rows)
        mesh = trainer.mesh
        self.batch_axes = tuple(a for a in ax.BATCH_MESH_AXES if mesh.shape[a] > 1)
        self.num_batch_devices = math.prod(mesh.shape[a] for a in ax.BATCH_MESH_AXES)
        _check_layout(trainer, self.counts, self.num_batch_devices, self.microbatch_rows)
        self.global_batch = sum(self.counts) * self.microbatch_rows
        self._steps: dict[tuple, Any] = {}

    def __getattr__(self, name):
        return getattr(self.trainer, name)

    # Layout ------------------------------------------------------------------------------------

    @property
    def max_count(self) -> int:
        return max(self.counts)

    def row_index(self) -> np.ndarray:
        """``[devices, max_count * microbatch_rows]`` rows of the global batch each device holds.

        Device ``i`` holds microbatches ``sum(counts[:i]) .. sum(counts[:i+1]) - 1`` (rows in
        order), then row 0 as padding it never reads.
        """
        mb, width = self.microbatch_rows, self.max_count * self.microbatch_rows
        index = np.zeros((len(self.counts), width), np.int32)
        start = 0
        for i, count in enumerate(self.counts):
            index[i, : count * mb] = np.arange(start, start + count * mb)
            start += count * mb
        return index

    def _spec(self) -> PartitionSpec:
        return PartitionSpec(self.batch_axes or None)

    # The step ----------------------------------------------------------------------------------

    def gradients(self, params, batch) -> tuple[jax.Array, jax.Array, Any, jax.Array]:
        """Summed loss, token count and gradients of the global batch, and microbatches per device.

        Args:
          params: The parameters (sharded as the trainer shards them).
          batch: The global batch, dict of ``[B, T]`` arrays (`train.data.FIELDS`).

        Returns:
          ``(loss_sum, weight_sum, grads, processed)``: float32 scalars (nats, tokens), gradient
          sums with the parameters' structure and shardings, and int32 ``[devices]``.
        """
        mesh, index = self.trainer.mesh, self.row_index()
        spec = self._spec()
        sharding = NamedSharding(mesh, spec)
        padded = {
            f: jax.lax.with_sharding_constraint(jnp.take(batch[f], jnp.asarray(index.reshape(-1)), axis=0), sharding)
            for f in FIELDS
        }
        counts = jax.lax.with_sharding_constraint(jnp.asarray(np.asarray(self.counts, np.int32)), sharding)
        param_specs = jax.tree.map(lambda s: s.spec, self.trainer.param_shardings)
        run = jax.shard_map(
            self._local,
            mesh=mesh,
            in_specs=(param_specs, {f: spec for f in FIELDS}, spec),
            out_specs=(PartitionSpec(), PartitionSpec(), param_specs, spec),
        )
        return run(params, padded, counts)

    def _local(self, params, buffer, count):
        """Per-device body: gather, mark varying, loop over this device's microbatches, reduce once."""
        varying = self.batch_axes
        specs = jax.tree.map(lambda s: s.spec, self.trainer.param_shardings)
        # A gathered parameter stays typed as varying over the axes it was gathered over (jax
        # 0.10-0.12); mark it varying over the other batch axes too.
        full = jax.tree.map(lambda p, s: _to_varying(_gather(p, s), _invariant_axes(s, varying)), params, specs)
        mb = self.microbatch_rows
        local = self.trainer.par.local()
        grad_fn = jax.value_and_grad(lambda p, b: self.trainer.loss_sums(p, b, local), has_aux=True)

        def body(carry):
            i, loss_acc, weight_acc, grad_acc = carry
            micro = {f: jax.lax.dynamic_slice_in_dim(x, i * mb, mb, axis=0) for f, x in buffer.items()}
            (loss_sum, weight), grads = grad_fn(full, micro)
            grad_acc = jax.tree.map(jnp.add, grad_acc, grads)
            return i + 1, loss_acc + loss_sum, weight_acc + weight, grad_acc

        zero = _to_varying(jnp.zeros((), jnp.float32), varying)
        init = (_to_varying(jnp.zeros((), jnp.int32), varying), zero, zero,
                jax.tree.map(lambda p: _to_varying(jnp.zeros(p.shape, p.dtype), varying), full))
        processed, loss_sum, weight, grads = jax.lax.while_loop(lambda c: c[0] < count[0], body, init)
        # The one reduction of the step, after every device has left its loop.
        loss_sum = jax.lax.psum(loss_sum, varying)
        weight = jax.lax.psum(weight, varying)
        grads = jax.tree.map(lambda g, s: _reduce(g, s, varying), grads, specs)
        return loss_sum, weight, grads, processed.reshape(1)

    def _step_fn(self, state, batch, signals):
        loss_sum, weight, grads, processed = self.gradients(state["params"], batch)
        new_state, metrics = self.trainer.apply_gradients(state, loss_sum, weight, grads, signals)
        metrics["microbatches"] = jnp.sum(processed)
        return new_state, metrics, processed

    def _jit(self, global_batch: int, seq_len: int, with_counts: bool):
        self._check_batch(global_batch)
        key = (global_batch, seq_len, with_counts)
        if key not in self._steps:
            trainer = self.trainer
            batch_shardings = {f: trainer.batch_sharding(global_batch, seq_len) for f in FIELDS}
            fn = self._step_fn if with_counts else (lambda s, b, g: self._step_fn(s, b, g)[:2])
            outs = (trainer.state_shardings, trainer.replicated)
            if with_counts:
                outs += (NamedSharding(trainer.mesh, self._spec()),)
            self._steps[key] = jax.jit(
                fn,
                in_shardings=(trainer.state_shardings, batch_shardings, trainer.signal_sharding()),
                out_shardings=outs,
                donate_argnums=0,
            )
        return self._steps[key]

    def train_step(self, global_batch: int, seq_len: int):
        """The jitted ``(state, batch, signals) -> (state, metrics)`` (as `Trainer.train_step`).

        ``batch`` is the global batch laid out as for the uniform step; metrics are the uniform
        step's plus ``microbatches`` (the total processed). Donates ``state``.

        Raises:
          ValueError: When ``global_batch`` is not ``sum(counts) * microbatch_rows``.
        """
        return self._jit(global_batch, seq_len, False)

    def counted_step(self, global_batch: int, seq_len: int):
        """As `train_step`, also returning each device's microbatches processed, int32 ``[devices]``."""
        return self._jit(global_batch, seq_len, True)

    def compile_train_step(self, global_batch: int, seq_len: int):
        """Ahead-of-time compiled `train_step` from abstract shapes."""
        trainer = self.trainer
        signals = jax.ShapeDtypeStruct((trainer.mesh.devices.size,), jnp.int32, sharding=trainer.signal_sharding())
        return self.train_step(global_batch, seq_len).lower(
            trainer.abstract_state(), trainer.abstract_batch(global_batch, seq_len), signals).compile()

    def _check_batch(self, global_batch: int) -> None:
        if global_batch != self.global_batch:
            raise ValueError(
                f"--batch-size {global_batch} does not match --hetero-batch {','.join(map(str, self.counts))}: "
                f"{sum(self.counts)} microbatches x {self.microbatch_rows} sequences = {self.global_batch}; "
                f"use --batch-size {self.global_batch}"
            )

    def describe(self, kinds: Sequence[str] | None = None) -> str:
        """One line: counts per device (with kinds when given) and the padded buffer size."""
        parts = [f"{c}" + (f" ({k})" if kinds else "") for c, k in zip(self.counts, kinds or [None] * len(self.counts))]
        return (f"uneven data parallelism: microbatches of {self.microbatch_rows} sequences per device "
                f"{', '.join(parts)}; padded buffer {self.max_count} microbatches per device")


def _check_layout(trainer, counts: tuple[int, ...], devices: int, microbatch_rows: int) -> None:
    mesh = trainer.mesh
    others = [f"{a}={mesh.shape[a]}" for a in mesh.axis_names if a not in ax.BATCH_MESH_AXES and mesh.shape[a] > 1]
    if others:
        raise ValueError(
            f"--hetero-batch supports data-parallel meshes only (data, fsdp); --mesh splits {', '.join(others)}. "
            f"Use e.g. --mesh data={devices} --rules dp, or --hetero-batch off"
        )
    for path, spec in jax.tree_util.tree_flatten_with_path(jax.tree.map(lambda s: s.spec, trainer.param_shardings),
                                                            is_leaf=lambda x: isinstance(x, PartitionSpec))[0]:
        used = {a for entry in spec for a in ((entry,) if isinstance(entry, str) else (entry or ()))}
        if used - set(ax.BATCH_MESH_AXES):
            raise ValueError(f"--hetero-batch supports the dp and fsdp rules; --rules {trainer.rules.name} splits "
                             f"parameters over {', '.join(sorted(used))}. Use --rules dp or --rules fsdp")
    if len(counts) != devices:
        raise ValueError(f"--hetero-batch: {len(counts)} counts for {devices} devices along data x fsdp; "
                         f"give one per device ({_HETERO_EXAMPLE})")
    if any(c < 0 for c in counts) or sum(counts) == 0:
        raise ValueError(f"--hetero-batch {','.join(map(str, counts))}: counts must be >= 0 and not all 0")
    if microbatch_rows < 1:
        raise ValueError(f"microbatch rows must be >= 1, got {microbatch_rows}")


def _axes_of(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _gather(p, spec: PartitionSpec):
    """The whole parameter from this device's shard (all-gather over the axes of each split dim)."""
    for dim, entry in enumerate(spec):
        names = _axes_of(entry)
        if names:
            p = jax.lax.all_gather(p, names, axis=dim, tiled=True)
    return p


def _to_varying(x, axes: tuple[str, ...]):
    """``x``, invariant over ``axes`` (replicated or just gathered), marked as varying over them.

    `jax.grad` of a loss with respect to a varying value adds no collective; with respect to an
    invariant one it adds a ``psum`` in the backward pass, which inside a loop whose trip count
    differs per device would deadlock.
    """
    return jax.lax.pcast(x, axes, to="varying")


def _invariant_axes(spec: PartitionSpec, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes of ``axes`` a parameter with ``spec`` is not split over."""
    split = {a for entry in spec for a in _axes_of(entry)}
    return tuple(a for a in axes if a not in split)


def _reduce(g, spec: PartitionSpec, axes: tuple[str, ...]):
    """Sum a gradient over ``axes``: reduce-scattered to the shard along its split dimensions
    first, then the (smaller) shard summed over the remaining axes."""
    for dim, entry in enumerate(spec):
        names = _axes_of(entry)
        if names:
            g = jax.lax.psum_scatter(g, names, scatter_dimension=dim, tiled=True)
    rest = _invariant_axes(spec, axes)
    return jax.lax.psum(g, rest) if rest else g


# --- train.py flags: --cluster, --simulate-cluster, --hetero-batch, --plan -------------------------


def add_flags(parser) -> None:
    """Adds the heterogeneous-cluster flag group to ``python -m train.train``'s parser."""
    g = parser.add_argument_group("heterogeneous clusters (README: Heterogeneous clusters)")
    g.add_argument("--cluster", default=None, metavar="SPEC|FILE",
                   help="the cluster, for --plan auto: KIND:COUNT per host, e.g. h100:8,a100:8[@400Gbps], or a "
                   "JSON/YAML inventory file; default: detected from the devices")
    g.add_argument("--simulate-cluster", default=None, metavar="SPEC",
                   help="pretend the (CPU) devices are this cluster, e.g. h100:4,a100:4 on 8 devices: their kinds "
                   "set --hetero-batch auto's shares and --plan auto's cluster")
    g.add_argument("--hetero-batch", default="off", metavar="auto|off|COUNTS",
                   help="uneven data parallelism: microbatches per device along data x fsdp, proportional to "
                   "device speed (auto) or given (e.g. 3,3,3,3,1,1,1,1; microbatch = --batch-size / their sum); "
                   "auto splits --microbatches x (data x fsdp) microbatches. dp/fsdp rules, data/fsdp meshes")
    g.add_argument("--plan", default=None, choices=("auto",),
                   help="choose --mesh, --rules, --microbatches, --remat, --hetero-batch and the stage split "
                   "with the planner (python -m sharding.plan) for --cluster/--simulate-cluster")


def validate_flags(args) -> None:
    """Checks of the heterogeneous-cluster flags that need no devices.

    Raises:
      ValueError: A malformed ``--cluster``/``--simulate-cluster``/``--hetero-batch``, or both
        ``--plan auto`` and explicit counts; naming the flag.
    """
    from sharding.devices import inventory_from_flag, parse_cluster

    if args.cluster:
        inventory_from_flag(args.cluster)
    if args.simulate_cluster:
        parse_cluster(args.simulate_cluster)
    value = args.hetero_batch.strip().lower()
    if value not in ("auto", "off"):
        try:
            counts = [int(x) for x in value.split(",")]
        except ValueError:
            raise ValueError(f"--hetero-batch {args.hetero_batch!r}: expected auto, off or comma-separated integers "
                             f"({_HETERO_EXAMPLE})") from None
        if any(c < 0 for c in counts) or sum(counts) == 0:
            raise ValueError(f"--hetero-batch {args.hetero_batch}: counts must be >= 0 and not all 0 "
                             f"({_HETERO_EXAMPLE})")
        if args.plan:
            raise ValueError(f"--plan auto chooses --hetero-batch itself; drop --hetero-batch {args.hetero_batch}")


def cluster_of(args, devices) -> tuple[Any, dict[int, Any] | None]:
    """``(inventory, simulated)``: from ``--simulate-cluster`` (device id -> kind), else
    ``--cluster``, else detected from ``devices``.

    Raises:
      ValueError: When the cluster's device count is not the number of devices.
    """
    from sharding.devices import detect_inventory, inventory_from_flag, simulate_inventory

    if args.simulate_cluster:
        return simulate_inventory(args.simulate_cluster, devices)
    if args.cluster:
        inventory = inventory_from_flag(args.cluster)
        if inventory.num_devices != len(devices):
            raise ValueError(f"--cluster {args.cluster} has {inventory.num_devices} devices but JAX sees "
                             f"{len(devices)}; describe every device, or use --simulate-cluster on CPU")
        return inventory, None
    return detect_inventory(devices), None


def apply_plan(args, config, devices, log) -> Any:
    """``--plan auto``: runs the planner and writes its choices into ``args``.

    Sets ``--mesh``, ``--rules`` (dropping ``--rule`` overrides), ``--microbatches``, ``--hetero-batch``
    and, for a pipeline, ``--stage-layers``, ``--pipeline-schedule`` and ``--pipeline-repeats``; the
    attention and dtype stay as given. Returns ``config`` with the plan's remat policy.

    Raises:
      ValueError: When no layout is found, or as `cluster_of`.
    """
    if args.plan != "auto":
        return config
    from sharding import planner
    from sharding.mesh import format_mesh

    inventory, _ = cluster_of(args, devices)
    options = planner.PlanOptions(attentions=(config.attention,), dtype=config.dtype)
    plans = planner.plan(config, inventory, args.batch_size, args.seq_len, options, top=1)
    if not plans:
        raise ValueError(f"--plan auto found no layout for --batch-size {args.batch_size} on {len(devices)} devices; "
                         f"try a --batch-size divisible by {len(devices)}")
    best = plans[0]
    lay = best.layout
    if args.rule:
        log(f"--plan auto: dropping --rule {' '.join(args.rule)} (the plan uses --rules {lay.rules_name} as is)")
    args.mesh = format_mesh(lay.mesh) if lay.num_devices > 1 else "data=1"
    args.rules, args.rule, args.microbatches = lay.rules_name, [], lay.microbatches
    args.hetero_batch = ",".join(map(str, best.counts)) if best.counts is not None else "off"
    if lay.mesh[ax.STAGE] > 1:
        args.stage_layers = ",".join(map(str, lay.stage_layers))
        args.pipeline_schedule = "circular" if lay.pipeline_repeats > 1 else "gpipe"
        args.pipeline_repeats = lay.pipeline_repeats if lay.pipeline_repeats > 1 else None
    fit = "" if best.fits else " (no plan fits the memory; this is the closest)"
    log(f"--plan auto{fit}: {best.flags()}; predicted {best.step_time:.3g} s/step, {best.tokens_per_second:,.0f} "
        f"tokens/s, MFU {best.mfu:.1%} on {inventory.num_devices} devices ({', '.join(k.name for k in inventory.kinds_present)})")
    return config.replace(remat=lay.remat)


def check_flags(args, mesh_shape: Mapping[str, int]) -> None:
    """``--hetero-batch`` against the mesh and batch, before any device work.

    Raises:
      ValueError: Explicit counts whose number is not the devices along data x fsdp, or whose sum
        does not divide ``--batch-size``; naming the flags.
    """
    value = args.hetero_batch.strip().lower()
    if value == "off":
        return
    devices = mesh_shape[ax.DATA] * mesh_shape[ax.FSDP]
    if value == "auto":
        return
    counts = [int(x) for x in value.split(",")]
    if len(counts) != devices:
        raise ValueError(f"--hetero-batch {args.hetero_batch}: {len(counts)} counts for the {devices} devices along "
                         f"data x fsdp of --mesh {args.mesh}; give one per device")
    if args.batch_size % sum(counts):
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by the {sum(counts)} microbatches of "
                         f"--hetero-batch {args.hetero_batch}; e.g. --batch-size {sum(counts) * max(1, args.batch_size // sum(counts))}")


def wrap_trainer(args, trainer, log):
    """The trainer for ``--hetero-batch``: a `HeteroTrainer` around ``trainer``, or ``trainer`` itself (off).

    ``auto``: ``--microbatches`` x (data x fsdp) microbatches of ``--batch-size`` / that many
    sequences, shared by device speed (`speed_counts`; speeds from ``--simulate-cluster`` or the
    devices' kinds). Counts: microbatches of ``--batch-size / sum(counts)`` sequences.

    Raises:
      ValueError: As `HeteroTrainer` and `parse_hetero_batch`.
    """
    value = args.hetero_batch.strip().lower()
    if value == "off":
        return trainer
    mesh = trainer.mesh
    devices = math.prod(mesh.shape[a] for a in ax.BATCH_MESH_AXES)
    speeds = None
    if value == "auto":
        _, simulated = cluster_of(args, list(mesh.devices.reshape(-1))) if args.simulate_cluster else (None, None)
        speeds = device_speeds(mesh, simulated)
        total = args.microbatches * devices
    else:
        total = sum(int(x) for x in value.split(","))
    counts = parse_hetero_batch(value, devices, total, speeds)
    hetero = HeteroTrainer(trainer, counts, args.batch_size // total)
    kinds = None
    if speeds is not None:
        kinds = [f"{s / 1e12:.0f} TFLOP/s" for s in speeds]
    log(hetero.describe(kinds))
    return hetero
