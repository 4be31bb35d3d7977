"""The ring collectives and the gradient all-reduce options across 2 processes x 4 devices.

JAX's multi-controller runtime on loopback (gloo on CPU), as in tests/cli/test_multihost.py:

* every `ring_all_reduce` variant over a mesh of 8 devices whose first 4 are process 0's and
  last 4 process 1's (so `hosts=2` puts each level where a pod has it: the inner rings
  inside a process, the outer one between them), against numpy sums and `psum`;
* a training run with `parallel.grad_allreduce=ring`, buckets and replicated tensor sharding
  (the ring then runs over the RTS-split data axes) on 2 processes equals the default
  (`psum` per leaf) on 1 process x 8 devices.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, free_port
from helpers.cli import TINY, TINY4, TWO_PROCESSES, cli_env, finish, start_two_processes

from jaxpod.run.metrics import read_metrics

pytestmark = [pytest.mark.cli, pytest.mark.xdist_group(TWO_PROCESSES)]
HERE = Path(__file__).resolve().parent
VARIANTS = {"ring": {}, "bidirectional": {"bidirectional": True}, "hosts=2": {"hosts": 2}}
VARIANTS |= {"hosts=4": {"hosts": 4}}
SHAPES = {"float32": (5, 7), "bfloat16": (3, 4), "float16": (9,)}  # padded: 35, 12, 9 elements


def check_across_processes() -> None:
    """Run in each of the 2 processes (after `jax.distributed.initialize`): assert every
    variant's result on this process's devices; every value is an integer, so all exact."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpod.parallel.collectives import ring_all_reduce

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    assert [d.process_index for d in devices] == [0] * 4 + [1] * 4
    for mesh_shape, names in (((8,), ("x",)), ((2, 4), ("hosts", "local"))):
        mesh = jax.sharding.Mesh(np.array(devices).reshape(mesh_shape), names)
        spec = P(names)
        rng = np.random.default_rng(0)
        inputs = {d: rng.integers(-8, 9, (8, *s)).astype(d) for d, s in SHAPES.items()}
        sharding = NamedSharding(mesh, spec)
        args = {
            d: jax.make_array_from_callback(x.shape, sharding, lambda i, x=x: x[i])
            for d, x in inputs.items()
        }

        def local(xs, axes=names):
            xs = {d: x[0] for d, x in xs.items()}
            reduce = lambda kw: {d: ring_all_reduce(x, axes, **kw)[None] for d, x in xs.items()}
            out = {v: reduce(kw) for v, kw in VARIANTS.items()}
            return out, {d: jax.lax.psum(x, axes)[None] for d, x in xs.items()}

        fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,), out_specs=spec))
        rings, psums = fn(args)
        for d, x in inputs.items():
            want = x.astype(np.float64).sum(0)
            for shard in psums[d].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data, np.float64)[0], want)
            for v in VARIANTS:
                assert len(rings[v][d].addressable_shards) == 4
                for shard in rings[v][d].addressable_shards:
                    got = np.asarray(shard.data, np.float64)[0]
                    np.testing.assert_array_equal(got, want, err_msg=f"{mesh_shape} {v} {d}")
    print(f"process {jax.process_index()}: ok")


WORKER = """
import sys
sys.path[:0] = [{here!r}, {tests!r}]
from jaxpod.platform import use_virtual_cpu_devices
use_virtual_cpu_devices(4)
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize("127.0.0.1:{port}", num_processes=2, process_id={pid})
import test_multihost_collectives as t
t.check_across_processes()
"""


def test_ring_variants_across_two_processes():
    port = free_port()
    code = [WORKER.format(here=str(HERE), tests=str(HERE.parent), port=port, pid=i) for i in (0, 1)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", c],
            cwd=ROOT,
            env=cli_env(JAX_PLATFORMS="cpu"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for c in code
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for i, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, err[-3000:]
        assert f"process {i}: ok" in out


OPTION = ["parallel.grad_allreduce=ring", "parallel.grad_bucket_bytes=65536", "memory.rts=2"]


def test_ring_training_on_two_processes_equals_the_default(tmp_path, one_process_run):
    """Against the one-process run of the tiny 4-step config (`one_process_run`)."""
    procs = start_two_processes(
        "train", TINY, *TINY4, *OPTION, "devices=4", f"train.logdir={tmp_path / 'ring'}"
    )
    finish(procs, timeout=600)
    losses = {
        name: np.array([r["loss"] for r in read_metrics(logdir) if "loss" in r])
        for name, logdir in (("ring", tmp_path / "ring"), ("psum", one_process_run))
    }
    assert len(losses["ring"]) == 4
    # The ring sums in another order than psum (and across processes through gloo): the
    # single-step mesh tolerance of tests/helpers/lab.py (LOSS_RTOL), on four steps.
    np.testing.assert_allclose(losses["ring"], losses["psum"], rtol=1e-6, atol=0)
