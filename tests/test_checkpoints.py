"""The checkpoint manager: asynchronous saves, their completion, and restoring onto other meshes."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from checkpoints import manager as manager_lib
from checkpoints.manager import CheckpointManager
from sharding.mesh import make_mesh, parse_mesh


def sharded_state(mesh_spec):
    mesh = make_mesh(parse_mesh(mesh_spec, 8))
    sharding = NamedSharding(mesh, P("fsdp"))
    return {"w": jax.device_put(jnp.arange(64.0).reshape(16, 4), sharding), "step": jnp.int32(3)}, mesh


def test_an_asynchronous_save_is_visible_only_once_committed(tmp_path, monkeypatch):
    monkeypatch.setenv(manager_lib.SAVE_PAUSE_ENV, "2")
    state, _ = sharded_state("fsdp=8")
    manager = CheckpointManager(tmp_path / "ckpt", keep=2)
    try:
        assert manager.save(5, state, {"step": 5})
        # Orbax commits in a thread named save_finalize; the failure check relies on that name.
        assert manager_lib._finalizing()
        assert not (tmp_path / "ckpt" / "5").exists()
        manager.check_for_errors()  # still writing: no error
        manager.wait()
        assert not manager_lib._finalizing()
        assert (tmp_path / "ckpt" / "5").is_dir()
        manager.check_for_errors()
    finally:
        manager.close()


def test_restore_onto_another_mesh_reads_the_same_values(tmp_path):
    state, _ = sharded_state("fsdp=8")
    manager = CheckpointManager(tmp_path / "ckpt", async_save=False)
    manager.save(1, state, {"mesh": {"fsdp": 8}})
    manager.close()
    mesh = make_mesh(parse_mesh("data=2,tensor=4", 8))
    target = {
        "w": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(mesh, P(None, "tensor"))),
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
    }
    manager = CheckpointManager(tmp_path / "ckpt")
    try:
        restored, meta = manager.restore(target)
    finally:
        manager.close()
    assert meta == {"mesh": {"fsdp": 8}}
    assert restored["w"].sharding.spec == P(None, "tensor")
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(64.0).reshape(16, 4))
    assert int(restored["step"]) == 3


def test_a_read_only_manager_does_not_warn_that_it_is_read_only(tmp_path, caplog):
    """generate, evaluate and export open the run read-only; Orbax's two warnings saying so were printed on
    their stderr as if something were wrong."""
    (tmp_path / "checkpoints").mkdir()
    with caplog.at_level("WARNING"):
        manager = CheckpointManager(tmp_path / "checkpoints", read_only=True)
        assert manager.latest_step() is None
        import logging

        logging.getLogger("absl").warning("an unrelated warning")  # the filter drops those two lines only
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "read_only=True" in m or m.startswith("Given directory is read only")], messages
    assert "an unrelated warning" in messages
