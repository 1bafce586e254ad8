"""Throughput pairs of a mixture of experts on simulated CPU devices, side by side in one process.

For each size (``moe-test``, and a ``small``-sized MoE: the ``small`` shape with 8 experts of half its
SwiGLU width, top-2, so a token's active feed-forward width equals the dense model's), three rows on the
same devices, batch and length:

* the MoE with its experts split over ``--mesh expert=N`` (expert parallelism: the experts split, the batch
  data-parallel over the same devices);
* the same MoE with every expert on every device (``data=N``: ``expert=1``), the same active parameters;
* the dense model whose parameter count equals the MoE's active parameters (the same shape with
  ``num_experts=0`` and the ``mlp_dim`` that brings the count closest).

Each row is `bench/throughput.py`'s measurement (the real `train.runtime.step.Trainer` step on random tokens,
median step time over the steps after ``--skip``); the configurations run in turn, ``--rounds`` times, and
each row reports the median over its rounds, so that a drift of the machine's load hits all alike.
With simulated devices on a few cores the wall time measures total work, not the slowest device: the
ratios compare the work of each layout, which is what a CPU can say.

    python bench/moe_throughput.py                       # the timed run (a quiet machine)
    python bench/moe_throughput.py --steps 3 --skip 1 --rounds 1 --seq-len 32 --sizes moe-test   # a check
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIZES = {
    "moe-test": ("moe-test", []),
    "small": ("small", ["num_experts=8", "experts_per_token=2", "moe_mlp_dim=384"]),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="moe-test,small", help="comma-separated: moe-test, small")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (the expert and data sizes)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch in sequences")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=12, help="steps per measurement")
    p.add_argument("--skip", type=int, default=2, help="leading steps left out of the median")
    p.add_argument("--rounds", type=int, default=3, help="times the whole list is measured")
    return p.parse_args(argv)


def equal_active_dense(preset: str, overrides: list[str]) -> tuple[list[str], int, int]:
    """The dense model of the MoE's shape whose parameters come closest to the MoE's active parameters:
    ``(overrides, dense parameters, MoE active parameters)``."""
    from models.config import get_config

    moe = get_config(preset, overrides)
    active = moe.describe().num_active_params
    base = [o for o in overrides if not o.startswith(("num_experts=", "experts_per_token=", "moe_mlp_dim="))]
    best = None
    for mlp in range(8, 8 * moe.mlp_dim, 8):
        dense = get_config(
            preset, [*base, "num_experts=0", "shared_experts=0", "first_dense_layers=0", f"mlp_dim={mlp}"]
        )
        gap = abs(dense.num_params - active)
        if best is None or gap < best[0]:
            best = (gap, mlp, dense.num_params)
    _, mlp, params = best
    return [*base, "num_experts=0", "shared_experts=0", "first_dense_layers=0", f"mlp_dim={mlp}"], params, active


def rows(args) -> list[dict]:
    """The configurations to measure, in order."""
    out = []
    n = args.devices
    for size in args.sizes.split(","):
        preset, overrides = SIZES[size]
        dense, dense_params, active = equal_active_dense(preset, overrides)
        out += [
            {"size": size, "what": f"MoE expert={n}", "model": preset, "set": overrides, "mesh": f"expert={n}"},
            {"size": size, "what": "MoE expert=1", "model": preset, "set": overrides, "mesh": f"data={n}"},
            {"size": size, "what": "dense, equal active", "model": preset, "set": dense, "mesh": f"data={n}"},
        ]
        out[-3]["active"] = out[-2]["active"] = active
        out[-1]["active"] = dense_params
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import throughput

    configs = rows(args)
    times: dict[int, list[float]] = {i: [] for i in range(len(configs))}
    results: dict[int, dict] = {}
    for k in range(args.rounds):
        for i, c in enumerate(configs):
            print(
                f"round {k + 1}/{args.rounds}: {c['size']} {c['what']} on {c['mesh']} ...", file=sys.stderr, flush=True
            )
            r = throughput.measure(
                throughput.parse_args(
                    [
                        "--model",
                        c["model"],
                        *[a for s in c["set"] for a in ("--set", s)],
                        "--mesh",
                        c["mesh"],
                        "--batch-size",
                        str(args.batch_size),
                        "--seq-len",
                        str(args.seq_len),
                        "--steps",
                        str(args.steps),
                        "--skip",
                        str(args.skip),
                    ]
                )
            )
            times[i].append(r["median_step_time"])
            results[i] = r
    first = results[0]
    print(
        f"JAX {first['jax']} on {first['backend']} ({first['machine']}), {first['date']}; {args.devices} devices, "
        f"batch {args.batch_size} x {args.seq_len}; median over steps {args.skip + 1}-{args.steps}, "
        f"median of {args.rounds} round(s)\n"
    )
    print("| size | model | mesh | parameters | active | median step (ms) | tokens/s | vs MoE expert=1 |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    base: dict[str, float] = {}
    for i, c in enumerate(configs):
        step = statistics.median(times[i])
        tokens = args.batch_size * args.seq_len / step
        if c["what"] == "MoE expert=1":
            base[c["size"]] = tokens
    for i, c in enumerate(configs):
        step = statistics.median(times[i])
        tokens = args.batch_size * args.seq_len / step
        print(
            f"| {c['size']} | {c['what']} | {c['mesh']} | {results[i]['params']:,} | {c['active']:,} | "
            f"{step * 1000:.0f} | {tokens:,.0f} | {tokens / base[c['size']]:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
