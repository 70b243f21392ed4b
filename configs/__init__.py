"""Example training configs, installed with the package so that ``dutycycle train configs/demo.toml`` and the
demo work from any directory (``dutycycle.trainer.config.load_config`` falls back to these when the named file
is not on disk)."""
