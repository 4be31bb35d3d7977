"""Running a config: data, the loop, the run record, checkpoints, profiles, AOT compile."""
