"""Reading compiled HLO text: collectives, loop trip counts, matrix products, conditional branches.

`collectives(compiled.as_text())` lists every collective instruction
(all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute and
their asynchronous ``-start`` forms) with the bytes of its per-device result
and how many times it runs per call of the program: an instruction inside a
``while`` body (a scanned layer stack, a microbatch loop) runs once per trip,
read from the loop's ``known_trip_count``. `dot_flops` counts the FLOPs of the
matrix products the same way (``compiled.cost_analysis()`` counts a loop body once), every branch of a
conditional included; `dot_flops_split` tells the branches' part apart.
`branch_collectives` finds the collectives inside the branches of conditionals, with the
pipeline stages their device groups span (the pipeline skips empty layer slots with conditionals
that stages take differently, so a collective there must stay inside one stage). `loop_instructions` lists
an opcode's instructions inside loop bodies (copies: a loop-carried buffer XLA could not update in place;
collectives: ones that run at every trip).

This is the one reader of compiled HLO in meshwork.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

COLLECTIVE_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s4": 1,
    "u4": 1,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)[\s(].*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_CALLEE = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
      op: the collective kind (``all-gather`` for ``all-gather-start`` too).
      name: the instruction name.
      computation: the HLO computation holding it.
      result_bytes: bytes of its per-device result (for ``-start`` forms,
        of the output buffer).
      executions: times it runs per call of the program (loop trips folded in).
      dtype: the element type of its result as HLO writes it (``bf16``, ``f32``; of the output buffer for
        ``-start`` forms, the first array's for a tuple), "" when it has none.
    """

    op: str
    name: str
    computation: str
    result_bytes: int
    executions: int
    dtype: str = ""

    @property
    def total_bytes(self) -> int:
        return self.result_bytes * self.executions


def shape_bytes(type_text: str) -> list[int]:
    """Bytes of each array in an HLO type string such as ``(f32[8,4]{1,0}, s32[])``."""
    sizes = []
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype not in _DTYPE_BYTES:
            continue
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        sizes.append(count * _DTYPE_BYTES[dtype])
    return sizes


def _result_bytes(op: str, type_text: str) -> int:
    sizes = shape_bytes(type_text)
    if not sizes:
        return 0
    if op.endswith("-start") and op != "all-reduce-start" and len(sizes) >= 2:
        return sizes[1]  # (operand, output, ...) tuples of async starts
    return sum(sizes)


def _result_dtype(op: str, type_text: str) -> str:
    types = [dtype for dtype, _ in _ARRAY.findall(type_text) if dtype in _DTYPE_BYTES]
    if not types:
        return ""
    return types[1] if op.endswith("-start") and op != "all-reduce-start" and len(types) >= 2 else types[0]


def _parse(hlo_text: str):
    """Computations -> instructions, call edges with multipliers, and the entry name."""
    instructions: dict[str, list[tuple[str, str, str, str]]] = defaultdict(list)
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    entry = None
    current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line[:1].isspace():
            current = header.group(1)
            if line.lstrip().startswith("ENTRY"):
                entry = current
            continue
        match = _INSTRUCTION.match(line)
        if not match or current is None:
            continue
        name, type_text, op, rest = match.groups()
        instructions[current].append((name, type_text, op, rest))
        trip = _TRIP.search(rest)
        for kind, callee in _CALLEE.findall(rest):
            calls[current].append((callee, int(trip.group(1)) if (kind == "body" and trip) else 1))
        for branches in _BRANCHES.findall(rest):
            for callee in branches.split(","):
                calls[current].append((callee.strip().lstrip("%"), 1))
    return instructions, calls, entry


