"""User-facing errors, for every package: each is a ValueError subclass whose message names the bad value and the fix.

They live here, at the bottom of the import graph, so that any module can raise or catch one without importing
the module that usually raises it (the checkpointer catches TrainingDiverged without importing the step loop)."""


class DutycycleError(ValueError):
    """Base class for errors caused by user input (paths, config, data); the CLI prints them on one line."""


class ConfigError(DutycycleError):
    """A bad option or configuration value."""


class SourceError(DutycycleError):
    """A missing, empty or unreadable input location."""


class DecodeError(SourceError):
    """An image file that cannot become a sample or a table row's facts. ``reason`` is the short key that
    summaries and skip counts use (one vocabulary, defined in ``imageinfo``); the message says the rest."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # keep the reason when a worker process ships the error back
        return (DecodeError, (self.reason, str(self)))


class DestinationError(DutycycleError):
    """An output location that cannot be written."""


class CorruptArtifactError(DutycycleError):
    """A committed artifact (table, cache shard, checkpoint) failed its integrity check."""


def _keep_fields(self):
    """``__reduce__`` for an error whose keyword fields are its public attributes: kept when Ray (or any pickler)
    ships the error to the driver, where ``Exception``'s own reduce passes the message alone."""
    fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
    return (_rebuild, (type(self), str(self), fields))


def _rebuild(cls, message, fields):
    return cls(message, **fields)


class NoSpaceError(DestinationError):
    """A write that ran out of room (ENOSPC, or EDQUOT: a quota): names the device, the path and, where known, the
    bytes the write needed. Build one with ``io.no_space(exc, path, needed)``."""

    def __init__(self, message: str, *, device: str = "", path: str = "", needed: int | None = None):
        super().__init__(message)
        self.device, self.path, self.needed = device, path, needed

    __reduce__ = _keep_fields


class TrainingDiverged(DutycycleError):
    """The loss (or the gradient norm) became NaN or infinite at ``step``, whose global batch was ``batch`` of
    ``epoch``; ``sample_ids`` are this rank's samples of it (all ranks' once the checkpointer has gathered them)."""

    def __init__(self, message: str, *, step: int = 0, epoch: int = 0, batch: int = -1, sample_ids=None):
        super().__init__(message)
        self.step, self.epoch, self.batch, self.sample_ids = step, epoch, batch, sample_ids

    __reduce__ = _keep_fields


class FormatError(CorruptArtifactError):
    """An artifact whose ``format`` field is missing or names a version this dutycycle does not read."""


class ParityCheckFailed(DutycycleError):
    """``parallel.check_every``'s check found the gradient a step applied to ``parameter`` farther than ``bound``
    from a plain float64 all-reduce of every rank's gradient (``error``, in one element) at ``step``."""

    def __init__(self, message: str, *, step: int = 0, parameter: str = "", error: float = 0.0, bound: float = 0.0):
        super().__init__(message)
        self.step, self.parameter, self.error, self.bound = step, parameter, error, bound

    __reduce__ = _keep_fields
