"""User-facing errors. Every one is a ValueError subclass whose message names the bad value and the fix."""


class DutycycleError(ValueError):
    """Base class for errors caused by user input (paths, config, data); the CLI prints them on one line."""


class ConfigError(DutycycleError):
    """A bad option or configuration value."""


class SourceError(DutycycleError):
    """A missing, empty or unreadable input location."""


class DestinationError(DutycycleError):
    """An output location that cannot be written."""


class CorruptArtifactError(DutycycleError):
    """A committed artifact (table, cache shard, checkpoint) failed its integrity check."""