def _multiplicities(calls, entry) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)

    def visit(name: str, factor: int, depth: int) -> None:
        if depth > 64:
            return
        counts[name] += factor
        for callee, trips in calls.get(name, ()):
            visit(callee, factor * trips, depth + 1)

    if entry is not None:
        visit(entry, 1, 0)
    return counts


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled HLO module, with its executions per call.

    Args:
      hlo_text: ``compiled.as_text()`` of a `jax.stages.Compiled`.

    Returns:
      One `Collective` per instruction (``-done`` halves are skipped).
    """
    instructions, calls, entry = _parse(hlo_text)
    times = _multiplicities(calls, entry)
    found = []
    for computation, items in instructions.items():
        for name, type_text, op, _ in items:
            base = op[: -len("-start")] if op.endswith("-start") else op
            if base not in COLLECTIVE_OPS:
                continue
            found.append(
                Collective(
                    base,
                    name,
                    computation,
                    _result_bytes(op, type_text),
                    max(times.get(computation, 0), 1),
                    _result_dtype(op, type_text),
                )
            )
    return found


BEFORE_CPU_UPCAST = "float-normalization-bf16"
"""The XLA:CPU pass that rewrites bfloat16 collectives (and other ops the CPU runs in float32) to float32,
after the SPMD partitioner: the program before it holds the collectives as a GPU backend, which keeps them
bfloat16, receives them."""


def text_before_pass(lowered, pass_name: str = BEFORE_CPU_UPCAST) -> str:
    """The HLO module of ``lowered`` as it stands just before XLA's pass ``pass_name`` (compiled once more for it).

    On XLA:CPU, ``compiled.as_text()`` shows bfloat16 collectives upcast to float32 by `BEFORE_CPU_UPCAST`; the
    module before that pass is the partitioned program with its collectives in the dtypes the program moves
    (what `collectives` then reads as a GPU compile would emit them). XLA writes it to a temporary folder
    (``xla_dump_to`` with ``xla_dump_hlo_pass_re``); the persistent compilation cache is off meanwhile, since a
    compilation it serves runs no pass and writes nothing.

    Args:
      lowered: A `jax.stages.Lowered` (``jax.jit(f).lower(*args)``).
      pass_name: The HLO pass to read the module before.

    Returns:
      The module's HLO text.

    Raises:
      RuntimeError: XLA ran no pass of that name (another backend, or an XLA that renamed it).
    """
    import glob
    import os
    import tempfile

    import jax

    cached = jax.config.jax_enable_compilation_cache
    with tempfile.TemporaryDirectory() as folder:
        jax.config.update("jax_enable_compilation_cache", False)
        try:
            lowered.compile(compiler_options={"xla_dump_to": folder, "xla_dump_hlo_pass_re": re.escape(pass_name)})
        finally:
            jax.config.update("jax_enable_compilation_cache", cached)
        found = sorted(glob.glob(os.path.join(folder, f"*.before_{pass_name}.txt")))
        if not found:
            raise RuntimeError(f"XLA ran no pass {pass_name!r} compiling this program")
        with open(found[0], encoding="utf-8") as f:
            return f.read()


def summarize(found: list[Collective]) -> dict[str, tuple[int, int]]:
    """op -> (executions per call, result bytes per call), over all instructions."""
    table: dict[str, list[int]] = {}
    for c in found:
        row = table.setdefault(c.op, [0, 0])
        row[0] += c.executions
        row[1] += c.total_bytes
    return {op: (row[0], row[1]) for op, row in sorted(table.items())}


_BODY = re.compile(r"\bbody=%?([\w.\-]+)")


def loop_instructions(hlo_text: str, op: str) -> list[tuple[str, str, list[int]]]:
    """The instructions of kind ``op`` (``copy``, ``all-gather``, ...) in the bodies of ``while`` loops of a
    compiled HLO module. ``copy``: the copies XLA's copy insertion adds where a loop-carried buffer cannot be
    updated in place (a value read after an in-place update of its buffer is kept alive by a copy of the
    whole buffer, each trip). A collective: one that runs at every trip (not hoisted before the loop, not
    inside a conditional).

    Args:
      hlo_text: ``compiled.as_text()`` of a `jax.stages.Compiled`.
      op: the HLO opcode.

    Returns:
      ``(body, instruction, dims)`` per instruction: the loop body computation, the instruction's name and its
      result's dimensions (its element type left out).
    """
    instructions, _, _ = _parse(hlo_text)
    bodies = {body for items in instructions.values() for *_, rest in items for body in _BODY.findall(rest)}
    return [
        (body, name, _dims(type_text))
        for body in sorted(bodies)
        for name, type_text, kind, _ in instructions.get(body, ())
        if kind == op
    ]


def instructions_of(hlo_text: str, op: str) -> list[tuple[str, str, list[int]]]:
    """Every instruction of kind ``op`` in a compiled HLO module, as `loop_instructions` (any computation)."""
    instructions, _, _ = _parse(hlo_text)
    return [
        (computation, name, _dims(type_text))
        for computation, items in instructions.items()
        for name, type_text, kind, _ in items
        if kind == op
    ]


_OPERANDS = re.compile(r"%([\w.\-]+)")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")


def _dims(type_text: str) -> list[int]:
    match = _ARRAY.search(type_text)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def dot_flops(hlo_text: str) -> float:
    """FLOPs of every ``dot`` of a compiled HLO module, with loop trip counts folded in.

    A dot costs ``2 x (result elements) x (contracted elements)``, the count of XLA's
    HloCostAnalysis. Unlike ``compiled.cost_analysis()``, which counts the body of a ``while``
    loop once, each dot here is multiplied by the executions of its computation per call
    (fusions included, through their ``calls=`` edges). Every branch of a conditional is counted on
    every execution of the conditional, as if all ran: an upper bound where branches are skipped
    (`dot_flops_split` gives the part inside branches).

    Args:
      hlo_text: ``compiled.as_text()``.

    Returns:
      FLOPs per call of the program, per device.
    """
    outside, inside = dot_flops_split(hlo_text)
    return outside + inside


def dot_flops_split(hlo_text: str) -> tuple[float, float]:
    """`dot_flops` in two parts: ``(outside, inside)`` conditional branches, FLOPs per call per device.

    ``outside`` runs on every call. ``inside`` counts each branch's dots on every execution of its
    conditional, every branch alike: what runs lies between 0 and it, as the branches taken decide (a
    pipeline stage's skipped slots and bubble steps, or 1F1B's ticks, which run a forward or a backward
    branch, not both). The compiled program does not say which branch a device takes.

    Args:
      hlo_text: ``compiled.as_text()``.
    """
    instructions, calls, entry = _parse(hlo_text)
    times = _multiplicities(calls, entry)
    branches = _inside_branches(instructions, calls)
    split = [0.0, 0.0]
    for computation, items in instructions.items():
        types = {name: type_text for name, type_text, _, _ in items}
        for _, type_text, op, rest in items:
            if op != "dot":
                continue
            operands = _OPERANDS.findall(rest.split(")", 1)[0])
            contracting = _LHS_CONTRACTING.search(rest)
            if not operands or operands[0] not in types or contracting is None:
                continue
            lhs = _dims(types[operands[0]])
            contracted = 1
            for d in filter(None, contracting.group(1).split(",")):
                contracted *= lhs[int(d)]
            result = 1
            for d in _dims(type_text):
                result *= d
            split[computation in branches] += 2.0 * result * contracted * max(times.get(computation, 0), 1)
    return split[0], split[1]


def _inside_branches(instructions, calls) -> set[str]:
    """The computations reachable from a branch of a conditional (the branches themselves included)."""
    roots: set[str] = set()
    for items in instructions.values():
        for _, _, op, rest in items:
            if op == "conditional":
                roots.update(_BRANCH_ONLY.findall(rest))
                for group in _BRANCHES.findall(rest):
                    roots.update(c.strip().lstrip("%") for c in group.split(",") if c.strip())
    inside, todo = set(), list(roots)
    while todo:
        comp = todo.pop()
        if comp not in inside:
            inside.add(comp)
            todo.extend(callee for callee, _ in calls.get(comp, ()))
    return inside


# Conditional branches -----------------------------------------------------------------------

_BRANCH_ONLY = re.compile(r"\b(?:true_computation|false_computation)=%?([\w.\-]+)")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
# XLA's mesh-axes replica groups (`MeshAxesReplicaGroupList::ToString`, xla/hlo/ir/replica_group.cc): a mesh,
# then the axes each group spans in braces. jax >= 0.12 prints ``mesh['data'=1,'stage'=2,...] {'sequence'}``
# (an iota mesh: device ids in row-major order); XLA's own tests print ``@mesh<a=2,b=4> {a}`` and, for a mesh
# of another device order, ``@mesh<a=2,b=4>(devices=[2,4]<=[4,2]T(1,0)) {a}`` (an iota tile assignment) or
# ``@mesh<ooo=10>(devices=[10]8,3,7,...) {ooo}`` (the ids listed). An axis in the braces may be a sub-axis,
# ``b:(1)2``: the size-2 factor of ``b`` with 1 element before it (`AxisRef::ToString`,
# xla/hlo/ir/mesh_and_axis.cc). A mesh printed with ``, device_ids=(...)`` is not read (None).
_GROUPS_NAMED = re.compile(
    r"replica_groups=(?:mesh\[([^\]]*)\]|@mesh<([^>]*)>"
    r"(?:\(devices=(\[[\d,]+\](?:<=\[[\d,]+\](?:T\([\d,]+\))?|[\d,]+))\))?)\s*\{([^}]*)\}"
)
_MESH_AXIS = re.compile(r"'?(\w+)'?=(\d+)")
_GROUP_AXIS = re.compile(r"'?(\w+)'?(?::\((\d+)\)(\d+))?")


@dataclasses.dataclass(frozen=True)
class BranchCollective:
    """A collective inside a branch of a conditional (a layer slot some pipeline stages skip).

    Attributes:
      op: e.g. ``all-gather``.
      name: the HLO instruction.
      stages: the stages its device groups span at most (1: among devices of
        one stage), or None when the groups could not be read.
      safe: whether devices that skip the branch can never be waited for: a
        grouped collective whose every group lies inside one stage. A
        ``collective-permute`` is never safe: XLA's CPU runtime gathers every
        device of the program for it.
    """

    op: str
    name: str
    stages: int | None
    safe: bool


def device_groups(rest: str) -> list[list[int]] | None:
    """The device groups of a collective from the text after its opcode (replica groups, listed, as
    an iota or as mesh axes, or the source-target pairs of a permute); None when none can be read."""
    listed = _GROUPS_LIST.search(rest)
    if listed:
        return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", listed.group(1))]
    iota = _GROUPS_IOTA.search(rest)
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        dims = [int(d) for d in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
        return ids.reshape(shape).tolist()
    named = _GROUPS_NAMED.search(rest)
    if named:
        axes = _MESH_AXIS.findall(named.group(1) or named.group(2))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        over = [
            (a, int(pre) if pre else None, int(n) if n else None) for a, pre, n in _GROUP_AXIS.findall(named.group(4))
        ]
        if any(a not in names for a, _, _ in over):
            return None
        return _mesh_axes_groups(sizes, names, _tile_devices(named.group(3), sizes), over)
    pairs = _PAIRS.search(rest)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    return None


def _tile_devices(text: str | None, sizes: list[int]) -> np.ndarray:
    """The device ids of a mesh of ``sizes``: row-major (None), an iota tile assignment
    ``[dims]<=[reshape]T(perm)``, or ``[dims]id,id,...`` listed."""
    if text is None:
        return np.arange(math.prod(sizes)).reshape(sizes)
    dims, _, tail = text[1:].partition("]")
    if not tail.startswith("<="):
        return np.array([int(d) for d in tail.split(",")]).reshape(sizes)
    iota = re.fullmatch(r"<=\[([\d,]+)\](?:T\(([\d,]+)\))?", tail)
    reshape = [int(d) for d in iota.group(1).split(",")]
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if iota.group(2):
        ids = ids.transpose([int(d) for d in iota.group(2).split(",")])
    return ids.reshape(sizes)


def _mesh_axes_groups(sizes, names, devices, over) -> list[list[int]]:
    """The groups of mesh-axes replica groups, as XLA expands them
    (`MeshAxesReplicaGroupList::flattened_replica_groups`): each mesh axis that ``over`` names is reshaped into
    its factors (a sub-axis ``(pre)size`` of an axis of ``n`` devices: ``[pre, size, n / (pre * size)]``; several
    sub-axes of one axis: its factors in order, gaps between them as factors of their own), the factors the
    groups span are moved last in the order ``over`` names them, and the devices are read in consecutive runs
    of the group size.

    Args:
      sizes, names: The mesh's axes.
      devices: Its device ids, shaped ``sizes``.
      over: ``(name, pre, size)`` per axis of the groups; ``pre`` and ``size`` None for a whole axis.
    """
    dims, where = [], {}  # where: (name, pre) -> the factor's position in dims
    for name, n in zip(names, sizes):
        refs = sorted(((pre, size) for a, pre, size in over if a == name), key=lambda r: r[0] or 0)
        if not refs:
            dims.append(n)
        elif refs[0][0] is None:
            where[name, None] = len(dims)
            dims.append(n)
        elif len(refs) == 1:
            pre, size = refs[0]
            where[name, pre] = len(dims) + 1
            dims += [pre, size, n // (pre * size)]
        else:
            before = 1
            for pre, size in refs:
                if pre != before:
                    dims.append(pre // before)
                where[name, pre] = len(dims)
                dims.append(size)
                before = pre * size
            if before != n:
                dims.append(n // before)
    inner = [where[a, pre] for a, pre, _ in over]
    ids = devices.reshape(dims).transpose([d for d in range(len(dims)) if d not in inner] + inner)
    return ids.reshape(-1, math.prod(dims[d] for d in inner)).tolist()


def branch_collectives(hlo_text: str, mesh, stage_axis: str = "stage") -> list[BranchCollective]:
    """Collectives that run inside conditional branches of a compiled program.

    Args:
      hlo_text: ``compiled.as_text()``.
      mesh: the `jax.sharding.Mesh` it was compiled for (device ids in HLO
        are positions in ``mesh.devices.flat``).
      stage_axis: the mesh axis whose indices the branches may differ along.

    Returns:
      One `BranchCollective` per collective instruction reachable from a
      conditional branch.
    """
    instructions, calls, _ = _parse(hlo_text)
    inside = _inside_branches(instructions, calls)
    names = list(mesh.axis_names)
    stage_of = (
        np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)[names.index(stage_axis)]
        if stage_axis in names
        else np.zeros(mesh.devices.size, int)
    )
    result = []
    for comp in sorted(inside):
        for name, _, op, rest in instructions.get(comp, ()):
            base = op[: -len("-start")] if op.endswith("-start") else op
            if base not in COLLECTIVE_OPS:
                continue
            groups = device_groups(rest)
            spans = None if groups is None else max((len({int(stage_of[d]) for d in g}) for g in groups), default=1)
            result.append(BranchCollective(base, name, spans, base != "collective-permute" and spans == 1))
    return result


_LAYOUT = re.compile(r"\{[^{}]*\}|/\*.*?\*/")
_GROUP_ATTRS = re.compile(r"\b(?:replica_groups|source_target_pairs|device_ids)=(.*?)(?=, [a-z_]+=|$)")


def _groups_text(rest: str) -> str:
    """A collective's device groups as text: `device_groups` where it reads them, else the attributes as
    written (a form it does not read, e.g. a mesh with device ids)."""
    groups = device_groups(rest)
    if groups is not None:
        return str(groups).replace(" ", "")
    return ";".join(_GROUP_ATTRS.findall(rest))


def collective_schedule(hlo_text: str) -> list[str]:
    """The collectives of a compiled module in the order they are issued, one line each: kind, result type
    (dtypes and shapes, layouts dropped) and device groups, e.g. ``all-gather f32[8,128] groups=[[0,1],[2,3]]``.

    Two processes of one SPMD program must issue the same collectives in the same order, or the
    collectives wait on each other for ever; comparing these lines between processes finds the first one
    that differs. The order is the module's: computations as the text lists them (callees before their
    callers), instructions within each in the order of the schedule (a compiled module is scheduled).
    Instruction names and channel ids are left out: they are numbering, not behaviour.

    Args:
      hlo_text: ``compiled.as_text()`` of a `jax.stages.Compiled`.
    """
    instructions, _, _ = _parse(hlo_text)
    lines = []
    for items in instructions.values():
        for _, type_text, op, rest in items:
            base = op[: -len("-start")] if op.endswith("-start") else op
            if base not in COLLECTIVE_OPS:
                continue
            groups = _groups_text(rest)
            shape = " ".join(_LAYOUT.sub("", type_text).split())
            lines.append(f"{base} {shape} groups={groups}")
    return lines
