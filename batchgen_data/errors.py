"""Error types. One base class; each subclass also inherits the matching built-in."""


class BatchGenError(Exception):
    """Base class of every error raised by batchgen-data."""


class ConfigError(BatchGenError, ValueError):
    """A configuration value is invalid; the message names the value and the valid range."""


class CheckpointError(BatchGenError, ValueError):
    """A model checkpoint folder is missing files or holds tensors of unexpected shape."""


class UnsupportedModelError(CheckpointError, NotImplementedError):
    """The checkpoint's architecture or one of its options is not implemented (the message names
    the field and the supported values)."""


class RequestError(BatchGenError, ValueError):
    """One request is invalid (empty prompt, bad token ids, prompt longer than the context...)."""


class EngineDeadError(BatchGenError, RuntimeError):
    """The engine failed (its thread or a rank process died); it cannot serve further requests."""
