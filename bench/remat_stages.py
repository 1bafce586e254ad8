"""``--remat none|dots|full`` inside pipeline stages: the compiled step against the cost model.

For one pipelined layout per schedule (the test model on ``stage=2,fsdp=4``, split 3,1, 16 sequences of 32
tokens in 4 microbatches), prints per choice the compiled step's temporaries (``memory_analysis``), their
peak before the tick loop (the working copy's gather) and inside the step's loops
(`costmodel_grid.compiled_loop_peak`: XLA's buffer assignment and live ranges) beside the cost model's
in-flight bytes (``Memory.in_flight``: the larger of its two phases, ``gradients + before_loop`` and
``Memory.in_loop``) and its error, and the products' FLOPs (the HLO's, trip counts folded in, against the
priced matmul FLOPs). Run from the repository root::

    PYTHONPATH=$PWD python bench/remat_stages.py
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from costmodel_grid import compiled_figures, compiled_loop_peak, predicted  # noqa: E402

REMATS = ("none", "dots", "full")


def case(remat: str, schedule: str):
    """A `costmodel_grid` pipeline case (GPipe names no schedule there)."""
    base = ("test", "stage=2,fsdp=4", "fsdp", 16, 32, 4, remat, (3, 1), 1)
    return base if schedule == "gpipe" else (*base, schedule)


def main() -> None:
    mb = 1e6
    print(
        "| schedule | remat | compiled temp (MB) | priced in flight (MB) | error | before the loop, compiled / "
        "priced (MB) | loop peak, compiled / priced (MB) | growth over full, compiled / priced (MB) | "
        "products' GFLOP, compiled / priced |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for schedule in ("gpipe", "1f1b", "zb"):
        rows = {}
        for r in REMATS:
            temp, loop, before = compiled_loop_peak(case(r, schedule))
            rows[r] = (temp, loop, before, compiled_figures(case(r, schedule)), predicted(case(r, schedule)))
        full_c, full_p = rows["full"][0], rows["full"][4].memory.in_flight
        for r, (temp, loop, before, c, p) in rows.items():
            m = p.memory
            print(
                f"| {schedule} | {r} | {temp / mb:.2f} | {m.in_flight / mb:.2f} | {(m.in_flight - temp) / temp:+.1%} "
                f"| {before / mb:.2f} / {(m.gradients + m.before_loop) / mb:.2f} | {loop / mb:.2f} / "
                f"{m.in_loop / mb:.2f} | {(temp - full_c) / mb:.2f} / {(m.in_flight - full_p) / mb:.2f} "
                f"| {c['dot_flops'] / 1e9:.3f} / {p.matmul_flops / 1e9:.3f} |"
            )


if __name__ == "__main__":
    main()
