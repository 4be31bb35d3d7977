"""The loop and its record: preflight, the loop, checkpoints, resume, the run directory,
metrics, interrupts, profiles, several processes."""
