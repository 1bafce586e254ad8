"""The cost model's clock against published training runs: every row of a rows file priced at the layout its
authors ran, through ``python -m train.plan --layout``'s own path.

Run::

    python bench/published.py                               # ../shared/published/rows.csv, markdown tables
    python bench/published.py --rows FILE.csv --json        # [{"name", "predicted_step_s", "published_step_s", "fits"}]
    python bench/published.py --only megatron-sc21-1.7b,zero3-175b-384
    python bench/published.py --only ptdp-175b-384 --top-three   # the planner's own three best per row

The rows file has the columns of ``shared/published/README.md`` (`COLUMNS`); a missing column, a value that is
not a number where one is needed or an unknown ``gpu`` stops the script with one line naming the file, the row
and the column (`read_rows`). The default is ``../shared/published/rows.csv`` beside the repository.

How each column maps onto meshwork (`row_layout`; meshwork's closest feature where it lacks the run's own):

* Shape: ``layers``, ``hidden``, ``heads``, ``kv_heads``, ``head_dim``, ``vocab`` as they are. meshwork's MLP is
  SwiGLU (three ``hidden x mlp`` matrices): a ``gelu`` or ``relu2`` (squared ReLU) MLP of two ``hidden x mlp``
  matrices is priced as SwiGLU of ``2 mlp / 3`` (rounded to a multiple of 8), the same matrix FLOPs; their
  elementwise work differs a little.
* ``gpu``: ``a100-80gb`` -> ``a100_80gb``, ``h100-sxm-80gb`` -> ``h100_sxm``, ``h100-sxm-96gb-500w`` ->
  ``h100_sxm`` with 96 GiB (the 500 W power limit, which lowers the clock under load, is not priced: those rows
  are priced as a 700 W part's). Hosts of ``gpus_per_host``, ``network_gbps_per_host`` Gb/s each.
* ``tp`` -> ``tensor``, ``pp`` -> ``stage``, ``cp`` -> ``sequence`` (with ring attention), ``dp`` -> ``data``;
  ``dp`` ``FSDP N`` (and ``FSDP+DP``, split not stated: all of it) -> ``fsdp``, rules ``fsdp`` (``fsdp_tp``
  with ``tp``), else rules ``tp`` (``dp`` without ``tp``). ``ep`` must be 1 (no row uses experts).
* ``gbs``/``mbs``: with a pipeline ``--microbatches gbs / (dp x mbs)`` per data-parallel rank. Without one,
  ``--microbatches 1``: Megatron, NeMo, torchtitan and MaxText accumulate gradients locally and reduce them
  once per step, while meshwork's accumulation loop reduces them after every microbatch (the partitioner puts
  the reduction inside the loop), so the published run's traffic is meshwork's at one microbatch; its
  products are then ``gbs / dp`` sequences tall instead of ``mbs`` (a few percent faster by the tile model)
  and its activation memory is the whole local batch's, so ``fits`` may read no for a run that fits.
* ``pp`` > 1: ``--pipeline-schedule 1f1b`` (``1f1b-fused`` with ``vp``), ``vp`` -> ``--pipeline-repeats`` (at most
  ``layers / pp``: meshwork gives every chunk a layer, where NeMo's reduced-depth proxies leave some empty), priced
  with Megatron-LM's own clock (``--pipeline-clock fused``: bubble ``(S-1)/(M v)``); the pipeline's backward pass
  recomputes each layer, which is Megatron's full recomputation, so ``--remat none`` there.
* ``recompute``: ``full`` -> ``--remat full``, ``selective`` -> ``--remat dots``, else ``none``.
* ``sp`` (Megatron's sequence parallelism) ``on`` with ``tp`` > 1 -> the rules' sequence-parallel variant
  (``tp_sp``, ``fsdp_tp_sp``); ``dist_opt`` ``on ...`` with ``data`` > 1 -> ``--optimizer-sharding data``
  (ZeRO stage 1 over ``data``; its gradient reduce-scatter plus parameter all-gather moves the all-reduce's
  bytes), and so does a run that overlapped its parameter gathers (`row_overlaps` hides ``data``): Megatron-LM
  refuses ``--overlap-param-gather`` without ``--use-distributed-optimizer`` (``megatron/training/arguments.py``),
  so the Megatron-LM README's rows and NeMo's recipes ran it whatever their ``dist_opt`` cell says. meshwork
  splits an array's state only along a dimension ``data`` divides (`sharding.zero.master_dim`; Megatron-LM pads
  one flat buffer instead), so an array it cannot split keeps its all-reduce and whole state, as meshwork would
  run it. ``dist_opt`` ``FSDP``/``ZeRO-3`` rows are already priced as ``fsdp``.
* What the run overlaps beyond meshwork's program (`row_overlaps`, ``train.plan --overlap-axes``): rows whose
  note says their communication was overlapped (the Megatron-LM README's: ``--overlap-grad-reduce
  --overlap-param-gather --tp-comm-overlap``) and NeMo's recipes (the DGX-benchmark rows: NeMo's performance
  recipes turn on tensor-parallel communication overlap, overlapped gradient reduction and parameter gathers
  with the distributed optimizer, and overlapped pipeline sends with interleaving; assumed, the rows do not
  say) hide ``tensor``, ``data`` and ``stage`` collectives behind compute; the others (Megatron SC'21 of 2021,
  MegaScale's Megatron-LM baseline, Llama 3, torchtitan, MaxText, PaxML) are priced as meshwork runs them.
* Attention: ``reference`` for Megatron SC'21 rows (2021, before FlashAttention), ``flash`` for the others.
* ``precision`` other than bf16 (the torchtitan 70B Float8 row) is priced in bf16 and left out of the targets.

Validation (`family_table`): rows grouped by model family (the ``model`` column without its size); the clock
derives no constant from any row (every figure is a datasheet's or a published benchmark's,
`sharding.devices.kinds`), so leaving a family out changes nothing and its error is the family's own.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.config import get_config  # noqa: E402
from models.spec import describe  # noqa: E402
from sharding import axes as ax  # noqa: E402
from sharding import devices, planner  # noqa: E402
from sharding.devices.kinds import GIB  # noqa: E402
from sharding.errors import ConfigError, Field  # noqa: E402
from train.plan import given_layout, plan_flags  # noqa: E402

DEFAULT_ROWS = Path(__file__).resolve().parents[1] / ".." / "shared" / "published" / "rows.csv"

COLUMNS = (
    "name,source,model,layers,hidden,mlp,mlp_kind,heads,kv_heads,head_dim,vocab,seq,gpu,gpus,gpus_per_host,"
    "network_gbps_per_host,gbs,mbs,tp,pp,cp,vp,ep,dp,sp,dist_opt,recompute,precision,published_step_s,"
    "published_note"
).split(",")
_INTS = ("layers", "hidden", "mlp", "heads", "kv_heads", "head_dim", "vocab", "seq", "gpus", "gpus_per_host")
_INTS += ("gbs",)
_OPTIONAL_INTS = ("mbs", "tp", "pp", "cp", "vp", "ep")  # blank, n/a or NA: 1 (mbs: Megatron's default)
_FLOATS = ("network_gbps_per_host", "published_step_s")
#: The ``gpu`` column's kinds: (meshwork kind, memory GiB override or None).
GPUS = {"a100-80gb": ("a100_80gb", None), "h100-sxm-80gb": ("h100_sxm", None), "h100-sxm-96gb-500w": ("h100_sxm", 96)}
MLP_KINDS = ("swiglu", "gelu", "relu2")


@dataclasses.dataclass(frozen=True)
class Row:
    """One published run, read from a rows file (`read_rows`): the columns of `COLUMNS`, numbers parsed.

    Attributes:
      values: Column -> value (ints for `_INTS` and `_OPTIONAL_INTS`, floats for `_FLOATS`, else text).
      line: The row's line in its file (1 is the header).
    """

    values: dict
    line: int

    def __getattr__(self, key):
        try:
            return self.__dict__["values"][key]
        except KeyError:
            raise AttributeError(key) from None

    @property
    def bf16(self) -> bool:
        return str(self.values["precision"]).strip().lower().startswith("bf16")

    @property
    def family(self) -> str:
        """The model family: the ``model`` column without its size (``Llama 3.1 8B`` -> ``Llama 3.1``)."""
        return re.sub(r"\s+[\d.]+[BT]\b.*$", "", self.values["model"]).strip()


def _fail(path, line: int, name: str, column: str, text: str):
    raise ValueError(f"{path}: row {line} ({name or 'unnamed'}), column {column}: {text}")


def read_rows(path: str | Path) -> list[Row]:
    """The rows of a file in ``rows.csv``'s format.

    Raises:
      ValueError: One line naming the file, the row (its line, its name) and the column: a missing column, a
        number that does not parse or is not positive, an unknown ``gpu`` or ``mlp_kind``, a ``dp`` that is
        neither a number nor ``FSDP N``/``FSDP+DP``, a model shape the model refuses (``heads`` not a multiple
        of ``kv_heads``, ...); or a file that cannot be read.
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a spreadsheet's byte-order mark is not a column's
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror}); pass --rows FILE.csv") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}); pass --rows FILE.csv") from None
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise ValueError(f"{path}: row 1 (header), column {missing[0]}: missing (columns: {', '.join(COLUMNS)})")
    rows: list[Row] = []
    seen: dict[str, int] = {}
    for line, raw in enumerate(reader, start=2):
        name = (raw.get("name") or "").strip()
        if not name:
            _fail(path, line, name, "name", "empty; give each row a name (bench/published.py --only takes them)")
        values = {k: (v or "").strip() for k, v in raw.items() if k in COLUMNS}
        for col in _INTS + _OPTIONAL_INTS:
            v = values[col]
            if col in _OPTIONAL_INTS and v.lower() in ("", "n/a", "na"):
                values[col] = 1
                continue
            try:
                values[col] = int(v)
            except ValueError:
                _fail(path, line, name, col, f"{v!r} is not a whole number")
            if values[col] <= 0:
                _fail(path, line, name, col, f"{v!r} must be positive")
        for col in _FLOATS:
            v = values[col]
            try:
                values[col] = float(v)
            except ValueError:
                _fail(path, line, name, col, f"{v!r} is not a number")
            if not 0 < values[col] < math.inf:
                _fail(path, line, name, col, f"{v!r} must be a positive finite number")
        if values["gpu"] not in GPUS:
            _fail(path, line, name, "gpu", f"unknown gpu {values['gpu']!r}; known: {', '.join(GPUS)}")
        if values["mlp_kind"] not in MLP_KINDS:
            _fail(path, line, name, "mlp_kind", f"{values['mlp_kind']!r}; known: {', '.join(MLP_KINDS)}")
        dp = values["dp"]
        if not (dp.isdigit() or re.fullmatch(r"FSDP( \d+|\+DP.*)", dp)):
            _fail(path, line, name, "dp", f"{dp!r}: give a number, FSDP N or FSDP+DP")
        if values["ep"] != 1:
            _fail(path, line, name, "ep", f"{values['ep']}: expert parallelism is not priced here (dense rows only)")
        if values["gpus"] % values["gpus_per_host"]:
            _fail(path, line, name, "gpus", f"{values['gpus']} is not whole hosts of {values['gpus_per_host']}")
        _check_sizes(path, line, name, values)
        if name in seen:
            _fail(path, line, name, "name", f"{name!r} is also row {seen[name]}'s name; give each row its own")
        seen[name] = line
        row = Row(values, line)
        try:  # a shape the model refuses (heads not a multiple of kv_heads, ...), named by the row's columns
            row_model(row)
        except ConfigError as e:
            fields = e.fields()
            column = _MODEL_COLUMNS.get(fields[0].name, fields[0].name) if fields else "model"
            _fail(path, line, name, column, e.render(_as_column))
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows after the header; add one row per published run")
    return rows


