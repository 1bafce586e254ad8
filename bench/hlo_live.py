"""What a compiled step's temporaries hold at their peak, read from XLA's dumps.

Run a step (e.g. a ``--dry-run``) with ``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"``, then
``python bench/hlo_live.py DIR [MODULE] [MIN_MIB]``: for the module whose name contains ``MODULE``
(default ``jit__step``) it reads the temporaries' allocation (the largest one that is neither a parameter
nor the output) from ``*-buffer-assignment.txt`` (each value's offset and size) and each value's live
range from ``*-live-range.txt`` (positions in the scheduled sequence), and prints the allocation's size,
the most bytes occupied at one position (the live peak: the union of the live values' ranges of the
allocation, so that values sharing one buffer, a loop's carried value and its phis, count once; the
allocation is larger by what the heap packing leaves unused), the values of at least ``MIN_MIB`` (default
512) MiB live there, and every value of that size with its live range: e.g. how many score-sized
``[heads, T, S]`` float32 arrays an attention backward holds at once (`bench/RESULTS.md`, "The reference
attention's backward"). `loop_peak` is the peak over the positions inside loops (a pipeline's tick loop),
apart from what the step does before and after them (gathering the working copy, the optimizer update);
`phase_peaks` gives it with the peak before the first loop.

Units: MiB. Reads text dumps only; imports nothing of ours.
"""

from __future__ import annotations

import glob
import re
import sys

MIB = 2**20


def temp_values(dump: str, module: str) -> tuple[int, dict[str, tuple[int, int, str, int, int]]]:
    """``(allocation bytes, {value: (bytes, offset, shape, first, last)})`` of the temporaries' allocation."""
    assignment = open(glob.glob(f"{dump}/*{module}*-buffer-assignment.txt")[0]).read()
    ranges_text = open(glob.glob(f"{dump}/*{module}*-live-range.txt")[0]).read()
    allocations = re.findall(r"^allocation \d+: size (\d+)(.*?)\n((?: value:.*\n)*)", assignment, re.M)
    size, _, values = max(
        (a for a in allocations if "parameter" not in a[1] and "output" not in a[1]), key=lambda a: int(a[0])
    )
    section = ranges_text.split("BufferLiveRange:")[1].split("Live ranges at")[0]
    ranges = {m[1]: (int(m[2]), int(m[3])) for m in re.finditer(r"^\s+(\S+):(\d+)-(\d+)$", section, re.M)}
    held = {}
    # a loop's carried values are phis, listed as ``<id name (phi) @0>``: in the loop body's positions they are
    # what holds the carry (a pipeline's rings)
    for name, nbytes, offset, shape in re.findall(
        r"<\d+ (\S+)(?: \(phi\))? @0> \(size=(\d+),offset=(\d+)\): (\S+)", values
    ):
        key = name if "{" in name else name + "{}"
        if key in ranges:
            held[key] = (int(nbytes), int(offset), shape, *ranges[key])
    return int(size), held


def occupied(held: dict[str, tuple[int, int, str, int, int]]) -> list[int]:
    """Bytes of the allocation occupied at each position: the union of the live values' ``[offset, offset +
    bytes)`` (values aliasing one buffer, a loop's carry and its phis, overlap there and count once)."""
    end = max(last for *_, last in held.values()) + 1
    spans: list[list[tuple[int, int]]] = [[] for _ in range(end)]
    for nbytes, offset, _, first, last in held.values():
        for t in range(first, last + 1):
            spans[t].append((offset, offset + nbytes))
    out = []
    for here in spans:
        total, reach = 0, 0
        for start, stop in sorted(here):
            total += max(0, stop - max(start, reach))
            reach = max(reach, stop)
        out.append(total)
    return out


def loop_positions(dump: str, module: str) -> set[int]:
    """Positions of the scheduled sequence (``*-live-range.txt``) whose instruction runs inside a loop: in a
    while loop's body or condition, or in a computation one of those calls (a conditional's branches)."""
    text = open(glob.glob(f"{dump}/*{module}*cpu_after_optimizations.txt")[0]).read()
    computation_of, calls, loops = {}, {}, set()
    name = None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?(\S+) \(.*\{$", line)
        if head:
            name = head[1]
            calls[name] = set()
            continue
        inst = re.match(r"^\s+(?:ROOT )?%?(\S+) = ", line)
        if inst and name:
            computation_of[inst[1]] = name
            called = re.findall(
                r"(?:body|condition|to_apply|branch_computations|true_computation|"
                r"false_computation|calls)=\{?%?([^,}\s]+(?:, %[^,}\s]+)*)",
                line,
            )
            for group in called:
                calls[name].update(c.lstrip("%") for c in group.split(", "))
            loops.update(re.findall(r"(?:body|condition)=%?([^,}\s]+)", line))
    inside, todo = set(), list(loops)
    while todo:
        c = todo.pop()
        if c not in inside:
            inside.add(c)
            todo.extend(calls.get(c, ()))
    ranges_text = open(glob.glob(f"{dump}/*{module}*-live-range.txt")[0]).read()
    sequence = ranges_text.split("BufferLiveRange:")[0]
    return {int(m[1]) for m in re.finditer(r"^\s+(\d+):(\S+)$", sequence, re.M) if computation_of.get(m[2]) in inside}


def loop_peak(dump: str, module: str = "jit__step") -> int:
    """The most bytes of the temporaries' allocation occupied at one position inside a loop (`occupied`,
    `loop_positions`): a pipeline step's peak over its ticks, apart from the working copy's gather before the
    tick loop and the optimizer's update after it."""
    return phase_peaks(dump, module)[1]


def phase_peaks(dump: str, module: str = "jit__step") -> tuple[int, int]:
    """``(before, inside)``: the most bytes of the temporaries' allocation occupied at one position before the
    first position inside a loop (a pipeline step gathering its working copy, zeroing its rings and gradient
    sums), and at one position inside a loop (`loop_peak`). Bytes."""
    _, held = temp_values(dump, module)
    live, inside = occupied(held), loop_positions(dump, module)
    first = min(inside)
    return max(live[:first], default=0), max(live[t] for t in inside if t < len(live))


def main(dump: str, module: str = "jit__step", min_mib: float = 512) -> None:
    size, held = temp_values(dump, module)
    live = occupied(held)
    end = len(live)
    peak = max(range(end), key=live.__getitem__)
    print(f"temporaries allocated: {size / MIB:,.0f} MiB; live peak {live[peak] / MIB:,.0f} MiB at position {peak}")
    before, inside = phase_peaks(dump, module)
    print(f"before the first loop: live peak {before / MIB:,.2f} MiB; inside loops: {inside / MIB:,.2f} MiB")
    big = [(k, v) for k, v in held.items() if v[0] >= min_mib * MIB]
    print(f"values of at least {min_mib:g} MiB live at the peak:")
    for name, (nbytes, _, shape, first, last) in big:
        if first <= peak <= last:
            print(f"  {nbytes / MIB:7,.0f}  {shape:36s} {name} [{first}-{last}]")
    print(f"every value of at least {min_mib:g} MiB (live range, offset in the allocation):")
    for name, (nbytes, offset, shape, first, last) in sorted(big, key=lambda kv: kv[1][3]):
        print(f"  [{first:5d}-{last:5d}] {offset / MIB:8,.0f} {nbytes / MIB:7,.0f}  {shape:36s} {name}")


if __name__ == "__main__":
    main(sys.argv[1], *(sys.argv[2:3] or []), *(float(x) for x in sys.argv[3:4]))
