"""`DeviceProfile.vmem_heap` found in XLA:TPU's compiled steps (libtpu, no TPU attached): the
base GPT at d 512 (remat full, 4x1x1), the same step compiled for a v5p, a v5e and a v6e
slice of four chips. On v5e and v6e the memory-space assignment fills VMEM, up to the
profile's heap, with temporaries of the step, and the HBM temporaries fall, against v5p's
(whose VMEM holds its kernels' scratch only), by at least what the planner credits
(`jaxpod.planner.vmem.held_in_vmem`) and at most the heap; the arguments are the same bytes.
"""

from __future__ import annotations

import pytest
from helpers import make_tiny_cfg
from helpers.dumps import tpu_mesh

from jaxpod.planner.backend import backend_plan
from jaxpod.planner.profiles import get_profile
from jaxpod.planner.vmem import held_in_vmem
from jaxpod.target.buffers import compile_with_spaces, device_memory_bytes

pytestmark = pytest.mark.slow

MESH = (4, 1, 1)
PROBE = ("model.d_model=512", "model.heads=8", "model.d_ff=2048", "model.seq_len=256")
PROBE += ("model.vocab=8192", "train.grad_accum=2", "model.remat=full")
TARGETS = {"tpu-v5p": "tpu-v5p:2x2x1", "tpu-v5e": "tpu-v5e:2x2", "tpu-v6e": "tpu-v6e:2x2"}


@pytest.fixture(scope="module")
def programs() -> dict:
    """Per profile: `(arguments, HBM temporaries, VMEM bytes, planned device total)` of the
    probe's step compiled for that profile's slice."""
    from jaxpod.inspect.compile import abstract_inputs

    cfg, out = make_tiny_cfg(*PROBE, mesh=MESH), {}
    for profile, target in TARGETS.items():
        engine, state, batch = abstract_inputs(cfg, tpu_mesh(MESH, target))
        lowered = engine.train_step.lower(*engine.updating_arguments(state, batch))
        compiled, spaces = compile_with_spaces(lowered, {})
        arguments = compiled.memory_analysis().argument_size_in_bytes
        hbm = device_memory_bytes(spaces)
        planned = backend_plan(cfg, profile)["device_total"]
        out[profile] = (arguments, hbm - arguments, spaces.get("vmem", 0), planned)
    return out


def test_v5p_keeps_its_temporaries_in_hbm(programs):
    """v5p's profile has no heap: its VMEM is the kernels' scratch, below the chip's 64 MiB,
    and the planner (which credits nothing there) is within 10 % of XLA's HBM total."""
    arguments, temps, vmem, planned = programs["tpu-v5p"]
    assert get_profile("tpu-v5p").vmem_heap == 0
    assert 0 < vmem < 64 * 2**20
    assert 0.9 < planned / (arguments + temps) < 1.1


@pytest.mark.parametrize("name", ["tpu-v5e", "tpu-v6e"])
def test_v5e_and_v6e_move_temporaries_into_vmem(programs, name):
    """VMEM holds up to the heap, more than v5p's scratch; the HBM temporaries fall against
    v5p's by at least the planner's credit and at most the heap; the planned total is
    within 10 % of XLA's."""
    profile = get_profile(name)
    arguments, temps, vmem, planned = programs[name]
    v5p_arguments, v5p_temps, v5p_vmem, _ = programs["tpu-v5p"]
    assert arguments == v5p_arguments
    assert v5p_vmem < vmem <= profile.vmem_heap
    fall = v5p_temps - temps
    assert held_in_vmem(profile, v5p_temps) <= fall <= profile.vmem_heap, (fall, temps)
    assert 0.9 < planned / (arguments + temps) < 1.1
