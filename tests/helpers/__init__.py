"""Helpers the test modules share: repository paths, tiny configs and their meshes, a free port.

Importable as `helpers` from every test module (`pythonpath = ["tests"]` in pyproject.toml).
jax-free at import: `tests/conftest.py` imports this before jax may start (it sets the virtual
device count first), and the config and data tests stay jax-free.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
TINY_YAML = CONFIGS / "tiny.yaml"


def make_tiny_cfg(*overrides: str, mesh: tuple[int, int, int] | None = None, **kw):
    """A resolved config from `configs/tiny.yaml` plus overrides.

    `overrides` are CLI-style strings (`"optim.name=sgd"`); keyword overrides use `__` for the
    dot (`optim__name="sgd"`, values are YAML-parsed like on the CLI); `mesh=(r, p, t)` sets
    `mesh.*` and `devices = r * p * t`. Keyword/mesh overrides are applied after the strings.
    """
    from jaxpod.config import load_config

    args = list(overrides)
    if mesh is not None:
        r, p, t = mesh
        args += [f"devices={r * p * t}", f"mesh.replica={r}", f"mesh.pipeline={p}"]
        args += [f"mesh.tensor={t}"]
    for key, value in kw.items():
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        args.append(f"{key.replace('__', '.')}={text}")
    return load_config(TINY_YAML, args)


_COMPILED_STEPS: dict = {}


def compiled_step_once(cfg, mesh_for):
    """The train step of `cfg` compiled on `mesh_for(cfg)` from abstract shapes (no weights),
    as `jaxpod.inspect.compile.compile_to_inspect` compiles a program to be read; once per process,
    keyed by the resolved config, so tests that spell the same config otherwise share it."""
    from jaxpod.inspect.compile import abstract_inputs, compile_to_inspect

    if cfg not in _COMPILED_STEPS:
        engine, state, batch = abstract_inputs(cfg, mesh_for(cfg))
        _COMPILED_STEPS[cfg] = compile_to_inspect(engine.train_step.lower(state, batch))
    return _COMPILED_STEPS[cfg]


# The planner tests' small GPT (tests/planner/): one spelling, so that their configs are the
# same programs across files, and one xdist group for the files that compile the same ones
# (test_plan_vs_xla, test_xla_copies, test_transfers): one process compiles each once.
SMALL_GPT = ("model.d_model=128", "model.d_ff=512", "model.seq_len=128", "model.layers=4")
PLANNER_GPT = "shared:planner-small-gpt"


# The tiny EfficientNet the engine tests train (float32, LARS, 16 images a step, mesh per test):
# the B0 recipe at a quarter width, its first three block groups on two stages (stem, 1a, 2a | 3a,
# head), every kind of block the network has (expansion 1 and 6, kernels 3 and 5, strides 1 and 2,
# a residual) in less than half the compile of all seven groups. tests/engine/test_pinned.py pins
# its first steps, test_packed_engine.py checks them against a plain reference on the same meshes
# (the same programs); `model.pipeline_splits=[]` puts it on one stage.
TINY_VISION = (
    "model.name=efficientnet",
    "data.name=digits",
    "model.width_mult=0.25",
    "model.depth_mult=0.2",
    "model.block_groups=3",
    "model.pipeline_splits=[3a]",
    "model.image_size=32",
    "model.num_classes=10",
    "model.remat=none",
    "train.micro_batch=2",
    "train.global_batch=16",
    "train.grad_accum=null",
    "optim.name=lars",
    "optim.lr=0.5",
    "optim.weight_decay=1e-4",
    "optim.warmup_steps=0",
    "optim.lr_schedule=constant",
)

# The tiny GPT of the pinned cases (tests/engine/test_pinned.py): 16 sequences a step.
GPT16 = ("train.global_batch=16", "train.grad_accum=null", "optim.warmup_steps=0")

# The pinned cases' 16-bit recipe: float16 weights and master weights (stochastic rounding),
# float16 compute, a dynamic loss scale, LARS.
FP16_LARS = (
    "precision.params=float16",
    "precision.compute=float16",
    "precision.master=same-as-params",
    "precision.loss_scale=dynamic",
    "optim.name=lars",
    "optim.lr=0.1",
)

# One xdist group for test_pinned's transformer cases and the tests elsewhere that compile one
# of their programs (spelled as test_pinned spells it): one process, one compile each.
PINNED_TRANSFORMERS = "shared:pinned-transformers"

# One xdist group (tests/conftest.py) for the tests that compile the tiny EfficientNet's and
# the digits config's train steps: one process compiles each program once and the session's
# compilation cache serves the repeats (an EfficientNet compile is ~10-30 s on 2 cores).
TINY_EFFICIENTNET = "shared:tiny-efficientnet"


def grouped_cases(names, other: str | None = None) -> list:
    """`pytest.param`s of the case `names`: the EfficientNet ones (`effnet...`) in the
    `TINY_EFFICIENTNET` xdist group, the others in `other` (None: their module's group)."""
    import pytest

    def marks(name: str) -> list:
        group = TINY_EFFICIENTNET if name.startswith("effnet") else other
        return [pytest.mark.xdist_group(group)] if group else []

    return [pytest.param(name, marks=marks(name)) for name in names]


# The digits run's length (tests/run/test_digits_training.py): the packed engine's overflow
# test compiles the same train step (the loss scale is state, not program), so the session's
# compilation cache serves whichever of the two compiles second.
DIGITS_STEPS = "train.steps=50"


def digits_cfg(*overrides: str):
    """`configs/efficientnet_digits.yaml`: FP16 weights and FP16 master weights with stochastic
    rounding, dynamic loss scaling, LARS, G16, 2 stages x 4 replicas (one compile, shared)."""
    from jaxpod.config import load_config

    return load_config(CONFIGS / "efficientnet_digits.yaml", list(overrides))


def model_params_and_specs(cfg):
    """The transformer of `cfg` as `(params ShapeDtypeStructs, PartitionSpecs)`: no weights,
    no mesh (the model's own logical layout)."""
    from flax import nnx

    from jaxpod.models.family import build_model
    from jaxpod.parallel.mesh import param_specs

    state = nnx.state(nnx.eval_shape(lambda: build_model(cfg.model, cfg.train.seed)))
    return nnx.to_pure_dict(state), param_specs(state)


def mesh_for(cfg):
    """The (replica, pipeline, tensor) `Mesh` of `cfg` on the first `cfg.devices` devices."""
    import jax
    import pytest

    from jaxpod.parallel.mesh import make_mesh

    n = cfg.mesh.replica * cfg.mesh.pipeline * cfg.mesh.tensor
    devices = jax.devices()
    if len(devices) < n:
        pytest.fail(
            f"need {n} devices, jax has {len(devices)}: was jax initialised before conftest set "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}?"
        )
    return make_mesh(cfg.mesh, devices[:n])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
