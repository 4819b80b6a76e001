"""Params that hold valid values at every moment: checked when built, and again on every
assignment, so a request is checked once where it is made and never again downstream.

``SamplingParams`` and ``PoolingParams`` are mutable, as vLLM's are (``params.max_tokens = 64``
works). A field set after construction is checked at once: an invalid value raises
``ConfigError`` there and leaves the params as they were, as pydantic's ``validate_assignment``
does. So the engine's input processor can trust any params object it is given without calling
``verify`` again (a pooled row's params are verified once, when the row layer builds them).
"""

from __future__ import annotations


class ValidatedOnAssignment:
    """Mixin for a slotted dataclass with a ``verify()`` method and a ``_checked: bool`` field
    (default False, set True at the end of ``__post_init__``).

    Fields whose names start with ``_`` are derived state (``verify`` and the engine set them)
    and are not checked. Copies and pickles restore fields as they were, unchecked: what was
    valid when copied is still valid.
    """

    __slots__ = ()

    def __setattr__(self, name: str, value) -> None:
        if name[0] == "_" or not getattr(self, "_checked", False):  # building, or derived state
            object.__setattr__(self, name, value)
            return
        old = getattr(self, name)  # an unknown name raises AttributeError here (slots)
        object.__setattr__(self, "_checked", False)  # verify's own normalizing writes go straight in
        object.__setattr__(self, name, value)
        try:
            self.verify()
        except BaseException:
            object.__setattr__(self, name, old)
            self.verify()  # the derived fields of the old value again
            raise
        finally:
            object.__setattr__(self, "_checked", True)

    def __setstate__(self, state) -> None:
        """``copy.copy`` / ``pickle``: restore every field as it was, without checking."""
        values, slots = state if isinstance(state, tuple) else (state, None)
        for part in (values, slots):
            for key, value in (part or {}).items():
                object.__setattr__(self, key, value)
