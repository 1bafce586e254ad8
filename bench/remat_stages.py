"""``--remat none|dots|full`` inside pipeline stages: the compiled step against the cost model.

For one pipelined layout per schedule (the test model on ``stage=2,fsdp=4``, split 3,1, 16 sequences of 32
tokens in 4 microbatches), prints per choice the compiled step's temporaries (``memory_analysis``), their
peak inside the step's loops (`costmodel_grid.compiled_loop_peak`: XLA's buffer assignment and live ranges,
without the working copy's gather before the tick loop) and products' FLOPs (the HLO's, trip counts folded
in) beside the cost model's in-flight bytes and matmul FLOPs, and each choice's growth over ``full`` of the
temporaries, of the loop's peak and of the price. Run from the repository root::

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
        "| schedule | remat | compiled temp (MB) | loop peak (MB) | priced in flight (MB) | growth over full: temp / "
        "loop peak / priced (MB) | products' GFLOP, compiled / priced |"
    )
    print("|---|---|---|---|---|---|---|")
    for schedule in ("gpipe", "1f1b", "zb"):
        rows = {
            r: (
                compiled_figures(case(r, schedule)),
                compiled_loop_peak(case(r, schedule))[1],
                predicted(case(r, schedule)),
            )
            for r in REMATS
        }
        full_c, full_l, full_p = rows["full"][0]["temp"], rows["full"][1], rows["full"][2].memory.in_flight
        for r, (c, loop, p) in rows.items():
            grown = f"{(c['temp'] - full_c) / mb:.2f} / {(loop - full_l) / mb:.2f} / {(p.memory.in_flight - full_p) / mb:.2f}"
            flops = f"{c['dot_flops'] / 1e9:.3f} / {p.matmul_flops / 1e9:.3f}"
            print(
                f"| {schedule} | {r} | {c['temp'] / mb:.2f} | {loop / mb:.2f} | {p.memory.in_flight / mb:.2f} | {grown} "
                f"| {flops} |"
            )


if __name__ == "__main__":
    main()
