"""Time and peak host memory of exporting and importing a Hugging Face folder (`checkpoints.hf`).

Each phase runs in its own process so its peak resident memory (``ru_maxrss``) is its own:

- ``export``: random ``--model`` parameters (seeded, float32) on ``--mesh``, written with
  `checkpoints.hf.save_params` as ``--dtype`` in files of ``--max-shard-size`` bytes;
- ``import``: that folder read back onto ``--mesh`` with `checkpoints.hf.load_params`.

On simulated CPU devices the parameters themselves live in host memory, so the figures report
the resident memory before the phase (parameters included, for export) and the peak during it.

    python bench/hf_io.py --cpu-devices 8 --model 125m --mesh fsdp=8 --out /tmp/hf-125m
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def phase(args) -> None:
    import jax

    from checkpoints import hf
    from models.config import get_config
    from models.transformer import abstract_model, init_params
    from sharding.mesh import make_mesh, parse_mesh
    from sharding.parallel import Parallelism
    from sharding.rules import get_rules, tree_shardings

    config = get_config(args.model)
    par = Parallelism.of(make_mesh(parse_mesh(args.mesh, jax.device_count())), get_rules("fsdp_tp"))
    _, abstract, names = abstract_model(config)
    shardings, _ = tree_shardings(abstract, names, par.mesh, par.rules)
    if args.phase == "export":
        params = jax.jit(lambda k: init_params(config, k), out_shardings=shardings)(jax.random.key(0))
        jax.block_until_ready(params)
        before = rss_mib()
        start = time.perf_counter()
        hf.save_params(args.out, config, params, dtype=args.dtype, max_shard_size=args.max_shard_size)
    else:
        targets = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        before = rss_mib()
        start = time.perf_counter()
        params = hf.load_params(args.out, config, targets)
        jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    files = sorted(os.listdir(args.out))
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in files) / 2**20
    print(
        f"| {args.phase} | {config.num_params / 1e6:.0f}M params, {args.dtype} | {seconds:.2f} | {before:,.0f} | "
        f"{peak:,.0f} | {len([f for f in files if f.endswith('.safetensors')])} files, {size:,.0f} MiB |"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="125m")
    p.add_argument("--mesh", default="fsdp=8")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-shard-size", type=int, default=200 * 10**6)
    p.add_argument("--out", default="/tmp/hf-bench")
    p.add_argument("--cpu-devices", type=int, default=8)
    p.add_argument("--phase", choices=("export", "import"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.cpu_devices}"
    if args.phase:
        return phase(args)
    shutil.rmtree(args.out, ignore_errors=True)
    print("| phase | model | seconds | RSS before (MiB) | peak RSS (MiB) | folder |")
    print("|---|---|---:|---:|---:|---|")
    for name in ("export", "import"):
        subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:]), "--phase", name], check=True)


if __name__ == "__main__":
    main()
