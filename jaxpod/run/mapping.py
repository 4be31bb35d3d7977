"""How a run maps onto the devices: mesh, batch arithmetic, parameter count and bytes per
device, measured from the live arrays' shards (not assumed)."""

from __future__ import annotations

from collections import defaultdict

import jax

from jaxpod.config.load import Config


def bytes_per_device(tree) -> dict[int, int]:
    """Bytes each device holds of the arrays in `tree` (device id -> bytes)."""
    held: dict[int, int] = defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device.id] += shard.data.nbytes
    return dict(held)


def describe(
    cfg: Config, mesh: jax.sharding.Mesh, params, opt_state, *, n_params: int | None = None
) -> dict:
    """A JSON-able summary of the mapping of this run. `n_params` overrides the count of the
    arrays' elements (packed stage rows include padding)."""
    if n_params is None:
        n_params = sum(leaf.size for leaf in jax.tree.leaves(params))
    p_bytes, o_bytes = bytes_per_device(params), bytes_per_device(opt_state)
    worst = max(p_bytes, key=lambda d: p_bytes[d] + o_bytes.get(d, 0))
    return {
        "devices": mesh.size,
        "platform": mesh.devices.flat[0].platform,
        "mesh": dict(mesh.shape),
        "micro_batch": cfg.train.micro_batch,
        "grad_accum": cfg.train.grad_accum,
        "global_batch": cfg.train.global_batch,
        "unit": "images" if cfg.is_vision else "tokens",
        "per_step": cfg.global_batch if cfg.is_vision else cfg.tokens_per_step,
        "params": n_params,
        "param_bytes_total": sum(leaf.nbytes for leaf in jax.tree.leaves(params)),
        "param_bytes_per_device": p_bytes[worst],
        "optimizer_bytes_per_device": o_bytes.get(worst, 0),
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
            f"{m['mesh']['replica']} x grad_accum {m['grad_accum']}  "
            f"({m['per_step']:,} {m['unit']}/step)",
            f"parameters     {m['params']:,} ({_mib(m['param_bytes_total'])} as stored)",
            f"per device     params {_mib(m['param_bytes_per_device'])} + optimizer "
            f"{_mib(m['optimizer_bytes_per_device'])}",
        ]
    )
