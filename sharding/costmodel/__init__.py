"""Cost model of one training step: FLOPs, bytes and collectives per device, and step time.

For a model described by a `sharding.modeldesc.ModelDescription` (its parameters with logical axes
and roles, matrix products, attention geometry, elementwise work and saved activations per token;
``models.spec.describe`` makes one), a global batch, a sequence length and a `Layout` (mesh sizes
over ``data, stage, fsdp, context, sequence, tensor``, a rules preset, microbatches, remat, stage split), it
predicts for one device; it knows nothing model-specific beyond the description:

* `sharding.costmodel.layout`: the `Layout` (`layout_of` derives it from a run's `Parallelism`), and
  where its rules put each parameter.
* `sharding.costmodel.flops`: **FLOPs** (`Flops`): the matrix products forward and backward
  (PaLM, Appendix B; Megatron-LM, SC'21, section 5.1), attention by implementation, the elementwise
  work and the optimizer update as XLA counts them.
* `sharding.costmodel.memory`: **Bytes** (`Memory`): parameters, gradients, AdamW's moments, the
  batch, the saved activations under the remat policy, the logits, the gathered weights.
* `sharding.costmodel.collectives`: one **collective** (`Comm`), its ring algorithm's bytes and
  steps, and the link hierarchy (`link_classes`).
* `sharding.costmodel.partitioner` and `sharding.costmodel.embedding`: every collective the
  partitioner emits for a step without stages (the embedding lookup case by case, per jax version);
  `sharding.costmodel.stream`: the residual stream split along ``embed`` where the rules keep the batch
  whole over an axis that splits the weights (``--rule batch=data`` with ``fsdp``).
* `sharding.costmodel.pipeline` and `sharding.costmodel.pipeline_comms`: the same for GPipe, circular and
  1F1B pipelines over the unpadded stage storage, the head on 1/S of the rows (the shapes and memory; the
  collectives).
* `sharding.costmodel.cost`: `Cost`, `device_cost` and `estimate`, which add the parts up.
* `sharding.costmodel.gemm` and `sharding.costmodel.time`: **step time** (`step_time`): each matrix product
  from its shapes (`gemm_seconds`: tiles in waves over the SMs, or the memory bandwidth), a flash kernel's
  products at its measured fraction of peak, elementwise work and the optimizer's traffic at the memory
  bandwidth, each collective by an alpha-beta model of its link class.

Checked against the compiler (``tests/test_costmodel.py``, ``bench/costmodel.py``): on CPU,
`Cost.counted_flops` against ``compiled.cost_analysis()["flops"]``, which counts the body of each
``while`` loop once (the scanned layers and the microbatch loop), `Cost.matmul_flops` against the
products of the compiled HLO with loop trip counts folded in (`sharding.hlo.dot_flops`), the state
and batch bytes against ``compiled.memory_analysis().argument_size_in_bytes``, and the bytes of
each collective kind against `sharding.hlo.collectives`; pipelines on the same figures
(``PIPELINE_GRID`` in ``bench/costmodel_grid.py``).

Units: FLOPs, bytes, seconds, FLOP/s, bytes/s. The package imports nothing of the project outside
`sharding`, never the model.
"""

from sharding.costmodel.collectives import BACKENDS, Comm, collective_bytes, host_shares, link_classes
from sharding.costmodel.cost import (
    Cost,
    StageBase,
    device_cost,
    estimate,
    stage_cost_base,
    stage_fixed_comms,
    stage_floor,
)
from sharding.costmodel.flops import ELEMENTWISE_BACKWARD_FACTOR, OPTIMIZER_FLOPS_PER_PARAM, Flops
from sharding.costmodel.gemm import GEMM_LAUNCH_SECONDS, Gemm, gemm_seconds, step_gemms
from sharding.costmodel.layout import (
    Layout,
    attention_of,
    describe_model,
    layout_of,
    ring_tokens,
    unpriced_attention,
)
from sharding.costmodel.memory import Memory
from sharding.costmodel.pipeline import tick_table
from sharding.costmodel.time import (
    DEFAULT_EFFICIENCY,
    ELEMENTWISE_BYTES_PER_FLOP,
    MEMORY_FRACTION,
    NCCL_LATENCY,
    CommTotals,
    Hardware,
    StepTime,
    comm_seconds,
    comm_totals,
    compute_floor,
    compute_seconds,
    hardware_for,
    step_time,
    step_time_from,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_EFFICIENCY",
    "ELEMENTWISE_BACKWARD_FACTOR",
    "ELEMENTWISE_BYTES_PER_FLOP",
    "GEMM_LAUNCH_SECONDS",
    "MEMORY_FRACTION",
    "NCCL_LATENCY",
    "OPTIMIZER_FLOPS_PER_PARAM",
    "Comm",
    "CommTotals",
    "Cost",
    "Flops",
    "Gemm",
    "Hardware",
    "Layout",
    "Memory",
    "StageBase",
    "StepTime",
    "attention_of",
    "collective_bytes",
    "comm_seconds",
    "comm_totals",
    "compute_floor",
    "compute_seconds",
    "gemm_seconds",
    "describe_model",
    "device_cost",
    "estimate",
    "hardware_for",
    "host_shares",
    "layout_of",
    "link_classes",
    "ring_tokens",
    "step_gemms",
    "stage_cost_base",
    "stage_fixed_comms",
    "stage_floor",
    "step_time",
    "step_time_from",
    "tick_table",
    "unpriced_attention",
]
