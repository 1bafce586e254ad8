"""Mesh flag parsing, device layout across processes, and the built mesh."""

import dataclasses

import jax
import numpy as np
import pytest

from sharding.axes import MESH_AXES
from sharding.mesh import crossing_axes, device_grid, format_mesh, make_mesh, parse_mesh, split_outer_inner
from train.setup.flagnames import render


def test_parse_fills_minus_one_and_orders_axes():
    shape = parse_mesh("tensor=2, data=2,fsdp=-1", 8)
    assert list(shape) == list(MESH_AXES)
    assert shape == {"data": 2, "stage": 1, "fsdp": 2, "expert": 1, "context": 1, "sequence": 1, "tensor": 2}


def test_parse_empty_means_fsdp_over_all_devices():
    assert parse_mesh("", 8)["fsdp"] == 8


def test_format_mesh_leaves_out_unit_axes():
    assert format_mesh(parse_mesh("data=2,tensor=4", 8)) == "data=2,tensor=4"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("dat=2,fsdp=4", "unknown mesh axis 'dat'"),
        ("data=-1,fsdp=-1", "at most one axis may be -1"),
        ("data=0,fsdp=-1", "size 0 of axis 'data'"),
        ("data=-3,fsdp=-1", "size -3 of axis 'data'"),
        ("data=two", "is not an integer"),
        ("data=2,data=4", "given twice"),
        ("data", "is not AXIS=SIZE"),
        ("data=2,fsdp=2", "JAX sees 8 devices"),
        ("data=3,fsdp=-1", "does not divide the 8 devices"),
    ],
)
def test_parse_errors_name_the_problem_and_show_an_example(spec, message):
    with pytest.raises(ValueError) as info:
        parse_mesh(spec, 8)
    text = render(info.value)
    assert message in text
    assert "example: --mesh" in text


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def fake_devices(processes, per_process):
    # Shuffled ids so that the layout cannot rely on input order.
    devices = [FakeDevice(p * per_process + i, p) for p in range(processes) for i in range(per_process)]
    return list(reversed(devices))


def test_tensor_stays_inside_a_process_by_default():
    shape = parse_mesh("data=2,fsdp=2,tensor=4", 16)
    grid = device_grid(shape, fake_devices(4, 4))
    tensor_axis = MESH_AXES.index("tensor")
    groups = np.moveaxis(grid, tensor_axis, -1).reshape(-1, 4)
    for group in groups:
        assert len({d.process_index for d in group}) == 1
    # fsdp (2) x tensor (4) = 8 > 4 devices per process: fsdp must cross processes.
    outer, inner = split_outer_inner(shape, 4, 4)
    assert inner["tensor"] == 4 and outer["fsdp"] == 2 and outer["data"] == 2


def test_mesh_outer_controls_which_axis_crosses_processes():
    shape = parse_mesh("data=2,fsdp=4", 8)
    grid = device_grid(shape, fake_devices(2, 4), outer={"data": 2})
    data_axis = MESH_AXES.index("data")
    for index in range(2):
        block = np.take(grid, index, axis=data_axis)
        assert {d.process_index for d in block.ravel()} == {index}


def test_outer_split_errors():
    shape = parse_mesh("data=2,fsdp=4", 8)
    with pytest.raises(ValueError, match="does not divide"):
        split_outer_inner(shape, 2, 4, outer={"data": 3})
    with pytest.raises(ValueError, match="there are 2 processes"):
        split_outer_inner(shape, 2, 4, outer={"fsdp": 4})


def test_uneven_processes_are_refused():
    devices = [FakeDevice(0, 0), FakeDevice(1, 0), FakeDevice(2, 1), FakeDevice(3, 2)]
    with pytest.raises(ValueError, match="different numbers of devices"):
        device_grid(parse_mesh("fsdp=4", 4), devices)


def test_make_mesh_uses_auto_axes_and_every_device():
    mesh = make_mesh(parse_mesh("data=2,fsdp=2,tensor=2", 8))
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "expert": 1, "context": 1, "sequence": 1, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert sorted(d.id for d in mesh.devices.ravel()) == sorted(d.id for d in jax.devices())
    assert crossing_axes(mesh) == {}
