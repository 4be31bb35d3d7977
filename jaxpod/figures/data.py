"""The slow inputs of the figures, computed once and committed under `docs/figures/data/`.

    python -m jaxpod.figures --refresh compiled,compiled-tpu,meshes,digits   # up to an hour

- `compiled.json`: `jaxpod compile PRESET --json` of each full-size preset (XLA:CPU's
  per-device arguments, temporaries and device total), one subprocess per preset, with a
  digest of the preset it compiled (a changed preset's bar is left out until refreshed).
- `compiled_tpu.json`: `jaxpod compile PRESET --target SLICE --json` of each TPU preset
  (XLA:TPU's HBM bytes per chip, libtpu with no TPU attached), digested the same way.
- `demo_meshes.json`: `jaxpod train configs/demo.yaml` for `MESH_STEPS` steps on each mesh
  of `MESHES` (the same global batch of 32 sequences everywhere), its `metrics.jsonl` kept.
- `digits_1device.json`: `jaxpod train configs/efficientnet_digits.yaml` on one device (same
  micro-batch and global batch); the 8-device run is `docs/results/`.

Each file records the command, the date, the commit (and whether jaxpod/ or configs/ had
uncommitted changes), the jax version and the CPU count beside the numbers. Runs execute
through the CLI, exactly as a user would type them.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "figures" / "data"
RESULTS = ROOT / "docs" / "results"

PRESETS = [  # the full-size pod presets, in the order the bar chart shows them
    "bert_large_pod16",
    "bert_large_pod16_pipeline8",
    "gpt3_175b_pod256",
    "efficientnet_b4_g16_pod16",
    "efficientnet_b4_g16_pod64",
    "efficientnet_b4_g16_pod128",
    "efficientnet_b4_g16_pod256",
]
# (replica, pipeline, tensor) -> (micro_batch, grad_accum): always 32 sequences a step
MESHES = {(1, 1, 1): (4, 8), (8, 1, 1): (4, 1), (2, 2, 2): (4, 4), (1, 2, 4): (4, 8)}
MESH_STEPS = 100
DIGITS_1DEVICE = [
    "devices=1",
    "mesh.replica=1",
    "mesh.pipeline=1",
    "model.pipeline_splits=[]",
    "train.grad_accum=8",
]


def mesh_name(mesh: tuple[int, int, int]) -> str:
    return "x".join(map(str, mesh))


def _jaxpod(*args: str) -> str:
    cmd = [sys.executable, "-m", "jaxpod.cli", *args]
    print("$ jaxpod", " ".join(args), file=sys.stderr, flush=True)
    return subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _provenance(command: str) -> dict:
    import jax  # the version only; the subprocesses start their own jax

    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", "jaxpod", "configs"))
    commit = _git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if dirty else "")
    return {
        "command": command,
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "jax": jax.__version__,
        "cpus": os.cpu_count(),
    }


def preset_digest(name: str) -> str:
    """A digest of a preset's YAML content but its comments and its `data` section (where the
    examples come from: the step's shapes are the model's and the batch's): a compile is
    only shown beside the planner while the preset is the one that was compiled."""
    import yaml

    content = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    content.pop("data", None)
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def _write(name: str, data: dict) -> Path:
    DATA.mkdir(parents=True, exist_ok=True)
    path = DATA / name
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    return path


def refresh_compiled() -> Path:
    """XLA:CPU's compiled bytes per device of every preset in `PRESETS`."""
    keep = ("argument_bytes", "temp_bytes", "device_total_bytes", "compile_s")
    out = _provenance("jaxpod compile configs/PRESET.yaml --json")
    for name in PRESETS:  # written preset by preset: a long refresh keeps what it has
        result = json.loads(_jaxpod("compile", f"configs/{name}.yaml", "--json"))
        out[name] = {"preset_digest": preset_digest(name), **{k: result[k] for k in keep}}
        path = _write("compiled.json", out)
    return path


def refresh_compiled_tpu() -> Path:
    """XLA:TPU's compiled bytes per chip of every TPU preset on its slice (`TPU_SLICES`)."""
    from jaxpod.config.presets import TPU_SLICES

    keep = ("device_argument_bytes", "device_temp_bytes", "device_total_bytes", "compile_s")
    keep += ("host_argument_bytes", "host_temp_bytes")
    out = _provenance("jaxpod compile configs/PRESET.yaml --target SLICE --json")
    for name, target in TPU_SLICES.items():
        result = json.loads(
            _jaxpod("compile", f"configs/{name}.yaml", "--target", target, "--json")
        )
        entry = {"target": target, "preset_digest": preset_digest(name)}
        out[name] = {**entry, **{k: result[k] for k in keep}}
        path = _write("compiled_tpu.json", out)
    return path


def _train(config: str, overrides: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="jaxpod-figures-") as logdir:
        _jaxpod("train", config, *overrides, f"train.logdir={logdir}")
        lines = (Path(logdir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _curve(records: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """The records reduced to `step` and `keys` (the figures' inputs, nothing else)."""
    return [
        {"step": r["step"], **{k: r[k] for k in keys if k in r}}
        for r in records
        if any(k in r for k in keys)
    ]


def mesh_overrides(mesh: tuple[int, int, int]) -> list[str]:
    (r, p, t), (mb, ga) = mesh, MESHES[mesh]
    return [
        f"devices={r * p * t}",
        f"mesh.replica={r}",
        f"mesh.pipeline={p}",
        f"mesh.tensor={t}",
        f"train.micro_batch={mb}",
        f"train.grad_accum={ga}",
        f"train.steps={MESH_STEPS}",
        "train.log_every=5",
        "train.eval_every=25",
    ]


def refresh_meshes() -> Path:
    """The demo's loss and validation loss on every mesh of `MESHES`."""
    runs = {}
    for mesh in MESHES:
        records = _train("configs/demo.yaml", mesh_overrides(mesh))
        runs[mesh_name(mesh)] = _curve(records, ("loss", "val_loss"))
    command = "jaxpod train configs/demo.yaml " + " ".join(mesh_overrides((2, 2, 2)))
    command += "  (2x2x2 shown; each mesh with its own sizes: MESHES, jaxpod/figures/data.py)"
    return _write("demo_meshes.json", {**_provenance(command), "runs": runs})


def refresh_digits() -> Path:
    """The digits run on one device (the 8-device record is in `docs/results/`)."""
    records = _train("configs/efficientnet_digits.yaml", DIGITS_1DEVICE)
    keys = ("loss", "accuracy", "val_loss", "val_accuracy")
    command = "jaxpod train configs/efficientnet_digits.yaml " + " ".join(DIGITS_1DEVICE)
    return _write("digits_1device.json", {**_provenance(command), "records": _curve(records, keys)})


REFRESH = {
    "compiled": refresh_compiled,
    "compiled-tpu": refresh_compiled_tpu,
    "meshes": refresh_meshes,
    "digits": refresh_digits,
}


def load(name: str) -> dict | None:
    """A committed data file of `docs/figures/data/`, or None if it is not there."""
    path = DATA / name
    return json.loads(path.read_text()) if path.exists() else None


def digits_8devices() -> list[dict]:
    """The committed 8-device digits run (`docs/results/efficientnet_digits_metrics.jsonl`)."""
    lines = (RESULTS / "efficientnet_digits_metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
