"""What each op of a stepwise schedule costs in the compiled program: XLA's cost analysis of
each branch of a tick's `lax.switch`, alone.

    python benchmarks/branch_costs.py [--kinds 1f1b,zb-h1,zb-v] [--mesh 1x4x1] [--micro 4]

The train step's `loss_and_grads` (bench_schedules' GPT, every scan unrolled) is compiled on
the mesh; in its HLO text a `conditional` with more than two branches is a tick's op
switch (idle, forward, backward or B, W, in op-code order). Each branch computation is
made the entry of a module and costed with `hlo_module_cost_analysis`: FLOPs per device of
that op on a stage (a chunk), and beside them the matmul FLOPs (2 · output elements ·
contracted size of every `dot` reached from the branch).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_schedules import MODEL, SCHEDULES  # noqa: E402
from common import options, run_worker, serve_worker, table, tiny_on_mesh  # noqa: E402

BLOCK = re.compile(r"\n(?=(?:ENTRY )?%?[\w.\-]+ \()")
DOT = re.compile(
    r"= f32\[([\d,]*)\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)"
    r".*?lhs_contracting_dims=\{([\d,]*)\}"
)


def computations(text: str) -> dict[str, str]:
    """The HLO module `text`'s computations by name, without the `ENTRY` mark."""
    found = {}
    for block in BLOCK.split(text):
        block = block.removeprefix("ENTRY ")
        head = re.match(r"%?([\w.\-]+) \(", block)
        if head:
            found[head.group(1)] = block
    return found


def dot_flops(comps: dict[str, str], shapes: dict[str, str], name: str, seen: set) -> int:
    """Matmul FLOPs of computation `name` and all it calls (each computation once)."""
    total = 0
    for line in comps[name].split("\n"):
        m = DOT.search(line)
        if m:
            lhs = shapes[m.group(2)].split(",")
            k = int(_prod(lhs[int(i)] for i in m.group(4).split(",")))
            total += 2 * _prod(d for d in m.group(1).split(",") if d) * k
        called = re.findall(r"(?:calls|to_apply|body)=%?([\w.\-]+)", line)
        branches = re.search(r"branch_computations=\{([^}]*)\}", line)
        called += [c.strip().lstrip("%") for c in branches.group(1).split(",")] if branches else []
        for c in called:
            if c in comps and c not in seen:
                seen.add(c)
                total += dot_flops(comps, shapes, c, seen)
    return total


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= int(d)
    return out


def _worker(job: dict) -> dict:
    """Runs inside a subprocess whose XLA_FLAGS already hold the device count."""
    import jax
    import jaxlib._hlo as hlo
    import numpy as np
    from jax._src.lib import xla_client

    from jaxpod.engine import abstract_engine

    over = [*SCHEDULES[job["schedule"]], f"train.grad_accum={job['micro']}"]
    cfg, mesh = tiny_on_mesh(job["mesh"], [*MODEL, *over])
    engine, state = abstract_engine(cfg, mesh, unroll=True)
    shape = (cfg.global_batch, cfg.model.seq_len + 1)
    tokens = jax.ShapeDtypeStruct(shape, np.int32, sharding=engine.batch_sharding[0])
    text = jax.jit(engine.loss_and_grads).lower(state.params, (tokens,)).compile().as_text()
    comps = computations(text)
    shapes = dict(re.findall(r"%([\w.\-]+) = f32\[([\d,]*)\]", text))
    found = re.findall(r"conditional\(.*?branch_computations=\{([^}]*)\}", text)
    switches = [names for names in found if names.count(",") > 1]
    switch = switches[len(switches) // 2]  # a tick in the middle: no initial value folded in
    client = jax.devices()[0].client
    costs = []
    for name in (n.strip().lstrip("%") for n in switch.split(",")):
        blocks = (("ENTRY " if n == name else "") + c for n, c in comps.items())
        module = "HloModule branch\n\n" + "\n".join(blocks)
        cost = xla_client._xla.hlo_module_cost_analysis(client, hlo.hlo_module_from_text(module))
        costs.append([cost.get("flops", 0.0), dot_flops(comps, shapes, name, {name})])
    return {"branches": costs}


def main() -> None:
    ap = options(__doc__)
    ap.add_argument("--kinds", default="1f1b,zb-h1,interleaved-1f1b,zb-v")
    ap.add_argument("--mesh", default="1x4x1", help="replica x pipeline x tensor")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per replica")
    args = ap.parse_args()
    if serve_worker(args, _worker):
        return
    mesh = tuple(int(n) for n in args.mesh.split("x"))
    rows = []
    for kind in args.kinds.split(","):
        job = {"schedule": kind, "mesh": mesh, "micro": args.micro}
        branches = run_worker(__file__, job, _prod(mesh))["branches"]
        cells = [f"{f / 1e6:.1f}M ({d / 1e6:.1f}M)" for f, d in branches[1:]]
        rows.append([kind, *cells, *[""] * (3 - len(cells))])
    header = ["schedule", "forward", "backward or B", "W"]
    print(table(f"FLOPs per device of a tick's op on {args.mesh}, M = {args.micro}", header, rows))


if __name__ == "__main__":
    main()
