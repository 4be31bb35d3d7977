"""How a run maps onto the devices: mesh, batch arithmetic, parameter count, and bytes per
device of the state as it lives (the one place those bytes are counted; the planner predicts
them analytically)."""

from __future__ import annotations

import math
from collections import defaultdict

import jax
import numpy as np

from jaxpod.config import Config

DEVICE = "device"


def bytes_per_device(tree) -> dict[int, dict[str, int]]:
    """Bytes each device holds of the arrays in `tree`, by memory kind:
    `{device id: {"device": n, "pinned_host": m}}`. Live arrays are measured from their
    addressable shards; `ShapeDtypeStruct`s with a sharding from the shard shape on each
    device of the sharding (nothing needs to exist)."""
    held: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for leaf in jax.tree.leaves(tree):
        kind = leaf.sharding.memory_kind or DEVICE
        if isinstance(leaf, jax.ShapeDtypeStruct):
            size = _nbytes(leaf.sharding.shard_shape(leaf.shape), leaf.dtype)
            for device in leaf.sharding.device_set:
                held[device.id][kind] += size
            continue
        for shard in leaf.addressable_shards:
            held[shard.device.id][kind] += shard.data.nbytes
    return {d: dict(kinds) for d, kinds in sorted(held.items())}


def _nbytes(shape: tuple[int, ...], dtype) -> int:
    """Bytes of an array of `shape` and `dtype` (a live one's or a `ShapeDtypeStruct`'s)."""
    return math.prod(shape) * np.dtype(dtype).itemsize


def most_on_one_device(tree, kind: str | None = DEVICE) -> int:
    """The largest number of bytes of `tree` any one device holds (in memory `kind`; None:
    every kind)."""
    per = bytes_per_device(tree)
    count = lambda kinds: sum(kinds.values()) if kind is None else kinds.get(kind, 0)  # noqa: E731
    return max((count(k) for k in per.values()), default=0)


def describe(cfg: Config, mesh: jax.sharding.Mesh, state, per_step: int, unit: str, params: int):
    """A JSON-able summary of the mapping of this run (`params`: the real parameter count)."""
    p_bytes = bytes_per_device(state.params)
    o_bytes = bytes_per_device(state.opt_state)
    total = lambda kinds: sum(kinds.values())  # noqa: E731
    worst = max(p_bytes, key=lambda d: total(p_bytes[d]) + total(o_bytes.get(d, {})))
    return {
        "devices": mesh.size,
        "platform": mesh.devices.flat[0].platform,
        "mesh": dict(mesh.shape),
        "micro_batch": cfg.train.micro_batch,
        "grad_accum": cfg.train.grad_accum,
        "batch_parts": cfg.train.batch_parts,
        "global_batch": cfg.train.global_batch,
        "unit": unit,
        "per_step": per_step,
        "params": params,
        "param_bytes_total": sum(_nbytes(x.shape, x.dtype) for x in jax.tree.leaves(state.params)),
        "param_bytes_per_device": total(p_bytes[worst]),
        "optimizer_bytes_per_device": total(o_bytes.get(worst, {})),
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def format_mapping(m: dict) -> str:
    """Human-readable lines for the console."""
    mesh = " x ".join(f"{k} {v}" for k, v in m["mesh"].items())
    return "\n".join(
        [
            f"devices        {m['devices']} ({m['platform']})  mesh: {mesh}",
            f"global batch   {m['global_batch']} = micro_batch {m['micro_batch']} x replica "
            f"{m['mesh']['replica']} x grad_accum {m['grad_accum']}"
            + (f", fed in {m['batch_parts']} parts" if m.get("batch_parts", 1) > 1 else "")
            + f"  ({m['per_step']:,} {m['unit']}/step)",
            f"parameters     {m['params']:,} ({_mib(m['param_bytes_total'])} as stored)",
            f"per device     params {_mib(m['param_bytes_per_device'])} + optimizer "
            f"{_mib(m['optimizer_bytes_per_device'])}",
        ]
    )
