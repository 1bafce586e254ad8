"""Priced activation memory against the compiled step's, on the two layouts whose prices looked wrong.

The activations are what a step's temporaries grow by when its tokens grow and its weights do not: each case
compiles one train step (8 simulated CPU devices, abstract shapes) at two batch sizes and compares the growth of
``compiled.memory_analysis().temp_size_in_bytes`` with the growth of the cost model's in-flight bytes (the saved
activations and the logits; the gradients and the gathered weights do not change), within 10%; the pipeline's
growth with that of the same step on ``data`` (GPipe's per-microbatch buffers are priced 8% under the compiled
growth on ``data=4``, 10.4% on ``fsdp=4``: `bench/RESULTS.md`).

* A pipeline whose stage has fewer layers than the storage's ``fsdp`` devices (Llama 3 405B on ``stage=16,
  fsdp=64``: 8 layers a stage, a working copy of ``K' = 64`` slots). The padded slots never run; the step
  keeps, and the cost model prices, the copy and the saved slot inputs of the ``K`` layers only, so sharding the
  weights over ``fsdp`` leaves the activations those of ``data``.
* Full recompute without a pipeline over ``fsdp`` x ``tensor`` (torchtitan's Llama 3.1 70B layout): one layer
  input per layer and sequence on each device, whole over ``tensor`` (no sequence parallelism), plus one
  layer's working set.
"""

import functools

import pytest
from costmodel_grid import compiled_figures, config_of, predicted

from sharding import costmodel as cm

TOLERANCE = 0.10

# (model, mesh, rules, batch, seq, microbatches, remat[, stage layers, repeats, schedule]); batch and, for the
# pipeline, microbatches filled in by `_case`
_PADDED = ("test+num_layers=2", "stage=2,fsdp=4", "fsdp", None, 256, None, "none", None, 1, "gpipe")
_FLAT = ("test", "fsdp=4,tensor=2", "fsdp_tp", None, 64, 1, "full")


def _case(template, batch, mesh=None):
    """``template`` with ``batch`` sequences (a pipeline: in microbatches of 8) and, given, another mesh."""
    micro = template[5] if template[5] is not None else batch // 8
    return (template[0], mesh or template[1], template[2], batch, template[4], micro, *template[6:])


@functools.cache
def _grown(template, small: int, large: int, mesh=None):
    """``(compiled, priced, activations)``: how much the temporaries grow from ``small`` to ``large`` sequences a
    step, compiled and priced (in flight), and the priced saved activations' growth."""
    a, b = _case(template, small, mesh), _case(template, large, mesh)
    compiled = compiled_figures(b)["temp"] - compiled_figures(a)["temp"]
    priced = [predicted(b).memory, predicted(a).memory]
    return compiled, priced[0].in_flight - priced[1].in_flight, priced[0].activations - priced[1].activations


def test_a_padded_working_copy_saves_the_activations_of_its_layers_only():
    """GPipe on ``stage=2,fsdp=4``, one layer a stage (``K' = 4``), from 4 to 8 microbatches of 8 sequences: the
    compiled temporaries grow as on ``data=4`` (within 10%; before the padded slots were dropped, twice as much:
    6.64 MB against 3.43 MB, each extra step saving four slot inputs instead of one), and the activations priced
    on ``fsdp=4`` are those of ``data=4`` (they were 5.4x on the 405B layout)."""
    fsdp, priced_fsdp, saved_fsdp = _grown(_PADDED, 32, 64)
    data, priced_data, saved_data = _grown(_PADDED, 32, 64, "stage=2,data=4")
    assert abs(fsdp - data) <= TOLERANCE * data, (fsdp, data)
    assert saved_fsdp == saved_data == priced_fsdp == priced_data
    for batch in (32, 64):
        on_fsdp, on_data = (predicted(_case(_PADDED, batch, m)).memory for m in (None, "stage=2,data=4"))
        assert on_fsdp.activations == on_data.activations
        assert on_fsdp.gathered == on_data.gathered  # the copy of the stage's one layer, not of four slots


def test_full_recompute_saves_one_layer_input_per_layer_and_sequence():
    """``fsdp=4,tensor=2``, remat full, 2 layers: from 2 to 4 sequences a device the temporaries grow by the
    saved layer inputs (``[tokens, embed]`` per layer, whole over ``tensor``) and one layer's working set, as
    priced, within 10%. The 70B's 218 GB was this at 16 sequences a device (``--batch 512``, one microbatch):
    197 GB is 16 x (80 layer inputs of 8,192 x 8,192 bfloat16 + a layer's working set)."""
    compiled, priced, _ = _grown(_FLAT, 8, 16)
    assert abs(priced - compiled) <= TOLERANCE * compiled, (priced, compiled)
    layout = cm.Layout({"fsdp": 4, "tensor": 2}, "fsdp_tp", 1, remat="full")
    config = config_of("test", "full")
    one_more = [cm.estimate(config_of(f"test+num_layers={n}", "full"), 16, 64, layout, backend="cpu") for n in (2, 3)]
    layer_input = 4 * 64 * config.embed_dim * 4  # 4 sequences a device, 64 tokens each, float32
    assert one_more[1].memory.activations - one_more[0].memory.activations == pytest.approx(layer_input, rel=1e-12)
