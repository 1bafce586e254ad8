"""``--dry-run`` prints the cost model's figures for the run's own layout beside the compiler's."""

import re

from train import train


def _mib(cell: str) -> float:
    return float(cell.split()[0])


def test_dry_run_prints_the_cost_model_beside_the_compiler(capsys):
    code = train.main(
        [
            "--model",
            "test",
            "--mesh",
            "data=2,fsdp=4",
            "--rules",
            "fsdp",
            "--batch-size",
            "16",
            "--seq-len",
            "64",
            "--dry-run",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    block = out[out.index("cost model (sharding.costmodel, cpu lowering) for this run's layout, every device") :]
    rows = {
        m[1]: (m[2], m[3]) for m in re.finditer(r"^  (\S[\w ()+-]*?)\s{2,}([\d.]+ \w+)\s+([\d.]+ \w+)$", block, re.M)
    }
    assert {"matrix-product FLOPs", "arguments (state + batch)", "all-gather", "all-reduce"} <= set(rows), rows
    for label in ("arguments (state + batch)", "all-gather", "all-reduce"):  # the bench's 10% (bench/costmodel.py)
        predicted, compiled = map(_mib, rows[label])
        assert abs(predicted - compiled) <= 0.10 * compiled, (label, predicted, compiled)
