"""Per-device memory with sequence parallelism beside tensor parallelism, compiled and priced.

For ``--rules tp`` and ``--rules tp_sp`` on ``data=2,tensor=4`` (8 simulated CPU devices), compiles one train
step of the model at two depths and reads ``compiled.memory_analysis()``: the temporaries' growth per layer is
one layer's saved activations and its float32 gradient, which the cost model prices part by part
(`sharding.costmodel.estimate`, ``backend="cpu"``). The activations that live in the residual stream, outside
the attention and MLP blocks (the description's ``act_length`` terms, `models.spec._activations`), are listed
on their own: with sequence parallelism they take 1/4 of their memory on ``tensor=4``, and the compiled
per-layer saving is what that predicts.

Run by hand: ``python bench/sequence_parallel.py`` (8 compilations; a few minutes on 2 CPU cores). Prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from costmodel_grid import compiled_figures, config_of, predicted  # noqa: E402

from models.spec import describe  # noqa: E402
from sharding import axes as ax  # noqa: E402
from sharding.mesh import parse_mesh  # noqa: E402
from sharding.rules import get_rules  # noqa: E402

MIB = 2**20


def residual_bytes_per_token(model: str, mesh_spec: str, rules: str, remat: str) -> float:
    """Bytes per token of one layer's saved activations that live in the residual stream (``act_length``
    terms), under ``remat`` (``dots`` keeps the block input and the products' outputs only)."""
    config = config_of(model, remat)
    description = describe(config)
    kept = {"none": None, "dots": ("input", "dot"), "full": ("input",)}[remat]
    mesh = parse_mesh(mesh_spec, 8)
    terms = [t for t in description.activations if t.axis == ax.ACT_LENGTH]
    split = get_rules(rules).sequence_split(mesh)
    bytes_of = 4 if config.dtype == "float32" else 2
    return sum(t.amount * (t.bytes or bytes_of) for t in terms if kept is None or set(t.kept) & set(kept)) / split


def per_layer(case_two, case_four) -> tuple[float, float]:
    """(compiled, priced) bytes one more layer adds to the step's temporaries: saved activations + gradient."""
    compiled = (compiled_figures(case_four)["temp"] - compiled_figures(case_two)["temp"]) / 2
    two, four = predicted(case_two).memory, predicted(case_four).memory
    priced = sum(getattr(four, f) - getattr(two, f) for f in ("activations", "gradients")) / 2
    return compiled, priced


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="model preset with +field=value overrides")
    p.add_argument("--mesh", default="data=2,tensor=4")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--remats", default="dots,none")
    args = p.parse_args(argv)
    mesh = parse_mesh(args.mesh, 8)
    tokens = args.batch // (mesh[ax.DATA] * mesh[ax.FSDP]) * args.seq_len
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"jax {jax.__version__}, {platform.machine()} {os.cpu_count()} cores, started {started}; "
        f"--model {args.model} (2 and 4 layers) --mesh {args.mesh} --batch-size {args.batch} "
        f"--seq-len {args.seq_len}: {tokens} tokens a device\n"
    )
    print(
        "| remat | rules | compiled temporaries, 4 layers (MiB) | per layer compiled (MiB) | per layer priced (MiB) "
        "| residual stream per layer, priced (MiB) | priced activations, 4 layers (MiB) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for remat in args.remats.split(","):
        rows = {}
        for rules in ("tp", "tp_sp"):
            two, four = (
                (f"{args.model}+num_layers={n}", args.mesh, rules, args.batch, args.seq_len, 1, remat) for n in (2, 4)
            )
            compiled, priced = per_layer(two, four)
            residual = tokens * residual_bytes_per_token(four[0], args.mesh, rules, remat)
            rows[rules] = (compiled, priced, residual)
            print(
                f"| {remat} | {rules} | {compiled_figures(four)['temp'] / MIB:.2f} | {compiled / MIB:.3f} | "
                f"{priced / MIB:.3f} | {residual / MIB:.3f} | {predicted(four).memory.activations / MIB:.2f} |"
            )
        saved_compiled = rows["tp"][0] - rows["tp_sp"][0]
        saved_priced = rows["tp"][2] - rows["tp_sp"][2]
        print(
            f"| {remat} | saved by tp_sp | | {saved_compiled / MIB:.3f} | {(rows['tp'][1] - rows['tp_sp'][1]) / MIB:.3f} "
            f"| {saved_priced / MIB:.3f} (ratio {rows['tp_sp'][2] / rows['tp'][2]:.3f}) | |"
        )


if __name__ == "__main__":
    main()
