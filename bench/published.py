"""The cost model's clock against published training runs: every row of ``shared/published/README.md``
priced at the layout its authors ran.

Run::

    python bench/published.py                      # the table, markdown, on stdout
    python bench/published.py --out table.md       # also written to a file
    python bench/published.py --rows megatron-39b,titan-8b-128
    python bench/published.py --top-three --rows megatron-39.1b   # the planner's own three best per row

Rows (facts from the papers; the README beside the figures gives the sources):

* Megatron-LM, Narayanan et al., SC'21 (arXiv 2104.04473), Table 1: GPT models of 1.7B-1T parameters on 32-3,072
  A100 80 GB (DGX A100 hosts of 8, 8 x 200 Gb/s InfiniBand each), activation recomputation on, sequence 2,048,
  vocabulary 51,200. The published step time is the paper's FLOP count (their eq. 3, recomputation included),
  ``F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))``, over the GPUs' measured FLOP/s. meshwork's SwiGLU MLP of
  ``8h/3`` (rounded to a multiple of 8) does the FLOPs of their ``4h`` GELU MLP. Layout: ``tensor`` = TP,
  ``stage`` = PP, ``data`` the rest, rules ``tp`` (``dp`` without TP); pipelined rows run 1F1B with microbatches
  of one sequence (M = batch / data) and ``--remat none``: meshwork's pipeline already recomputes each layer in
  its backward pass, which is Megatron's activation recomputation (``--remat full`` would recompute twice).
  Table 1 gives neither the interleaving's chunk count nor the microbatch size of the rows without a pipeline:
  pipelines are priced without interleaving (2 chunks price within 1% of it: the bubble halves, the stage
  sends double), the others at the fewest microbatches that fit, with ``--remat full``. Attention
  ``reference`` (2021's fused softmax keeps the scores, and eq. 3 counts the whole score matrix).
* torchtitan ``docs/performance.md`` (2024-12): Llama 3.1 8B, sequence 8,192, local batch 2, FSDP over 8 and
  128 H100 SXM 96 GB (Grand Teton: 8 x 400 Gb/s RoCE per host), selective activation checkpointing (remat
  ``dots``), flash attention, without ``torch.compile``. Step time = local batch x sequence / tokens/s per GPU.

Each row is priced by ``python -m train.plan``'s own path (`train.plan.given_layout`, then
`sharding.planner.evaluate`): the layout column is what ``python -m train.plan --layout`` takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.config import get_config  # noqa: E402
from models.spec import describe  # noqa: E402
from sharding import devices, planner  # noqa: E402
from sharding.devices.kinds import GIB  # noqa: E402
from train.plan import given_layout  # noqa: E402

MEGATRON_VOCAB, MEGATRON_SEQ = 51200, 2048
DGX_A100_NETWORK = "1600Gbps"  # 8 x 200 Gb/s HDR InfiniBand per DGX A100
GRAND_TETON_NETWORK = 3200e9 / 8  # 8 x 400 Gb/s RoCE per host, bytes/s

# (params B, heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU): Narayanan et al. (SC'21), Table 1.
MEGATRON_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]

# (GPUs, local batch, tokens/s per GPU without torch.compile, memory GiB as torchtitan reports it):
# torchtitan docs/performance.md (2025-01 revision, runs of 2024-12), Tables 1 and 3, Llama 3.1 8B.
TORCHTITAN_8B = [(8, 2, 5762, 82.4), (128, 2, 5605, 67.0)]
LLAMA_31_8B = (
    "vocab_size=128256",
    "num_layers=32",
    "embed_dim=4096",
    "mlp_dim=14336",
    "num_heads=32",
    "num_kv_heads=8",
    "head_dim=128",
    "rope_theta=500000",
)
TITAN_SEQ = 8192


@dataclasses.dataclass(frozen=True)
class Row:
    """One published run.

    Attributes:
      name: Short id, e.g. ``megatron-39b``.
      model: The `sharding.modeldesc.ModelDescription`.
      inventory: The cluster (`sharding.devices.Inventory`).
      batch: Global batch, sequences.
      seq_len: Tokens per sequence.
      layouts: ``--layout`` strings to try, first that fits wins (one for most rows).
      published_seconds: The measured step time, seconds.
      source: Where the figures come from.
      one_f_one_b_clock: How its 1F1B pipeline ran (`sharding.planner.PIPELINE_CLOCKS`): Megatron-LM's
        ``fused`` (each stage on its own), not meshwork's ``lockstep``.
      published_memory: Device memory the run used, bytes, where the source gives it (torchtitan's reading,
        GiB in its table); None where it does not.
    """

    name: str
    model: object
    inventory: devices.Inventory
    batch: int
    seq_len: int
    layouts: tuple[str, ...]
    published_seconds: float
    source: str
    one_f_one_b_clock: str = "lockstep"
    published_memory: float | None = None


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration with full recomputation, Narayanan et al. (SC'21), eq. 3."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def megatron_rows() -> list[Row]:
    rows = []
    for params, heads, hidden, layers, tp, pp, gpus, batch, tflops in MEGATRON_TABLE_1:
        mlp = round(8 * hidden / 3 / 8) * 8
        model = describe(
            get_config(
                "7b",
                [
                    f"vocab_size={MEGATRON_VOCAB}",
                    f"num_layers={layers}",
                    f"embed_dim={hidden}",
                    f"mlp_dim={mlp}",
                    f"num_heads={heads}",
                    f"num_kv_heads={heads}",
                    f"head_dim={hidden // heads}",
                ],
            )
        )
        inventory = devices.parse_cluster(f"a100:8x{gpus // 8}@{DGX_A100_NETWORK}")
        data = gpus // (tp * pp)
        mesh = f"data={data}" + (f",stage={pp}" if pp > 1 else "") + (f",tensor={tp}" if tp > 1 else "")
        rules = "tp" if tp > 1 else "dp"
        common = f"--mesh {mesh} --rules {rules} --attention reference --dtype bfloat16"
        if pp > 1:  # the pipeline recomputes each layer in its backward pass: that is Megatron's recomputation
            layouts = (f"{common} --remat none --microbatches {batch // data} --pipeline-schedule 1f1b",)
        else:
            layouts = tuple(f"{common} --remat full --microbatches {m}" for m in _divisors(batch // data))
        seconds = megatron_flops(batch, MEGATRON_SEQ, layers, hidden, MEGATRON_VOCAB) / (gpus * tflops * 1e12)
        name = f"megatron-{params:g}b"
        rows.append(
            Row(
                name,
                model,
                inventory,
                batch,
                MEGATRON_SEQ,
                layouts,
                seconds,
                f"Narayanan et al. SC'21 Table 1: {tflops} TFLOP/s per GPU",
                "fused",
            )
        )
    return rows


def torchtitan_rows() -> list[Row]:
    h100_96 = dataclasses.replace(
        devices.get_kind("h100"), name="h100_96gb", label="NVIDIA H100 SXM 96GB HBM2e", memory_bytes=96 * GIB
    )
    model = describe(get_config("7b", LLAMA_31_8B))
    rows = []
    for gpus, local, tps, gib in TORCHTITAN_8B:
        hosts = tuple(devices.Host(h100_96, 8, f"host{i}") for i in range(gpus // 8))
        inventory = devices.Inventory(hosts, GRAND_TETON_NETWORK)
        layout = f"--mesh fsdp={gpus} --rules fsdp --remat dots --attention flash --dtype bfloat16 --microbatches 1"
        rows.append(
            Row(
                f"titan-8b-{gpus}",
                model,
                inventory,
                gpus * local,
                TITAN_SEQ,
                (layout,),
                local * TITAN_SEQ / tps,
                f"torchtitan docs/performance.md: {tps:,} tokens/s per GPU, {gib} GiB",
                published_memory=gib * 2**30,
            )
        )
    return rows


def published_rows() -> list[Row]:
    """Every row of ``shared/published/README.md``, Megatron first."""
    return megatron_rows() + torchtitan_rows()


def price(row: Row, options: planner.PlanOptions) -> tuple[planner.Plan | None, str]:
    """``(plan, layout)``: the first of the row's layouts that fits (else the last priced), as
    ``python -m train.plan --layout`` prices it."""
    defaults = argparse.Namespace(dtype=options.dtype, attention="flash", batch=row.batch)
    options = dataclasses.replace(options, one_f_one_b_clock=row.one_f_one_b_clock)
    best, used = None, ""
    for text in row.layouts:
        layout, counts = given_layout(text, row.model.num_layers, row.inventory.num_devices, defaults)
        plan_ = planner.evaluate(row.model, row.inventory, row.batch, row.seq_len, layout, counts, options)
        if plan_ is None:
            continue
        best, used = plan_, text
        if plan_.fits:
            break
    return best, used


def _parts(p: planner.Plan) -> str:
    parts = p.parts
    return (
        f"compute {parts['compute']:.2f}, overlappable {parts['overlapped_comm']:.2f} (not hidden "
        f"{parts['overlap_exposed']:.2f}, contention {parts['contention']:.2f}), exposed "
        f"{parts['exposed_comm']:.2f}, optimizer {parts['optimizer']:.3f}, bubble {parts['bubble']:.2f}"
    )


def _memory(p: planner.Plan) -> str:
    """The predicted memory of the largest kind's device, GB, by part (`sharding.costmodel.Memory` fields),
    against its usable limit (`sharding.planner.MEMORY_FRACTION` of the device)."""
    kind = max(p.memory, key=p.memory.get)
    parts = p.memory_parts.get(kind, {})
    names = (("parameters", "params"), ("gradients", "grads"), ("optimizer", "adam"), ("activations", "saved"))
    names += (("logits", "logits"), ("gathered", "gathered"))
    shown = ", ".join(f"{short} {parts[name] / 1e9:.1f}" for name, short in names if parts.get(name))
    return f"{p.memory[kind] / 1e9:.1f} of {p.memory_limit[kind] / 1e9:.1f} ({shown})"


def table(rows: Sequence[Row], options: planner.PlanOptions, log=print) -> list[str]:
    """Markdown lines: row, published step time, predicted, ratio, fits, the predicted memory (GB, largest
    kind, by part, against its usable limit) beside the published one where the source gives it, the predicted
    breakdown (seconds) and the seconds the pricing took."""
    lines = [
        "| row | layout (`--layout`) | published s | predicted s | predicted / published | fits | "
        "predicted memory GB (parts) | published memory GB | predicted breakdown (s) | priced in s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        t0 = time.perf_counter()
        p, text = price(row, options)
        seconds = time.perf_counter() - t0
        if p is None:
            lines.append(
                f"| {row.name} | {row.layouts[0]} | {row.published_seconds:.2f} | - | - | - | - | - | batch does "
                f"not split | {seconds:.1f} |"
            )
            continue
        short = text.replace(" --dtype bfloat16", "")  # every row's
        published_gb = f"{row.published_memory / 1e9:.1f}" if row.published_memory else "-"
        line = (
            f"| {row.name} | `{short}` | {row.published_seconds:.2f} | {p.step_time:.2f} | "
            f"{p.step_time / row.published_seconds:.2f} | {'yes' if p.fits else 'no'} | {_memory(p)} | "
            f"{published_gb} | {_parts(p)} | {seconds:.1f} |"
        )
        lines.append(line)
        log(line)
    return lines


def published_family(p: planner.Plan) -> bool:
    """Whether a plan is of Megatron-LM's published family for its large rows: ``tensor`` 8 with a pipeline."""
    return p.layout.mesh.get("tensor", 1) == 8 and p.layout.mesh.get("stage", 1) > 1


