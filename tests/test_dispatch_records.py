"""The records of the MoE expert dispatches (`sharding.dispatch`) and the context exchanges (`sharding.exchange`):
which one a layout gets, and what the model, the cost model and the report read of it. No devices needed."""

import dataclasses

import pytest

from models import attention_registry as registry
from sharding import dispatch, exchange
from sharding.bound import require_bound
from sharding.modeldesc import AttentionTraits, ExpertGeometry


@pytest.mark.parametrize(
    "capacity_factor, experts_per_token, split, want",
    [
        (0.0, 2, 1, dispatch.LOCAL),  # no expert parallelism
        (1.25, 2, 1, dispatch.LOCAL),
        (0.0, 2, 8, dispatch.RING),  # dropless
        (1.25, 2, 8, dispatch.ALL_TO_ALL),  # cf * k = 2.5 < 8: the buffers move less than the ring
        (1.25, 2, 2, dispatch.RING),  # cf * k = 2.5 >= 2
        (1.0, 2, 2, dispatch.RING),  # cf * k = E_p: the ring
    ],
)
def test_expert_dispatch_chooses_by_capacity_and_split(capacity_factor, experts_per_token, split, want):
    assert dispatch.expert_dispatch(capacity_factor, experts_per_token, split) is want


def test_experts_split_over_an_axis_that_does_not_split_the_tokens_take_the_ring():
    """cf * k = 2.5 < 8 would choose the fixed buffers, but a device's buffers would repeat its peers' tokens
    over such an axis: the model and the cost model read the ring from the one rule."""
    assert dispatch.expert_dispatch(1.25, 2, 8, splits_tokens=False) is dispatch.RING
    geometry = ExpertGeometry(layers=2, num_experts=16, experts_per_token=2, capacity_factor=1.25)
    assert geometry.dispatch(8) is dispatch.ALL_TO_ALL
    assert geometry.dispatch(8, splits_tokens=False) is dispatch.RING
    assert geometry.dispatch(1, splits_tokens=False) is dispatch.LOCAL


def test_dispatch_records_say_what_the_model_cost_model_and_report_read():
    assert [d.name for d in dispatch.DISPATCHES] == ["local", "ring", "all_to_all"]
    assert dispatch.LOCAL.describe(0.0) == "local (no expert parallelism)"
    assert dispatch.RING.describe(0.0) == "all-gather / reduce-scatter over expert (dropless)"
    assert dispatch.RING.describe(1.0) == "all-gather / reduce-scatter over expert (capacity factor 1)"
    assert dispatch.ALL_TO_ALL.describe(1.25) == "all-to-all over expert (capacity factor 1.25)"
    assert not dispatch.LOCAL.collectives
    assert dispatch.RING.gathers_tokens and not dispatch.RING.fixed_buffers
    assert dispatch.ALL_TO_ALL.fixed_buffers and not dispatch.ALL_TO_ALL.gathers_tokens
    assert set(dispatch.RING.collectives) == {"all-gather", "reduce-scatter"}
    assert dispatch.ALL_TO_ALL.collectives == ("all-to-all",)


@pytest.mark.parametrize(
    "record, want, swapped",
    [
        (exchange.RING, (("context", "sequence"), ()), (("sequence", "context"), ())),
        (exchange.ALL_TO_ALL, ((), ("context", "sequence")), ((), ("sequence", "context"))),
        (exchange.USP, (("context",), ("sequence",)), (("sequence",), ("context",))),
        (exchange.NONE, ((), ()), ((), ())),
    ],
    ids=lambda x: getattr(x, "name", "") or None,
)
def test_context_exchange_groups_the_length_axes(record, want, swapped):
    """The ring and all-to-all axes of each exchange over the length rule's axes (every preset's: ``context``
    outer, ``sequence`` inner); with the rule's order swapped, USP's all-to-all runs over its last axis
    (``context``), as its kernel does (`models.attention_kernels.run_usp`)."""
    length, mesh = ("context", "sequence"), {"fsdp": 2, "context": 2, "sequence": 4}
    assert record.groups(mesh, length) == want
    assert record.groups(mesh, length[::-1]) == swapped
    ring, all_to_all = record.groups({"fsdp": 8, "context": 1, "sequence": 4}, length)  # size-1 axes left out
    assert "context" not in ring + all_to_all


def test_only_the_ring_takes_uneven_shares():
    assert [e.name for e in exchange.EXCHANGES if e.takes_shares] == ["ring"]


def test_attention_records_read_their_exchange():
    heads = {r.name: (r.splits_heads, r.inner_all_to_all) for r in registry.KERNELS}
    assert heads["ring"] == (False, False)
    assert heads["ulysses"] == (True, False)
    assert heads["usp"] == (True, True)
    assert heads["flash"] == heads["reference"] == (False, False)
    for record in registry.KERNELS:
        assert record.traits.exchange.name == record.traits.context_exchange
        assert record.traits.splits_length == (record.traits.exchange is not exchange.NONE)


def test_an_unknown_context_exchange_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="context exchange 'rung': choose one of ring, all_to_all, usp"):
        AttentionTraits("x", materialises_scores=False, context_exchange="rung")


def test_the_records_hold_the_functions_that_perform_them():
    """Every dispatch and attention record holds the function the model bound to it (no lookup by name); a
    second binding is refused, and a record nothing performs names itself and where its function belongs."""
    from models import attention_kernels, moe

    assert dispatch.LOCAL.run is dispatch.RING.run is moe._gathered
    assert dispatch.ALL_TO_ALL.run is moe._exchanged
    assert registry.kernel("ring").run is attention_kernels.run_ring
    assert all(attention_kernels.wrapper(record) is record.run for record in registry.KERNELS)
    assert len({record.run for record in registry.KERNELS}) == len(registry.KERNELS)
    with pytest.raises(ValueError, match="expert dispatch ring: two functions perform it"):
        dispatch.RING.bind(moe._exchanged)
    assert dispatch.RING.run is moe._gathered
    unbound = dispatch.ExpertDispatch("new", "new")
    assert unbound == dispatch.ExpertDispatch("new", "new")
    with pytest.raises(LookupError, match="expert dispatch new: no function in models.moe performs it"):
        require_bound([unbound])
    spare = dataclasses.replace(registry.kernel("flash"))
    assert spare == registry.kernel("flash")  # the function takes no part in the record's value
    with pytest.raises(LookupError, match="attention flash: no function in models.attention_kernels performs it"):
        require_bound([spare])
