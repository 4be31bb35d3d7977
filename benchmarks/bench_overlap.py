"""Which of jaxpod's collectives XLA:TPU overlaps with compute, per kind, in compiled GPT steps.

    python benchmarks/bench_overlap.py [--only TEXT]

Each probe is the tiny preset at a wider shape (two layers, sequence 512, so compiles stay
small; the last, MaxText 128B's layer at a quarter of its width) compiled for a TPU v5e
slice with no TPU attached (libtpu with its default flags; set LIBTPU_INIT_ARGS to try
others), read by `jaxpod.target.overlap.collective_overlap`: per collective kind, how many
are asynchronous with matmuls between start and done, their share of the kind's bytes per
step, and how many matmuls lie between. Evidence for the step-time model's overlap credit
(docs/estimate.md, "What XLA:TPU overlaps").
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxpod.config import load_config
from jaxpod.target.overlap import collective_overlap

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"

SHAPE = ("model.layers=2", "model.seq_len=512", "train.grad_accum=1")
PROBES = {  # name: (target, (replica, pipeline, tensor), overrides)
    "t4 d1024": ("tpu-v5e:2x4", (2, 1, 4), ("model.d_model=1024", "model.heads=8")),
    "t8 d2048": ("tpu-v5e:2x4", (1, 1, 8), ("model.d_model=2048", "model.heads=16")),
    "t2 d4096": ("tpu-v5e:2x4", (4, 1, 2), ("model.d_model=4096", "model.heads=16")),
    "t4 d1024 SP": (
        "tpu-v5e:2x4",
        (2, 1, 4),
        ("model.d_model=1024", "model.heads=8", "model.sequence_parallel=true"),
    ),
    "t2 d2048 RTS 4": (
        "tpu-v5e:2x4",
        (4, 1, 2),
        ("model.d_model=2048", "model.heads=8", "memory.rts=4"),
    ),
    "t16 d2560, MaxText 128B's layer": (
        "tpu-v5e:4x4",
        (1, 1, 16),
        ("model.d_model=2560", "model.heads=16", "model.d_ff=16384", "model.vocab=32768")
        + ("model.mlp=swiglu", "model.positions=rope", "model.remat=full"),
    ),
}


def compile_probe(target: str, mesh: tuple[int, int, int], overrides: tuple) -> list[dict]:
    """The collectives of one probe's compiled train step (`collective_overlap`)."""
    from jaxpod.inspect.compile import abstract_inputs
    from jaxpod.target.devices import target_devices, torus_mesh
    from jaxpod.target.spec import parse_target

    width = next(int(o.split("=")[1]) for o in overrides if o.startswith("model.d_model"))
    r, p, t = mesh
    layout = [f"devices={r * p * t}", f"mesh.replica={r}", f"mesh.pipeline={p}", f"mesh.tensor={t}"]
    cfg = load_config(TINY, [*SHAPE, f"model.d_ff={4 * width}", *overrides, *layout])
    devices = target_devices(parse_target(target))
    engine, state, batch = abstract_inputs(cfg, torus_mesh(mesh, devices))
    lowered = engine.train_step.lower(*engine.updating_arguments(state, batch))
    return collective_overlap(lowered.compile().as_text())


def summary(found: list[dict]) -> list[str]:
    """Per kind: overlapped / all, the overlapped share of bytes per step, matmuls between."""
    lines = []
    for kind in sorted({c["kind"] for c in found}):
        of_kind = [c for c in found if c["kind"] == kind]
        hidden = [c for c in of_kind if c["asynchronous"] and c["matmuls"]]
        total = sum(c["bytes"] * c["runs"] for c in of_kind)
        share = sum(c["bytes"] * c["runs"] for c in hidden) / total if total else 0.0
        between = sorted({c["matmuls"] for c in hidden}) or "-"
        lines.append(f"{kind}: {len(hidden)}/{len(of_kind)}, {share:.0%} of bytes, {between}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="probes whose name holds this text")
    args = parser.parse_args()
    print("| probe | kind: overlapped / all, share of bytes, matmuls between |\n|---|---|")
    for name, (target, mesh, overrides) in PROBES.items():
        if args.only in name:
            found = compile_probe(target, mesh, overrides)
            print(f"| {name} ({target}) | {'; '.join(summary(found))} |", flush=True)


if __name__ == "__main__":
    main()