def top_three(rows: Sequence[Row], options: planner.PlanOptions, log=print) -> list[str]:
    """Markdown lines: for each row, the planner's three best plans (``train.plan``'s search with the row's
    1F1B clock), whether one is of the published family (`published_family`), the family's best fitting plan
    and its rank among the search's (up to 500 listed), the published layout's predicted step time, and the
    seconds the search took."""
    from train.plan import plan_flags

    lines = [
        "| row | published s | published layout predicted s | planner's three best (predicted s) | "
        "published family among them | best of the family (rank, predicted s) | planned in s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        opts = dataclasses.replace(options, one_f_one_b_clock=row.one_f_one_b_clock)
        given, _ = price(row, opts)
        t0 = time.perf_counter()
        plans = planner.plan(row.model, row.inventory, row.batch, row.seq_len, opts, top=500)
        seconds = time.perf_counter() - t0
        shown = "; ".join(
            f"`{plan_flags(p).replace(' --dtype bfloat16', '')}` {p.step_time:.2f}{'' if p.fits else ' (over memory)'}"
            for p in plans[:3]
        )
        family = "yes" if any(published_family(p) and p.fits for p in plans[:3]) else "no"
        ranked = [(i, p) for i, p in enumerate(plans, 1) if published_family(p) and p.fits]
        best_family = (
            f"{ranked[0][0]}: `{plan_flags(ranked[0][1]).replace(' --dtype bfloat16', '')}` {ranked[0][1].step_time:.2f}"
            if ranked
            else f"none fitting in the first {len(plans)}"
        )
        line = (
            f"| {row.name} | {row.published_seconds:.2f} | {given.step_time if given else float('nan'):.2f} | "
            f"{shown} | {family} | {best_family} | {seconds:.0f} |"
        )
        lines.append(line)
        log(line)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    parser.add_argument(
        "--efficiency", type=float, default=None, help="override the fraction of peak FLOP/s (default: the planner's)"
    )
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    parser.add_argument(
        "--top-three",
        action="store_true",
        help="instead of pricing the published layouts, search each row and list the planner's three best",
    )
    args = parser.parse_args(argv)
    rows = published_rows()
    if args.rows:
        wanted = set(args.rows.split(","))
        rows = [r for r in rows if r.name in wanted]
    options = planner.PlanOptions(dtype="bfloat16")
    if args.efficiency is not None:
        options = dataclasses.replace(options, efficiency=args.efficiency)
    make = top_three if args.top_three else table
    lines = make(rows, options, log=lambda line: print(line, file=sys.stderr, flush=True))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
