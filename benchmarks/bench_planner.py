"""Planner vs compiler: the planner's per-device bytes next to XLA's `memory_analysis()`.

    python benchmarks/bench_planner.py [--only TEXT] [--out FILE]

One process with 8 virtual CPU devices; for each config the real train step is compiled and
its argument + temp bytes (per device) are compared with `plan(cfg)`'s device total.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, options, write_report  # noqa: E402

from jaxpod.platform import use_virtual_cpu_devices  # noqa: E402  (jax-free)

SMALL = ["model.d_model=128", "model.d_ff=512", "model.seq_len=128", "model.layers=4"]
RTS4 = ["memory.rts=4", "memory.rts_optimizer=4"]
WEIGHTS = ["model.seq_len=16", "train.micro_batch=1", "model.d_model=256", "model.d_ff=1024"]
FP16_SR = [
    "precision.params=float16",
    "precision.compute=float16",
    "precision.master=same-as-params",
    "precision.loss_scale=dynamic",
]
MATRIX = ["memory.stream=matrix"]
BF16 = ["precision.compute=bfloat16"]
D512 = ["model.d_model=512", "model.d_ff=2048", "model.seq_len=16", "train.micro_batch=1"]
D512 += ["optim.name=sgd"]
SP_CHUNKS = ["model.sequence_parallel=true", "model.sequence_chunks=8"]
VOCAB = ["model.vocab=8192"]
CASES = [  # (replica, pipeline, tensor), remat, grad_accum, extra overrides
    ((1, 1, 1), "none", 1, []),
    ((1, 1, 1), "full", 1, []),
    ((1, 1, 1), "attention", 1, []),
    ((1, 1, 1), "none", 4, []),
    ((1, 2, 1), "none", 4, []),
    ((1, 2, 1), "full", 4, []),
    ((1, 1, 2), "none", 1, []),
    ((2, 2, 2), "comms", 4, []),
    (
        (1, 1, 1),
        "none",
        1,
        [
            "model.seq_len=16",
            "train.micro_batch=1",
            "model.d_model=256",
            "model.d_ff=1024",
            "model.vocab=4096",
        ],
    ),
    ((1, 1, 1), "none", 1, ["model.sequence_chunks=8"]),
    ((1, 1, 1), "full", 1, ["model.sequence_chunks=8"]),
    ((1, 2, 1), "full", 4, ["model.sequence_chunks=8"]),
    ((1, 1, 4), "comms", 1, ["model.sequence_parallel=true"]),
    ((1, 2, 4), "full", 4, ["model.sequence_parallel=true"]),
    ((2, 2, 2), "comms", 4, ["model.sequence_parallel=true", "model.sequence_chunks=8"]),
    # replicated tensor sharding (weights + optimizer state over 4 replicas)
    ((4, 1, 1), "full", 2, [*RTS4]),
    ((4, 2, 1), "full", 2, [*RTS4]),
    ((4, 1, 1), "full", 4, [*WEIGHTS, "model.layers=8"]),
    ((4, 1, 1), "full", 4, [*WEIGHTS, "model.layers=8", *RTS4]),
    ((4, 2, 1), "full", 4, [*WEIGHTS, "model.layers=8", *RTS4]),
    # the update on its own: weights dominate (seq 16), float32 LAMB, then the FP16 recipe
    ((1, 1, 1), "full", 1, [*WEIGHTS, "optim.name=lamb"]),
    ((1, 1, 1), "full", 1, [*WEIGHTS, "optim.name=lamb", *FP16_SR]),
    ((1, 2, 1), "full", 4, [*WEIGHTS, "model.layers=8", "optim.name=lamb", *FP16_SR]),
    # bfloat16 compute: XLA:CPU keeps its values in float32 buffers (`stores_in_float32`)
    ((1, 2, 1), "full", 4, [*BF16]),
    ((1, 1, 1), "attention", 1, [*BF16]),
    # GPipe in passes: 8 micro-batches in one pass, then in four passes of 2
    ((1, 2, 1), "full", 8, []),
    ((1, 2, 1), "full", 8, ["train.pipeline_group=2"]),
    # streamed matrix by matrix (memory.stream=matrix), the MLP in 2 or 4 blocks; the d 512
    # case is tests/planner/test_plan_vs_xla.py::test_matrix_stream_shrinks_compiled_memory's
    ((4, 1, 1), "full", 2, [*RTS4, *MATRIX, "memory.mlp_panels=2"]),
    ((4, 2, 1), "full", 4, [*WEIGHTS, "model.layers=8", *RTS4, *MATRIX, "memory.mlp_panels=2"]),
    ((1, 2, 4), "full", 4, ["model.sequence_parallel=true", "model.sequence_chunks=8", *MATRIX]),
    ((4, 2, 1), "full", 4, [*D512, *RTS4]),
    ((4, 2, 1), "full", 4, [*D512, *RTS4, *MATRIX, "memory.mlp_panels=2"]),
    ((4, 2, 1), "full", 4, [*D512, *RTS4, *MATRIX, "memory.mlp_panels=4"]),
    # under tensor parallelism XLA keeps the layer's backward working set, not a step's
    ((1, 2, 4), "full", 4, ["model.sequence_parallel=true", *MATRIX]),
    ((1, 2, 4), "full", 4, []),
    ((1, 2, 4), "full", 4, [*MATRIX]),
    ((1, 2, 4), "full", 4, [*SP_CHUNKS, *MATRIX, "memory.mlp_panels=4"]),
    ((1, 1, 4), "full", 2, ["model.sequence_parallel=true"]),
    ((1, 1, 4), "full", 2, ["model.sequence_parallel=true", *MATRIX]),
    ((1, 1, 4), "full", 2, []),
    ((1, 1, 4), "full", 2, [*MATRIX]),
    # MLP token blocks (sequence_chunks) with RTS: XLA keeps one block's hidden units
    ((4, 2, 1), "full", 4, [*RTS4, "model.sequence_chunks=8"]),
    ((4, 1, 1), "full", 2, [*RTS4, "model.sequence_chunks=8"]),
    ((2, 2, 2), "full", 4, ["memory.rts=2", "model.sequence_chunks=8"]),
    ((2, 2, 2), "full", 4, ["memory.rts=2", *SP_CHUNKS]),
    ((2, 1, 4), "full", 2, ["memory.rts=2", *SP_CHUNKS]),
    ((2, 1, 4), "full", 2, ["memory.rts=2", *SP_CHUNKS, *MATRIX, "memory.mlp_panels=4"]),
    # GPT-3's knobs in small (RTS, sequence parallel, token blocks, matrix streaming), a large
    # vocabulary: the token table whole, then in 8 blocks of rows (memory.vocab_slices)
    ((2, 2, 2), "full", 4, ["memory.rts=2", *SP_CHUNKS, *MATRIX, "memory.mlp_panels=4"]),
    ((2, 2, 2), "full", 4, ["memory.rts=2", *SP_CHUNKS, *MATRIX, "memory.mlp_panels=4", *VOCAB]),
    (
        (2, 2, 2),
        "full",
        4,
        ["memory.rts=2", *SP_CHUNKS, *MATRIX, "memory.mlp_panels=4", *VOCAB]
        + ["memory.vocab_slices=8"],
    ),
]


def measure(case) -> dict:
    import jax

    from jaxpod.config import load_config
    from jaxpod.inspect.compile import abstract_inputs, compile_to_inspect
    from jaxpod.parallel.mesh import make_mesh
    from jaxpod.planner.plan import plan

    (r, p, t), remat, accum, extra = case
    overrides = [
        f"devices={r * p * t}",
        f"mesh.replica={r}",
        f"mesh.pipeline={p}",
        f"mesh.tensor={t}",
        *SMALL,
        f"model.remat={remat}",
        f"train.grad_accum={accum}",
        *extra,
    ]
    cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides)
    mesh = make_mesh(cfg.mesh, jax.devices()[: r * p * t])
    engine, state, batch = abstract_inputs(cfg, mesh)
    mem = compile_to_inspect(engine.train_step.lower(state, batch)).memory_analysis()
    planned = plan(cfg)
    compiled = mem.argument_size_in_bytes + mem.temp_size_in_bytes
    total = planned["bytes_per_device"]["device_total"]
    return {
        "mesh": f"{r}x{p}x{t}",
        "remat": remat,
        "grad_accum": accum,
        "extra": extra,
        "argument_bytes": mem.argument_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "compiled_bytes": compiled,
        "planned_bytes": total,
        "ratio": total / compiled,
        "planned": planned["bytes_per_device"],
    }


def main() -> None:
    ap = options(__doc__, only="", only_help="the cases whose row contains TEXT (e.g. 1x2x4)")
    args = ap.parse_args()
    use_virtual_cpu_devices(8)
    rows = []
    print("| mesh | remat | GA | extra | compiled MB | planned MB | planned/compiled |")
    print("|---|---|---|---|---|---|---|")
    for case in CASES:
        (r, p, t), remat, accum, extra = case
        row = f"{r}x{p}x{t} {remat} {accum} {' '.join(extra)}"
        if args.only not in row:
            continue
        res = measure(case)
        rows.append(res)
        print(
            f"| {res['mesh']} | {res['remat']} | {res['grad_accum']} | "
            f"{' '.join(res['extra']) or '-'} | {res['compiled_bytes'] / 1e6:.2f} | "
            f"{res['planned_bytes'] / 1e6:.2f} | {res['ratio']:.3f} |",
            flush=True,
        )
    if args.out:
        write_report(rows, args.out)


if __name__ == "__main__":
    main()
