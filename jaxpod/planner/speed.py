"""How fast a device computes and moves bytes: the step-time model's hardware. Jax-free.

Per device: dense peak FLOP/s by dtype, HBM bandwidth, and two link levels: the *fast*
domain (NVLink/NVSwitch inside a GPU node, ICI inside a TPU slice, IPU-Links inside a pod)
of `fast_group` devices, and the *slow* network between domains (InfiniBand/RoCE between
nodes, DCN between TPU slices), each as the bytes per second one device sends in one
direction. `compute_efficiency` is the one fitted figure: the fraction of peak that large
matmuls reach, fitted on the training rows of the published set (`benchmarks/
bench_step_time.py --fit`; the held-out rows, `benchmarks/published_heldout.yaml`, never).
"""

from __future__ import annotations

from dataclasses import dataclass, field

T = 10**12
G = 10**9


@dataclass(frozen=True)
class Speed:
    """One device's speeds (see the module docstring); `flops` maps a dtype to FLOP/s."""

    name: str
    flops: dict = field(default_factory=dict)
    hbm_bandwidth: float = 0.0  # bytes/s
    fast_link: float = 0.0  # bytes/s one device sends inside its fast domain
    fast_group: int = 1  # devices in one fast domain (a node, a slice)
    slow_link: float = 0.0  # bytes/s one device sends across domains
    link_latency: float = 5e-6  # seconds per collective step
    compute_efficiency: float = 0.5  # achievable fraction of peak on large matmuls (fitted)


def _dtypes(bf16: float, fp32: float) -> dict:
    return {"bfloat16": bf16, "float16": bf16, "float32": fp32}


SPEEDS: dict[str, Speed] = {
    s.name: s
    for s in (
        # NVIDIA A100 datasheet: 312 TFLOP/s dense BF16/FP16, 19.5 FP32; HBM2 1,555 GB/s
        # (40 GB), 2,039 GB/s (80 GB SXM); NVLink 3: 600 GB/s per GPU both ways; DGX A100:
        # 8 GPUs, 8 x 200 Gb/s HDR InfiniBand (25 GB/s per GPU).
        Speed(
            "a100-40gb",
            _dtypes(312 * T, 19.5 * T),
            1555 * G,
            300 * G,
            8,
            25 * G,
            compute_efficiency=0.62,
        ),
        Speed(
            "a100-80gb",
            _dtypes(312 * T, 19.5 * T),
            2039 * G,
            300 * G,
            8,
            25 * G,
            compute_efficiency=0.72,
        ),
        # NVIDIA V100 SXM2 datasheet: 125 TFLOP/s FP16 tensor cores, 15.7 FP32; HBM2 900 GB/s;
        # DGX-2: 16 GPUs on NVSwitch, 300 GB/s NVLink 2 per GPU both ways.
        Speed(
            "v100-32gb",
            _dtypes(125 * T, 15.7 * T),
            900 * G,
            150 * G,
            16,
            12.5 * G,
            compute_efficiency=0.61,
        ),
        # NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16, 67 FP32; HBM3 3.35 TB/s; NVLink 4:
        # 900 GB/s per GPU both ways; DGX H100: 8 GPUs, 8 x 400 Gb/s NDR (50 GB/s per GPU).
        Speed(
            "h100-80gb",
            _dtypes(989 * T, 67 * T),
            3350 * G,
            450 * G,
            8,
            50 * G,
            compute_efficiency=0.6,
        ),
        # Google Cloud TPU system architecture pages: per chip BF16 peak, HBM bandwidth, ICI
        # bandwidth per chip (v4 2,400 Gb/s; v5e 1,600; v5p 4,800; v6e 3,584) over its links;
        # DCN between slices a nominal 100 Gb/s per 4-chip (v4, v5p) or 200 Gb/s per 8-chip
        # (v5e, v6e) host.
        Speed(
            "tpu-v4",
            _dtypes(275 * T, 275 * T / 4),
            1200 * G,
            300 * G / 2,
            4096,
            3.1 * G,
            compute_efficiency=0.77,
        ),
        Speed(
            "tpu-v5e",
            _dtypes(197 * T, 197 * T / 4),
            819 * G,
            200 * G / 2,
            256,
            3.1 * G,
            compute_efficiency=0.86,
        ),
        Speed("tpu-v5p", _dtypes(459 * T, 459 * T / 4), 2765 * G, 600 * G / 2, 8960, 3.1 * G),
        Speed("tpu-v6e", _dtypes(918 * T, 918 * T / 4), 1640 * G, 448 * G / 2, 256, 3.1 * G),
        # Graphcore GC200 datasheet: 250 TFLOP/s FP16 (AI-Float), 62.5 FP32; 47.5 TB/s SRAM;
        # IPU-Links 320 GB/s per IPU; M2000 of 4 IPUs, 2 x 100 GbE IPU-Fabric per M2000.
        Speed("ipu-gc200", _dtypes(250 * T, 62.5 * T), 47.5 * T, 160 * G, 4, 6.25 * G),
        # a virtual CPU device: nominal figures, so that a plan for `cpu` can be estimated
        Speed("cpu", _dtypes(1 * T, 1 * T), 50 * G, 10 * G, 256, 10 * G),
    )
}


def get_speed(name: str) -> Speed:
    """The speeds of device profile `name`; KeyError names the choices."""
    try:
        return SPEEDS[name]
    except KeyError:
        raise KeyError(f"no speeds for {name!r}; choose from {', '.join(SPEEDS)}") from None
