"""What a compiled step's temporaries hold at their peak, read from XLA's dumps.

Run a step (e.g. a ``--dry-run``) with ``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"``, then
``python bench/hlo_live.py DIR [MODULE] [MIN_MIB]``: for the module whose name contains ``MODULE``
(default ``jit__step``) it reads the temporaries' allocation (the largest one that is neither a parameter
nor the output) from ``*-buffer-assignment.txt`` (each value's offset and size) and each value's live
range from ``*-live-range.txt`` (positions in the scheduled sequence), and prints the allocation's size,
the largest sum of the values live at one position (the live peak; the allocation is larger by what the
heap packing leaves unused), the values of at least ``MIN_MIB`` (default 512) MiB live there, and every
value of that size with its live range: e.g. how many score-sized ``[heads, T, S]`` float32 arrays an
attention backward holds at once (`bench/RESULTS.md`, "The reference attention's backward").

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
    for name, nbytes, offset, shape in re.findall(r"<\d+ (\S+) @0> \(size=(\d+),offset=(\d+)\): (\S+)", values):
        key = name if "{" in name else name + "{}"
        if key in ranges:
            held[key] = (int(nbytes), int(offset), shape, *ranges[key])
    return int(size), held


def main(dump: str, module: str = "jit__step", min_mib: float = 512) -> None:
    size, held = temp_values(dump, module)
    end = max(last for *_, last in held.values()) + 1
    live = [0] * end
    for nbytes, _, _, first, last in held.values():
        for t in range(first, last + 1):
            live[t] += nbytes
    peak = max(range(end), key=live.__getitem__)
    print(f"temporaries allocated: {size / MIB:,.0f} MiB; live peak {live[peak] / MIB:,.0f} MiB at position {peak}")
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
