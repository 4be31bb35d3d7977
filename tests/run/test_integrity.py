"""Checkpoint integrity in process (`jaxpod.run.integrity`, used by `jaxpod.run.checkpoint`):
every array's checksum is kept with it and verified on restore, so bytes changed on disk are
refused naming the array; a checkpoint missing its metadata is called unreadable, not "another
model"; a record without one of its keys is refused naming them."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxpod.errors import UserError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny GPT's state, saved once as checkpoint 1; (engine, state, run directory)."""
    from helpers import make_tiny_cfg, mesh_for

    from jaxpod.engine import build_engine
    from jaxpod.run.checkpoint import Checkpointer

    cfg = make_tiny_cfg()
    engine, state = build_engine(cfg, mesh_for(cfg))
    logdir = tmp_path_factory.mktemp("run")
    with Checkpointer(logdir, keep=1) as ckpt:
        ckpt.save(1, state, seed=0, config={"k": 1}, records=[["train", {"step": 1}]])
    return engine, state, logdir


def _copy(saved, tmp_path):
    import shutil

    shutil.copytree(saved[2], tmp_path / "run")
    return tmp_path / "run"


def _restore(engine, state, logdir):
    from jaxpod.run.checkpoint import Checkpointer

    ckpt = Checkpointer(logdir, keep=1)
    try:
        return ckpt.restore(1, engine, state, seed=0), ckpt.meta(1)
    finally:
        ckpt.close()


def test_checksums_change_with_any_element_and_not_with_the_sharding(saved):
    import jax

    from jaxpod.run.integrity import checksums

    engine, state, _ = saved
    sums = checksums(state)
    assert set(sums) >= {"step", "params.layers.mlp.w_in"}
    leaf = state.params["layers"]["mlp"]["w_in"]
    host = np.asarray(leaf).copy()
    host.reshape(-1)[12345] += 1e-3
    changed = jax.device_put(host, leaf.sharding)
    swapped = jax.device_put(np.asarray(leaf)[:, ::-1].copy(), leaf.sharding)  # same values
    replicated = jax.device_put(np.asarray(leaf))  # one device, no sharding
    from jaxpod.run.integrity import _leaf_sums

    def checksums(x):
        return np.asarray(_leaf_sums(x)).tolist()

    assert checksums(replicated) == checksums(leaf) == sums["params.layers.mlp.w_in"]
    assert checksums(changed) != checksums(leaf)
    assert checksums(swapped)[0] == checksums(leaf)[0]
    assert checksums(swapped)[1] != checksums(leaf)[1]


def test_restore_verifies_and_returns_the_kept_record(saved, tmp_path):
    engine, state, _ = saved
    restored, meta = _restore(engine, state, _copy(saved, tmp_path))
    assert meta["config"] == {"k": 1} and meta["records"] == [["train", {"step": 1}]]
    import jax

    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_zeroed_bytes_in_a_data_file_are_refused_naming_the_array(saved, tmp_path):
    engine, state, _ = saved
    run = _copy(saved, tmp_path)
    data = max(
        (p for p in (run / "checkpoints/1/state").rglob("*") if p.is_file()), key=os.path.getsize
    )
    with open(data, "r+b") as f:  # 8 zero bytes in the middle: still decodes, silently wrong
        f.seek(data.stat().st_size // 2)
        f.write(b"\0" * 8)
    with pytest.raises(UserError) as err:
        _restore(engine, state, run)
    line = str(err.value)
    assert line.startswith(f"checkpoint {run}/checkpoints/1 is damaged: "), line
    assert "does not match the checksum saved with it" in line and "delete that directory" in line


def test_missing_metadata_is_unreadable_not_another_model(saved, tmp_path):
    engine, state, _ = saved
    run = _copy(saved, tmp_path)
    (run / "checkpoints/1/state/_METADATA").unlink()
    with pytest.raises(UserError, match=r"checkpoints/1 cannot be read \(state/_METADATA is miss"):
        _restore(engine, state, run)


def test_a_record_without_checksums_or_layer_order_is_refused(saved, tmp_path):
    """A checkpoint's record holds every key of `RECORD`: one without some is refused in one
    line naming them, before any array is read."""
    import json

    engine, state, _ = saved
    run = _copy(saved, tmp_path)
    meta = run / "checkpoints/1/meta/metadata"
    record = json.loads(meta.read_text())
    kept = {k: v for k, v in record.items() if k not in ("checksums", "layer_order")}
    meta.write_text(json.dumps(kept))
    with pytest.raises(UserError) as err:
        _restore(engine, state, run)
    line = str(err.value)
    assert "\n" not in line, line
    assert line == (
        f"checkpoint {run}/checkpoints/1 has another layout (its record has no checksums, "
        "layer_order); use a fresh train.logdir"
    )


def test_non_finite_metrics_are_named():
    from helpers import make_tiny_cfg

    from jaxpod.run.steplog import nonfinite

    cfg = make_tiny_cfg()
    assert nonfinite(cfg, {"loss": 2.0, "param_norm": 3.0}) is None
    assert nonfinite(cfg, {"loss": float("nan"), "param_norm": 3.0}) == "loss nan"
    dynamic = make_tiny_cfg("precision.loss_scale=dynamic")
    assert nonfinite(dynamic, {"loss": float("inf"), "param_norm": 3.0}) is None  # skipped
    assert nonfinite(dynamic, {"loss": 1.0, "param_norm": float("inf")}) == "param_norm inf"
