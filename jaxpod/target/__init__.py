"""Compiling for the accelerators a user will rent, none attached: `spec` (what `--target`
names), `devices` (compile-only TPU devices, the mesh on their torus), `gpu` (compile-only
NVIDIA GPUs), `buffers` (HBM bytes of XLA's buffer assignment) and `hlo` (collectives and host
transfers of the optimized program)."""