def _check_sizes(path, line: int, name: str, values: dict) -> None:
    """The row's parallel sizes against its GPUs and batch, in the file's own columns: ``tp x pp x cp`` divides
    ``gpus``; a numeric ``dp`` is the rest of them, an ``FSDP N`` divides it; ``gbs`` splits into
    microbatches of ``mbs`` over the data-parallel ranks.

    Raises:
      ValueError: One line naming the file, the row and the column (`_fail`).
    """
    model = values["tp"] * values["pp"] * values["cp"]
    if values["gpus"] % model:
        _fail(path, line, name, "gpus", f"{values['gpus']} is not a multiple of tp x pp x cp = {model}")
    ranks = values["gpus"] // model
    dp = values["dp"]
    if dp.isdigit() and int(dp) != ranks:
        _fail(path, line, name, "dp", f"{dp}: gpus / (tp x pp x cp) = {values['gpus']} / {model} = {ranks}")
    fsdp = re.fullmatch(r"FSDP (\d+)", dp)
    if fsdp and ranks % int(fsdp.group(1)):
        _fail(path, line, name, "dp", f"{dp!r}: FSDP N must divide gpus / (tp x pp x cp) = {ranks}")
    if values["gbs"] % (ranks * values["mbs"]):
        _fail(
            path,
            line,
            name,
            "gbs",
            f"{values['gbs']} does not split into microbatches of mbs={values['mbs']} over {ranks} data-parallel "
            f"ranks (gpus / (tp x pp x cp)); a multiple of {ranks * values['mbs']} does",
        )


