"""The distributed optimizer over ``data`` (ZeRO stage 1) priced: the state's share and the collectives it changes.

With ``Layout.optimizer_sharding == "data"`` (`sharding.zero`: Rajbhandari et al., SC'20, stage 1) each
float32 parameter and its two moments live split over ``data`` as well as the rules split them, by the same
choice of dimension the train state makes (`sharding.zero.master_dim`), read on the array the state holds
(`held_array`): without pipeline stages a per-layer parameter is one ``[layers, ...]`` stack (the scanned layer
loop's), so a model whose layer count ``data`` divides and whose other dimensions it does not (48 layers of width
7,168 on ``data=48``) has its state split along the layers, as the run splits it; with stages, one layer's slice
(the stored rows are laid out apart, `sharding.pipeline.storage`). The forward and backward
see the parameters as the rules lay them out, so gradients, activations and the tensor- and
length-parallel collectives are unchanged; what changes (`zero_comms`):

* each gradient's all-reduce over ``data`` becomes a reduce-scatter over ``data`` (result: the ``1/data``
  slice), and the new parameters come back by an all-gather over ``data`` (result: the rules' block), priced
  once per step each (XLA may place the gathers per layer inside the scanned stack: the same bytes in all; a
  ring all-reduce is the two, so the bytes on the links are the same). The gradients move in float32; the
  parameters in the compute dtype where it is narrower (`sharding.zero.gather_params` rounds the slices to
  bfloat16 before the gather, as Megatron-LM gathers its bf16 parameters), so with bfloat16 the gather moves
  half the all-reduce's second half. Priced only where the all-reduce is
  over ``data`` alone: a gradient all-reduced over ``data`` and ``fsdp`` together (a weight ``fsdp`` does not
  split) keeps its all-reduce and gets the reduce-scatter besides, an over-count on GPU;
* on XLA:CPU, which lowers a reduce-scatter to an all-reduce of the whole array and a slice
  (`sharding.costmodel.partitioner`), the gradient's all-reduce stays and the all-gather is added, in float32
  whatever the compute dtype (XLA:CPU upcasts bfloat16 collectives: `sharding.costmodel.partitioner._fsdp_gather_bytes`).
  A matrix's gradient split over ``fsdp`` whose master slice puts ``data`` on a dimension no axis splits yet
  (not the one ``fsdp`` splits: an MLP weight's ``mlp``, the output projection's ``vocab``, on ``data=4,fsdp=2``)
  is laid out over two dimensions, one axis each, and the partitioner sums it axis by axis: an all-reduce of the
  whole gradient over ``fsdp``, then of its result, whole again, over ``data`` (`cpu_two_step`; read in the
  partitioned program, ``bench/RESULTS.md``), in place of the one all-reduce over both.

Units: elements (`master_split`: a divisor), bytes.
"""

from __future__ import annotations

import dataclasses

from sharding import axes as ax
from sharding.costmodel.collectives import Comm
from sharding.costmodel.layout import _PARAM_BYTES, Layout, _place_cached, _Placed, _Shape, describe_model
from sharding.costmodel.partitioner import _fsdp_gather_bytes
from sharding.rules import Rules, logical_to_spec
from sharding.zero import _entry_axes, data_split, master_dim, not_split_lines


def zero_on(layout: Layout) -> bool:
    """Whether the layout splits its optimizer state over a ``data`` axis of more than one device."""
    return layout.optimizer_sharding == ax.DATA and layout.mesh[ax.DATA] > 1


def held_array(p: _Placed, rules: Rules, mesh, layers: int | None = None) -> tuple[tuple[int, ...], object]:
    """``(shape, PartitionSpec)`` of the array the train state holds for parameter ``p``, on which the distributed
    optimizer picks its dimension (`sharding.zero.master_dim`).

    Args:
      p: A parameter under the mesh and rules.
      rules: The rules table.
      mesh: Mesh axis -> size.
      layers: Without pipeline stages, the layers the model runs: a per-layer parameter is then held as its stack,
        ``[p.param.copies(layers), *slice]`` with the logical axis ``layers`` in front (the scanned loop's
        parameters, as ``--dry-run`` lists them). None (with stages, or a parameter outside the layers): one
        layer's slice, ``p.param.shape``.
    """
    shape, names = tuple(p.param.shape), tuple(p.param.axes)
    if layers is not None and p.param.per_layer:
        shape, names = (p.param.copies(layers), *shape), (ax.LAYERS, *names)
    spec, _ = logical_to_spec(names, rules, shape, mesh)
    return shape, spec


