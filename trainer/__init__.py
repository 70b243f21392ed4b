"""dutycycle.trainer: the step loop, launch on Ray Train, sharding, checkpoints, metrics and the CLI."""