_MODEL_COLUMNS = {
    "vocab_size": "vocab",
    "num_layers": "layers",
    "embed_dim": "hidden",
    "mlp_dim": "mlp",
    "num_heads": "heads",
    "num_kv_heads": "kv_heads",
    "head_dim": "head_dim",
}
"""The model field `row_model` sets -> the column it is read from."""


def _as_column(field: Field) -> str:
    """A model field in a refusal, as the rows file names it: ``kv_heads=24``."""
    column = _MODEL_COLUMNS.get(field.name, field.name)
    return column if field.value is None else f"{column}={field.value}"


def row_model(row: Row):
    """The row's shape as a meshwork model description (module docstring: a two-matrix MLP as SwiGLU of
    ``2 mlp / 3``)."""
    mlp = row.mlp if row.mlp_kind == "swiglu" else round(2 * row.mlp / 3 / 8) * 8
    sets = [
        f"vocab_size={row.vocab}",
        f"num_layers={row.layers}",
        f"embed_dim={row.hidden}",
        f"mlp_dim={mlp}",
        f"num_heads={row.heads}",
        f"num_kv_heads={row.kv_heads}",
        f"head_dim={row.head_dim}",
    ]
    return describe(get_config("7b", sets))


def row_inventory(row: Row, sustained: float | None = None) -> devices.Inventory:
    """The row's cluster: ``gpus / gpus_per_host`` hosts of its kind, ``network_gbps_per_host`` each.

    ``sustained``: the fraction of its burst matmul rate a kind with a measured one
    (`sharding.devices.SUSTAINED_FRACTION`: the H100 rows) holds under load, in place of the measured figure
    (``--sustained-fraction``); None keeps the measurement.
    """
    name, gib = GPUS[row.gpu]
    kind = devices.get_kind(name)
    if sustained is not None and kind.sustained_fraction is not None:
        kind = dataclasses.replace(kind, sustained_fraction=sustained)
    if gib is not None:
        kind = dataclasses.replace(kind, name=f"{name}_{gib}gb", memory_bytes=gib * GIB)
    hosts = tuple(devices.Host(kind, row.gpus_per_host, f"host{i}") for i in range(row.gpus // row.gpus_per_host))
    return devices.Inventory(hosts, row.network_gbps_per_host * 1e9 / 8)


def row_overlaps(row: Row) -> tuple[str, ...]:
    """The mesh axes whose collectives the row's run hid behind compute beyond meshwork's program (module
    docstring): its note says so, or it ran a NeMo recipe."""
    if "overlapped" in row.published_note or "NeMo" in row.published_note:
        return ("tensor", "data", "stage")
    return ()


def _on(value) -> bool:
    """A CSV on/off cell (``on``, ``on (distributed_fused_adam)``) read as switched on."""
    return str(value or "").strip().lower().startswith("on")


def row_layout(row: Row) -> tuple[str, str]:
    """``(--layout flags, pipeline clock)`` of the row (module docstring's mapping)."""
    model_split = row.tp * row.pp * row.cp
    fsdp = row.dp.startswith("FSDP")
    if fsdp:
        shard = row.gpus // model_split
        fsdp_size = int(row.dp.split()[1]) if re.fullmatch(r"FSDP \d+", row.dp) else shard
        data = shard // fsdp_size
    else:
        data, fsdp_size = int(row.dp), 1
    mesh = [("data", data), ("stage", row.pp), ("fsdp", fsdp_size), ("sequence", row.cp), ("tensor", row.tp)]
    text = ",".join(f"{a}={n}" for a, n in mesh if n > 1 or a == "data")
    rules = ("fsdp_tp" if row.tp > 1 else "fsdp") if fsdp else ("tp" if row.tp > 1 else "dp")
    if row.tp > 1 and _on(row.sp):
        rules += "_sp"
    micro = row.gbs // (data * fsdp_size * row.mbs) if row.pp > 1 else 1
    attention = "reference" if "SC'21" in row.source else ("ring" if row.cp > 1 else "flash")
    remat = {"full": "full", "selective": "dots"}.get(row.recompute.split(" ")[0].lower(), "none")
    flags = f"--mesh {text} --rules {rules} --microbatches {micro} --attention {attention} --dtype bfloat16"
    if data > 1 and (_on(row.dist_opt) or ax.DATA in row_overlaps(row)):
        flags += " --optimizer-sharding data"
    clock = "lockstep"
    if row.pp > 1:
        repeats = min(row.vp, row.layers // row.pp)
        schedule = "1f1b-fused" if repeats > 1 else "1f1b"
        flags += f" --pipeline-schedule {schedule} --remat none"
        if repeats > 1:
            flags += f" --pipeline-repeats {repeats}"
        clock = "fused"
    else:
        flags += f" --remat {remat}"
    return flags, clock


@dataclasses.dataclass(frozen=True)
class Priced:
    """One row priced: the row, its layout, the plan (None: the layout did not price), the seconds it took."""

    row: Row
    layout: str
    plan: planner.Plan | None
    error: str = ""
    seconds: float = 0.0

    @property
    def ratio(self) -> float | None:
        return None if self.plan is None else self.plan.step_time / self.row.published_step_s


def price(row: Row, sustained: float | None = None) -> Priced:
    """The row priced at its layout as ``python -m train.plan --layout`` prices it (with its pipeline clock)."""
    t0 = time.perf_counter()
    flags, clock = row_layout(row)
    model, inventory = row_model(row), row_inventory(row, sustained)
    options = planner.PlanOptions(dtype="bfloat16", one_f_one_b_clock=clock, overlaps=row_overlaps(row))
    defaults = argparse.Namespace(dtype="bfloat16", attention="flash", batch=row.gbs)
    try:
        layout, counts = given_layout(flags, model.num_layers, inventory.num_devices, defaults)
        plan_ = planner.evaluate(model, inventory, row.gbs, row.seq, layout, counts, options)
    except ValueError as e:
        return Priced(row, flags, None, str(e).splitlines()[0], time.perf_counter() - t0)
    return Priced(row, flags, plan_, "" if plan_ else "the batch does not split", time.perf_counter() - t0)


def biggest_terms(p: planner.Plan, n: int = 3) -> str:
    """The ``n`` largest parts of the step (seconds): compute, exposed collectives, bubble, ..."""
    parts = {
        "compute": p.parts["compute"],
        "exposed comm": p.parts["exposed_comm"],
        "unhidden overlap": p.parts["overlap_exposed"],
        "contention": p.parts["contention"],
        "optimizer": p.parts["optimizer"],
        "bubble": p.parts["bubble"],
    }
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v:.2f}" for k, v in top if v > 0)


def row_table(priced: Sequence[Priced]) -> list[str]:
    """Markdown: every row with its predicted and published step, ratio, fit and biggest terms."""
    lines = [
        "| row | gpus | layout (`--layout`) | published s | predicted s | ratio | fits | biggest terms (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in priced:
        r = p.row
        short = p.layout.replace(" --dtype bfloat16", "")
        if p.plan is None:
            lines.append(f"| {r.name} | {r.gpus} | `{short}` | {r.published_step_s:.3g} | - | - | - | {p.error} |")
            continue
        mark = "" if r.bf16 else f" ({r.precision}: not comparable)"
        lines.append(
            f"| {r.name}{mark} | {r.gpus} | `{short}` | {r.published_step_s:.3g} | {p.plan.step_time:.3g} | "
            f"{p.ratio:.2f} | {'yes' if p.plan.fits else 'no'} | {biggest_terms(p.plan)} |"
        )
    return lines


def _summary(ratios: Sequence[float]) -> tuple[float, float, float, float]:
    """``(median |ratio - 1|, worst ratio, lowest, highest)``."""
    worst = max(ratios, key=lambda x: abs(x - 1))
    return statistics.median(abs(x - 1) for x in ratios), worst, min(ratios), max(ratios)


def family_table(priced: Sequence[Priced]) -> list[str]:
    """Markdown: leave-one-family-out. Each family's rows priced with constants derived without them: the
    clock derives none from rows, so that is its own price; median |ratio - 1|, worst, range, rows in
    0.75-1.33."""
    lines = [
        "| family left out | bf16 rows | median abs(ratio-1) | worst ratio | lowest | highest | within 0.75-1.33 |",
        "|---|---|---|---|---|---|---|",
    ]
    families: dict[str, list[float]] = {}
    for p in priced:
        if p.ratio is not None and p.row.bf16:
            families.setdefault(p.row.family, []).append(p.ratio)
    for family, ratios in families.items():
        med, worst, lo, hi = _summary(ratios)
        inside = sum(0.75 <= x <= 1.33 for x in ratios)
        lines.append(
            f"| {family} | {len(ratios)} | {med:.3f} | {worst:.2f} | {lo:.2f} | {hi:.2f} | {inside}/{len(ratios)} |"
        )
    return lines


def summary_lines(priced: Sequence[Priced]) -> list[str]:
    """The targets: bf16 rows' median |ratio - 1|, worst ratio, rows within 0.80-1.25; rows not priced."""
    ratios = [p.ratio for p in priced if p.ratio is not None and p.row.bf16]
    unpriced = [p.row.name for p in priced if p.plan is None]
    out = []
    if ratios:
        med, worst, lo, hi = _summary(ratios)
        inside = sum(0.80 <= x <= 1.25 for x in ratios)
        out.append(
            f"bf16 rows priced: {len(ratios)}; median |ratio - 1| {med:.3f}; worst ratio {worst:.2f} "
            f"(range {lo:.2f}-{hi:.2f}); within 0.80-1.25: {inside}/{len(ratios)}"
        )
    if unpriced:
        out.append(f"not priced: {', '.join(unpriced)}")
    return out


def top_three(priced: Sequence[Priced], sustained: float | None = None) -> list[str]:
    """Markdown: for each row, the planner's three best plans (``train.plan``'s search with the row's clock and
    overlaps) beside the published layout's predicted step time."""
    lines = [
        "| row | published s | published layout predicted s | planner's three best (predicted s) |",
        "|---|---|---|---|",
    ]
    for p in priced:
        _, clock = row_layout(p.row)
        options = planner.PlanOptions(dtype="bfloat16", one_f_one_b_clock=clock, overlaps=row_overlaps(p.row))
        plans = planner.plan(row_model(p.row), row_inventory(p.row, sustained), p.row.gbs, p.row.seq, options, top=3)
        shown = "; ".join(
            f"`{plan_flags(x).replace(' --dtype bfloat16', '')}` {x.step_time:.3g}{'' if x.fits else ' (over memory)'}"
            for x in plans
        )
        given = f"{p.plan.step_time:.3g}" if p.plan else "-"
        lines.append(f"| {p.row.name} | {p.row.published_step_s:.3g} | {given} | {shown} |")
    return lines


def speed_ratio(rows: Sequence[Row], sustained: float | None = None) -> str:
    """The A100/H100 step-time ratio the clock gives a 7B step, one line: the first 6-8B H100 bf16 row without a
    pipeline (in rows.csv, Megatron-core's 7.1B on 96 H100) priced as is and on A100 80 GB hosts of the same
    network (empty when there is no such row or either does not price)."""
    h100 = [r for r in rows if r.gpu.startswith("h100") and r.pp == 1 and 6 <= _params(r) <= 8 and r.bf16]
    if not h100:
        return ""
    row = h100[0]
    a100 = Row(dict(row.values, gpu="a100-80gb", name=row.name + "-on-a100"), row.line)
    fast, slow = price(row, sustained), price(a100, sustained)
    if fast.plan is None or slow.plan is None:
        return ""
    return f"{row.name}: A100 / H100 step time {slow.plan.step_time / fast.plan.step_time:.2f}"


def _params(row: Row) -> float:
    """Billions of parameters of the row's layers (``12 h^2`` per layer with a 4h two-matrix MLP, its matrices
    otherwise)."""
    mats = 3 if row.mlp_kind == "swiglu" else 2
    attention = row.hidden * (row.heads + 2 * row.kv_heads) * row.head_dim + row.heads * row.head_dim * row.hidden
    return row.layers * (attention + mats * row.hidden * row.mlp) / 1e9


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows",
        default=None,
        help="a rows file in rows.csv's format (one published run a row; the columns are COLUMNS, described in "
        f"the README beside the shared rows file); default: {DEFAULT_ROWS.resolve()}, the shared folder beside "
        "the repository",
    )
    parser.add_argument("--only", default=None, help="comma-separated row names to price (default: all)")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of the tables")
    parser.add_argument(
        "--top-three", action="store_true", help="also search each row and list the planner's three best plans"
    )
    parser.add_argument(
        "--sustained-fraction",
        type=float,
        default=None,
        metavar="F",
        help="price the kinds with a measured sustained rate (H100, H200) at F of their burst matmul rate instead "
        "of the measurement (sharding.devices.SUSTAINED_FRACTION, 0.887), to see how the figures move over the "
        "published span, e.g. 0.848 or 0.951; a fraction in (0, 1]",
    )
    args = parser.parse_args(argv)
    if args.sustained_fraction is not None and not 0 < args.sustained_fraction <= 1:
        print(
            f"error: --sustained-fraction {args.sustained_fraction}: a fraction in (0, 1], e.g. 0.848", file=sys.stderr
        )
        return 2
    path = Path(args.rows) if args.rows else DEFAULT_ROWS.resolve()
    if args.rows is None and not path.exists():
        print(
            f"error: no rows file at {path} (the published rows live in the shared folder beside the repository, "
            "shared/published/rows.csv); pass --rows FILE.csv",
            file=sys.stderr,
        )
        return 2
    if args.json and args.top_three:
        print("error: --top-three adds a table to the text report; leave out --json or --top-three", file=sys.stderr)
        return 2
    try:
        rows = read_rows(path)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.only:
        wanted = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = sorted(wanted - {r.name for r in rows})
        if unknown or not wanted:
            names = ", ".join(r.name for r in rows[:3])
            print(
                f"error: --only {args.only!r}: no such row in {path}; e.g. --only {rows[0].name} (rows: {names}, ...)",
                file=sys.stderr,
            )
            return 2
        rows = [r for r in rows if r.name in wanted]
    priced = [price(r, args.sustained_fraction) for r in rows]
    if args.json:
        out = [
            {
                "name": p.row.name,
                "predicted_step_s": None if p.plan is None else p.plan.step_time,
                "published_step_s": p.row.published_step_s,
                "fits": None if p.plan is None else p.plan.fits,
            }
            for p in priced
        ]
        print(json.dumps(out, indent=1))
        return 0
    print("\n".join(row_table(priced)))
    print()
    print("\n".join(family_table(priced)))
    print()
    print("\n".join(summary_lines(priced)))
    if args.top_three:
        print()
        print("\n".join(top_three(priced, args.sustained_fraction)))
    ratio = speed_ratio(rows, args.sustained_fraction)
    if ratio:
        print(ratio)
    print(f"\npriced {len(priced)} rows in {sum(p.seconds for p in priced):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
