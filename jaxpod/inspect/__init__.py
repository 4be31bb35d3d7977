"""The commands that inspect, never train: `jaxpod compile` (the step lowered and compiled
from abstract shapes, for this machine's devices or a `--target`) and `jaxpod runs` (the
run records under a folder, side by side)."""
