"""The temporaries XLA:TPU keeps in VMEM instead of HBM. Jax-free.

On v5e and v6e XLA:TPU's memory-space assignment fills the chip's VMEM (capacity 128 MiB,
less the scoped VMEM its kernels keep: a heap of 112 MiB on v5e and 96 MiB on v6e,
`DeviceProfile.vmem_heap`) with temporaries of the step, whole gradient stacks, converted
matrices and a layer's working set among them; on v5p and v4 its programs keep their
temporaries in HBM (VMEM holds the kernels' scratch only). So at the HBM peak part of the
temporaries is not in HBM. Which ones is the assignment's choice, not a rule of the step:
on the probes of docs/memory.md ("VMEM") the HBM temporaries fell, against the same step on
v5p, by 0.50 to 0.90 of the heap where they exceeded it. The planner credits the least of
those, half the heap, and never more than the temporaries (`held_in_vmem`);
tests/target/test_vmem_tpu.py finds at least that much moved in compiled programs.
"""

from __future__ import annotations

from jaxpod.planner.profiles import DeviceProfile

# the least share of the VMEM heap by which the HBM temporaries fell on the probes
HEAP_SHARE = 0.5


def held_in_vmem(profile: DeviceProfile, temporaries: float) -> int:
    """Bytes of `temporaries` (the device total less the arguments) the planner counts in
    VMEM, not HBM, at the peak: half the profile's VMEM heap, at most the temporaries."""
    return int(max(0.0, min(temporaries, HEAP_SHARE * profile.vmem_heap)))