def stack_layers(layout: Layout, layers: int) -> int | None:
    """The ``layers`` `held_array` takes for a model running ``layers`` layers (a step's ``_Shape.slots``):
    ``layers`` without pipeline stages, None with them."""
    return layers if layout.mesh[ax.STAGE] == 1 else None


def master_split(p: _Placed, rules: Rules, mesh, layers: int | None = None) -> int:
    """How many ways ``data`` splits parameter ``p``'s float32 master copy and moments (1 or ``data``):
    `sharding.zero.data_split` of the array the state holds (`held_array`, ``layers`` as it takes them)."""
    shape, spec = held_array(p, rules, mesh, layers)
    return data_split(shape, spec, mesh)


def not_split(model, layout: Layout) -> list[str]:
    """The parameters the distributed optimizer leaves whole over ``data`` as the cost model prices them (each
    at its full bytes in ``parameters`` and ``optimizer``): `sharding.zero.not_split_lines` of one layer's slice
    of each; none when the layout keeps the state replicated or every parameter is split.

    Args:
      model: The model's `ModelDescription` (or an object with ``describe()``).
      layout: The layout.
    """
    if not zero_on(layout):
        return []
    rules, desc = layout.rules_table(), describe_model(model)
    placed = _place_cached(desc, rules, tuple(layout.mesh.items()))
    layers = stack_layers(layout, desc.num_layers)
    arrays = [(p.param.path, *held_array(p, rules, layout.mesh, layers)) for p in placed.values()]
    return not_split_lines(arrays, layout.mesh)


def cpu_two_step(p: _Placed, rules: Rules, mesh, layers: int | None = None) -> bool:
    """Whether XLA:CPU sums matrix ``p``'s gradient over ``data`` and ``fsdp`` in two all-reduces of the whole
    gradient (over ``fsdp``, then ``data``) rather than one over both: ``fsdp`` splits one dimension of one
    layer's slice and `sharding.zero.master_dim` puts ``data`` on another that no axis splits (module docstring).
    Not the embedding table, whose gradient is a scatter the partitioner sums over both axes at once.

    Args:
      p: A parameter under the mesh and rules (one layer's slice of a per-layer parameter).
      rules: The rules table.
      mesh: Mesh axis -> size (``data`` > 1: the distributed optimizer on).
      layers: As `held_array` takes them.
    """
    if not p.param.matmul or mesh[ax.FSDP] <= 1:
        return False
    shape, spec = held_array(p, rules, mesh, layers)
    dim = master_dim(shape, spec, mesh)
    entries = [_entry_axes(spec[d] if d < len(spec) else None) for d in range(len(shape))]
    return dim is not None and not entries[dim] and any(ax.FSDP in e for e in entries)


