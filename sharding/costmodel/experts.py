"""How a mixture of experts' products lower, as both the FLOP count (`sharding.costmodel.flops`) and the
memory estimate (`sharding.costmodel.memory`) price them; its own module because the FLOP count imports the
memory estimate, so what both read sits below both."""

from __future__ import annotations

from sharding.costmodel.layout import Layout, expert_placement_of
from sharding.modeldesc import ModelDescription

#: Backends whose compiled step runs a grouped product (`jax.lax.ragged_dot`, a mixture of experts' expert
#: products) densely: jax's default lowering of ``ragged_dot_general`` (``_ragged_dot_general_impl``, what
#: XLA:CPU gets) spreads the rows over a masked ``[groups, rows, in]`` array and multiplies it by every
#: group's weights in one dot, so each row costs every expert's product (`sharding.modeldesc.Product.groups`
#: times the routed share); seen in the compiled HLO of ``moe-test`` with and without pipeline stages. On GPU
#: jax lowers it to a Pallas Triton kernel or XLA's ragged-dot instruction, which compute the groups' rows
#: only (priced so; not checked on a GPU here).
DENSE_GROUPED_BACKENDS = ("cpu",)


def batched_experts(model: ModelDescription, layout: Layout) -> bool:
    """Whether the experts' products run as batched products over fixed buffers (the all-to-all dispatch with
    a capacity, `models.moe`, outside pipeline stages) rather than grouped ones (`jax.lax.ragged_dot`): the
    dispatch of the model's placement under the layout's rules (`sharding.costmodel.layout.expert_placement_of`).
    False for a model without experts."""
    if model.experts is None:
        return False
    return expert_placement_of(model, layout.rules_table(), layout.mesh).dispatch.fixed_buffers
