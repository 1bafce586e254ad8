"""The flag encoder of a layout (`train.setup.flags.parallelism_flags`): what the command line reads back."""

import pytest

from train.setup.cli import parse
from train.setup.flags import parallelism_flags

LAYOUTS = [
    ["--mesh", "fsdp=8"],
    ["--mesh", "data=2,fsdp=2,tensor=2", "--rules", "fsdp_tp", "--rule", "vocab=none", "--microbatches", "2"],
    ["--mesh", "data=8", "--rules", "dp", "--hetero-batch", "3,3,3,3,1,1,1,1", "--hetero-max-share", "4"],
    ["--mesh", "data=8", "--rules", "dp", "--hetero-batch", "auto", "--rebalance-every", "5"],
    ["--mesh", "data=8", "--rules", "dp", "--hetero-batch", "kinds", "--microbatches", "2"],
    ["--mesh", "stage=2,fsdp=4", "--microbatches", "4"],
    ["--mesh", "stage=2,fsdp=4", "--microbatches", "4", "--pipeline-schedule", "1f1b", "--pipeline-repeats", "2"],
    ["--mesh", "sequence=2,fsdp=4", "--context-layout", "zigzag"],
]


@pytest.mark.parametrize("argv", LAYOUTS, ids=lambda argv: " ".join(argv))
def test_a_layout_round_trips_through_its_flags(argv):
    run = parse(["--model", "test", *argv])
    flags = parallelism_flags(run.parallelism)
    again = parse(["--model", "test", *flags])
    assert parallelism_flags(again.parallelism) == flags  # given counts: --microbatches is their average
    assert again.parallelism.pipeline == run.parallelism.pipeline
    assert getattr(again.parallelism.strategy, "counts", None) == getattr(run.parallelism.strategy, "counts", None)
    assert again.parallelism.rules == run.parallelism.rules
    assert dict(again.parallelism.mesh_shape) == dict(run.parallelism.mesh_shape)
    assert again.parallelism.context_layout == run.parallelism.context_layout
