"""The whole schedule matrix against the single-device reference (GPT and BERT).

    python benchmarks/check_schedules.py [--out FILE]

Every schedule (gpipe, circular with V = 2, 1f1b) on (1,2,1), (1,4,1), (2,2,2) and (1,2,4)
for M in {S, 2S, 4S} micro-batches per replica, GPT and BERT (8 layers, d 64, seq 32): the
loss and the worst gradient leaf (max |got - want| / max |want|) of `engine.loss_and_grads`
against `jax.value_and_grad` of the model's own `__call__` on the whole batch on one device,
with the bounds of the test suite (loss 1e-6 relative, gradients 3e-6). The suite runs a
representative part of this (tests/engine/test_schedules_engine.py); this script runs all
of it (about 10 minutes on 2 cores) and prints a table. Exit 1 if a case is over a bound.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, options, table, write_report  # noqa: E402

from jaxpod.platform import virtual_cpu_flags  # noqa: E402  (jax-free)

os.environ["XLA_FLAGS"] = virtual_cpu_flags(8)  # before jax starts

LOSS_RTOL, GRAD_TOL = 1e-6, 3e-6
BASE = ["model.layers=8", "model.seq_len=32", "train.micro_batch=1", "train.grad_accum=null"]
BASE += ["optim.warmup_steps=0"]
SCHEDULES = {
    "gpipe": [],
    "circular": ["train.pipeline_schedule=circular", "train.virtual_stages=2"],
    "1f1b": ["train.pipeline_schedule=1f1b"],
}
MESHES = [(1, 2, 1), (1, 4, 1), (2, 2, 2), (1, 2, 4)]


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxpod.config import load_config
    from jaxpod.engine import build_engine
    from jaxpod.models.family import build_model, row_keys
    from jaxpod.parallel.mesh import make_mesh

    args = options(__doc__, out="schedules_check.json").parse_args()
    refs: dict = {}

    def cfg_of(model, mesh, rows, extra):
        r, p, t = mesh
        over = [*BASE, f"devices={r * p * t}", f"mesh.replica={r}", f"mesh.pipeline={p}"]
        over += [f"mesh.tensor={t}", f"train.global_batch={rows}", *extra]
        if model == "bert":
            over += ["model.name=bert", "model.vocab=264"]
        return load_config(ROOT / "configs" / "tiny.yaml", over)

    def reference(model, rows, tokens):
        if (model, rows) not in refs:
            cfg = cfg_of(model, (1, 1, 1), rows, [])
            graphdef, state = nnx.split(build_model(cfg.model, cfg.train.seed))
            keys = row_keys(cfg.train.seed, 0, jnp.arange(rows))
            args = (keys,) if model == "bert" else ()
            fn = lambda p: nnx.merge(graphdef, p)(tokens, *args)  # noqa: E731
            refs[(model, rows)] = jax.jit(jax.value_and_grad(fn))(nnx.to_pure_dict(state))
        return refs[(model, rows)]

    results, rows_out, worst_ok = {}, [], True
    for model in ("gpt", "bert"):
        for mesh in MESHES:
            for mult in (1, 2, 4):
                micro = mult * mesh[1]
                rows = mesh[0] * micro
                tokens = np.random.default_rng([11, rows]).integers(0, 256, (rows, 33), np.int32)
                want_loss, want = reference(model, rows, tokens)
                for kind, extra in SCHEDULES.items():
                    cfg = cfg_of(model, mesh, rows, extra)
                    devices = jax.devices()[: mesh[0] * mesh[1] * mesh[2]]
                    engine, state = build_engine(cfg, make_mesh(cfg.mesh, devices))
                    batch = jax.device_put((tokens,), engine.batch_sharding)
                    loss, _, grads = jax.jit(engine.loss_and_grads)(state.params, batch)
                    grads = jax.device_get(grads)
                    if engine.stages.layer_order is not None:
                        back = np.argsort(engine.stages.layer_order)
                        unstacked = jax.tree.map(lambda a, b=back: a[b], grads["layers"])
                        grads = {**grads, "layers": unstacked}
                    loss_err = abs(float(loss) - float(want_loss)) / abs(float(want_loss))
                    grad_err = max(
                        float(np.max(np.abs(np.asarray(g, np.float64) - w)) / np.max(np.abs(w)))
                        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True)
                    )
                    ok = loss_err <= LOSS_RTOL and grad_err <= GRAD_TOL
                    worst_ok &= ok
                    name = f"{model} {'x'.join(map(str, mesh))} M={micro} {kind}"
                    results[name] = {"loss_rel": loss_err, "grad_rel": grad_err, "ok": ok}
                    rows_out.append(
                        [
                            model,
                            "x".join(map(str, mesh)),
                            micro,
                            kind,
                            f"{loss_err:.1e}",
                            f"{grad_err:.1e}",
                            "ok" if ok else "OVER",
                        ]
                    )
                    print(name, f"{loss_err:.1e} {grad_err:.1e}", file=sys.stderr, flush=True)
    header = ["model", "mesh", "M", "schedule", "loss rel", "worst grad leaf", ""]
    print(table("every schedule vs the single-device reference", header, rows_out))
    write_report(results, args.out)
    raise SystemExit(0 if worst_ok else 1)


if __name__ == "__main__":
    main()
