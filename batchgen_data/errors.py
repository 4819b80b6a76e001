"""Error types. One base class; each subclass also inherits the matching built-in. And the
one-line form of a message, which is what an error row holds."""


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


# Where a library's message turns into a dump that does not belong in an error row: a Rust panic's
# backtrace, llguidance's parser state and grammar, a Python traceback.
_DUMP_MARKERS = ("stack backtrace:", "<backtrace>", "<state>", "<grammar>", "Traceback (most recent call last)")
# Most characters of an error row's message (a message may quote the bad value).
MAX_ERROR_CHARS = 2000


def one_line(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``message`` as an error row holds it: cut where a backtrace or state dump starts (a message
    that is all dump keeps its last line), its lines joined by spaces, at most ``limit`` characters.

    Example:
        >>> one_line("panic: too many symbols\\nstack backtrace:\\n   0: <unknown>")
        'panic: too many symbols'
    """
    head = message
    for marker in _DUMP_MARKERS:
        at = head.find(marker)
        if at >= 0:
            head = head[:at]
    if not head.strip():  # the message is the dump (a Python traceback): its last line says what failed
        head = next((line for line in reversed(message.splitlines()) if line.strip()), "")
    text = " ".join(line.strip() for line in head.splitlines() if line.strip()) or "(an error without a message)"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_text(err: BaseException) -> str:
    """An exception as an error row holds it: ``TypeName: message`` on one line (Ray Data LLM's
    ``f"{type(e).__name__}: {e}"``, so errors group by their first word).

    Example:
        >>> error_text(RequestError("prompt has 132 tokens; the context limit is 128"))
        'RequestError: prompt has 132 tokens; the context limit is 128'
    """
    return f"{type(err).__name__}: {one_line(str(err))}"
