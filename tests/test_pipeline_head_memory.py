"""The 1F1B head's weights priced as the compiled stage program holds them: whole over the batch axes, still
split over ``tensor``.

The stage program is manual over ``stage`` and the batch axes only (`sharding.pipeline.program.manual_axes`);
gathering the output projection once before the tick loop makes it whole over those, while the partitioner keeps
it split over ``tensor`` (XLA's buffers of the ``[D, V]`` projection on ``tensor=4``: ``[D, V/4]``). Growing the
vocabulary grows a step's temporaries by the head's gathered copy and gradient sums, the stored head's and
table's gradients and the logits (the layers do not change): that growth, compiled (8 simulated CPU devices,
``memory_analysis().temp_size_in_bytes``) and priced (in flight), within 10%. Pricing the copy whole over
``tensor`` too put it at 2.6 times the compiled growth on this mesh (the published runs' ``tensor=8``: 8 times
the copy's bytes; `bench/RESULTS.md`, "Published pipelined layouts over memory"). Under ``--remat full``: with
``none`` the stages keep their layers' residuals and the step's peak moves into the layers' backward, where the
head's logits are not live (`bench/RESULTS.md`, "Recompute inside pipeline stages"). The head step's peak (its
logits, their cotangent and its weights' gradient product) tops a layer's backward (with the slot's weights
sliced out of the working copy) at the larger vocabulary only, so its growth is part of the compared one.
"""

import pytest
from costmodel_grid import compiled_figures, predicted

TOLERANCE = 0.10


def _case(vocab: int):
    # (model, mesh, rules, batch, seq, microbatches, remat, stage layers, repeats, schedule)
    return (f"test+vocab_size={vocab}", "stage=2,tensor=4", "tp", 8, 32, 4, "full", None, 1, "1f1b")


def test_the_1f1b_heads_gathered_copy_stays_split_over_tensor():
    small, large = _case(512), _case(4096)
    compiled = compiled_figures(large)["temp"] - compiled_figures(small)["temp"]
    priced = predicted(large).memory.in_flight - predicted(small).memory.in_flight
    assert priced == pytest.approx(compiled, rel=TOLERANCE), (priced, compiled)
    # by hand: the copy and its float32 sums, 2 x [128, 3584 / 4] float32 more, are in the priced growth
    held = 2 * 128 * (4096 - 512) / 4 * 4
    gathered = predicted(large).memory.gathered - predicted(small).memory.gathered
    assert gathered == pytest.approx(held, rel=1e-9)