def _cpu_gradient_sums(
    layout: Layout, rules: Rules, comm: Comm, placed: dict[str, _Placed], layers: int | None
) -> list[Comm]:
    """``comm`` as XLA:CPU runs it under the distributed optimizer: a gradient's all-reduce over ``data`` and
    ``fsdp`` split in two where `cpu_two_step` says, each of the whole gradient; else ``[comm]``."""
    if comm.kind != "all-reduce" or not {ax.DATA, ax.FSDP} <= set(comm.axes):
        return [comm]
    p = placed.get(comm.what.removeprefix("gradient of "))
    if p is None or not comm.what.startswith("gradient of ") or not cpu_two_step(p, rules, layout.mesh, layers):
        return [comm]
    rest = tuple(a for a in comm.axes if a != ax.FSDP)
    return [
        dataclasses.replace(comm, axes=(ax.FSDP,), group=layout.mesh[ax.FSDP], what=comm.what + " (over fsdp)"),
        dataclasses.replace(comm, axes=rest, group=comm.group // layout.mesh[ax.FSDP], what=comm.what + " (then data)"),
    ]


def zero_comms(
    layout: Layout, rules: Rules, placed: dict[str, _Placed], s: _Shape, backend: str, scale: float = 1.0
) -> list[Comm]:
    """The collectives the distributed optimizer adds to a step (the gradients' reduce-scatter on GPU
    replaces their all-reduce over ``data``: `replaced_all_reduce` says which to drop).

    Args:
      layout: The layout (``optimizer_sharding`` ``data``).
      rules: Its rules table.
      placed: The parameters under the mesh and rules.
      s: The step's shape (``s.slots``: layers per device).
      backend: ``gpu`` (reduce-scatter and all-gather) or ``cpu`` (all-gather; the reduce-scatter is an
        all-reduce there, already priced).
      scale: The state's bytes of the parameters over what ``placed`` says (1 without stages; with them the
        stage's share of the storage, `with_zero`).

    Returns:
      One all-gather per parameter split over ``data`` (and on GPU one reduce-scatter), once per step: the
      gradient's slice in float32, the parameters in the dtype the gather moves (`_fsdp_gather_bytes`: the
      compute dtype on GPU, float32 on CPU).
    """
    if not zero_on(layout):
        return []
    mesh, d, layers = layout.mesh, layout.mesh[ax.DATA], stack_layers(layout, s.slots)
    gathered = _fsdp_gather_bytes(layout, backend)
    comms = []
    for p in placed.values():
        if master_split(p, rules, mesh, layers) <= 1:
            continue
        block = p.local * p.param.copies(s.slots) * scale
        what = f"{p.param.path} (distributed optimizer)"
        if backend == "gpu":
            comms.append(
                Comm("reduce-scatter", (ax.DATA,), d, block * _PARAM_BYTES / d, 1, "gradient slice of " + what)
            )
        comms.append(Comm("all-gather", (ax.DATA,), d, block * gathered, 1, "parameters of " + what))
    return comms


def replaced_all_reduce(
    layout: Layout, rules: Rules, comm: Comm, placed: dict[str, _Placed], backend: str, layers: int | None = None
) -> bool:
    """Whether ``comm`` is a gradient's all-reduce over ``data`` alone that the distributed optimizer's
    reduce-scatter replaces: on GPU every such all-reduce of a parameter split over ``data``; on XLA:CPU only
    the second all-reduce a parameter split over ``fsdp`` takes, of its ``fsdp`` shard over ``data``
    (``... (over data)``: the whole gradient's all-reduce over the batch axes, the CPU form of the
    reduce-scatter, now yields the ``data`` slice directly; with pipeline stages too, where the head's output
    projection and final norm, stored over ``stage``, are summed whole over ``data`` x ``stage`` once and their
    slice's second all-reduce over ``data`` goes: read on ``data=4,stage=2`` and ``data=2,tensor=2,stage=2``,
    ``bench/RESULTS.md``; the layers' stored rows, all-reduced over ``data`` alone, keep theirs). ``layers`` as
    `held_array` takes them."""
    if not zero_on(layout) or comm.kind != "all-reduce" or tuple(comm.axes) != (ax.DATA,):
        return False
    if backend != "gpu" and not comm.what.endswith(" (over data)"):
        return False
    path = comm.what.removeprefix("gradient of ").removesuffix(" (over data)")
    p = placed.get(path)
    return p is not None and master_split(p, rules, layout.mesh, layers) > 1


def with_zero(layout: Layout, rules: Rules, placed: dict[str, _Placed], s: _Shape, flops, memory, comms, backend: str):
    """``(flops, memory, comms)`` of a step priced replicated, re-priced for the distributed optimizer (the
    same values when ``layout`` keeps it replicated).

    The parameters and the two moments the state holds take each parameter's master share (`master_split`;
    with a pipeline, the replicated storage's bytes scaled by the share the same parameters take without
    stages), the optimizer update runs on them, and the collectives change as `zero_comms` says. Gradients,
    activations, logits and gathered weights keep their replicated prices: the forward and backward see the
    parameters as the rules lay them out.

    Args:
      layout, rules, placed, s: As the cost model's other terms take them.
      flops: The `sharding.costmodel.flops.Flops` priced replicated.
      memory: The `sharding.costmodel.memory.Memory` priced replicated.
      comms: The collectives (`Comm`) priced replicated.
      backend: ``gpu`` or ``cpu``.
    """
    if not zero_on(layout):
        return flops, memory, comms
    layers = stack_layers(layout, s.slots)
    full = sum(p.local * p.param.copies(s.slots) for p in placed.values())
    share = sum(
        p.local * p.param.copies(s.slots) / master_split(p, rules, layout.mesh, layers) for p in placed.values()
    )
    ratio, scale = (share / full, memory.parameters / (full * _PARAM_BYTES)) if full else (1.0, 1.0)
    added = zero_comms(layout, rules, placed, s, backend, scale)
    memory = dataclasses.replace(memory, parameters=memory.parameters * ratio, optimizer=memory.optimizer * ratio)
    flops = dataclasses.replace(flops, optimizer=flops.optimizer * ratio)
    kept = [c for c in comms if not replaced_all_reduce(layout, rules, c, placed, backend, layers)]
    if backend != "gpu":
        kept = [part for c in kept for part in _cpu_gradient_sums(layout, rules, c, placed, layers)]
    return flops, memory, (*kept, *added)


__all__ = [
    "cpu_two_step",
    "held_array",
    "master_split",
    "stack_layers",
    "not_split",
    "replaced_all_reduce",
    "with_zero",
    "zero_comms",
    "zero_on",
]
