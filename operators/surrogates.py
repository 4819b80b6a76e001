"""Lone surrogates: code points U+D800-U+DFFF, which Python strings may hold but no text can.

JSON may escape half of a UTF-16 pair on its own (``"\\ud83d"``: an emoji cut in two by a
program that counted UTF-16 units), and ``json.loads`` turns it into a Python string holding
that code point. UTF-8, Arrow, Parquet and tokenizers all refuse such a string, so every reader
and stage looks for one first: ``find_lone_surrogate`` says where (for the row's error message),
``replace_lone_surrogates`` repairs a value with U+FFFD.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"


@dataclass(slots=True, frozen=True)
class LoneSurrogate:
    """Where a value holds a lone surrogate: ``path`` inside it (``""`` for the value itself,
    ``"stop[0]"``, ``"[1].content"``) and the code point."""

    path: str
    code_point: int

    def describe(self, name: str = "") -> str:
        """What is wrong where: ``name`` is the value's own name (a field, a column), if any.

        Example:
            >>> print(LoneSurrogate("stop[0]", 0xD83D).describe("sampling_params"))
            'sampling_params.stop[0]' holds a lone surrogate \\ud83d (half of a UTF-16 pair, such as a cut emoji)
        """
        if not name or not self.path:
            where = name + self.path
        else:
            where = f"{name}{self.path}" if self.path.startswith("[") else f"{name}.{self.path}"
        return (f"'{where}' holds a lone surrogate \\u{self.code_point:04x} (half of a UTF-16 "
                "pair, such as a cut emoji)")


def find_lone_surrogate(value: Any, path: str = "") -> LoneSurrogate | None:
    """The first lone surrogate in ``value`` (strings, and the keys and items of dicts, lists
    and tuples, at any depth), or None.

    Example:
        >>> find_lone_surrogate({"stop": ["ok", "\\ud83d"]})
        LoneSurrogate(path='stop[1]', code_point=55357)
    """
    if isinstance(value, str):
        match = LONE_SURROGATE.search(value)
        return None if match is None else LoneSurrogate(path, ord(match.group()))
    if isinstance(value, dict):
        for key, item in value.items():
            key_path = f"{path}.{escape_lone_surrogates(str(key))}" if path else escape_lone_surrogates(str(key))
            found = find_lone_surrogate(key, key_path) or find_lone_surrogate(item, key_path)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = find_lone_surrogate(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def replace_lone_surrogates(value: Any) -> Any:
    """``value`` with U+FFFD in place of each lone surrogate (dicts and lists rebuilt, the rest
    as is)."""
    if isinstance(value, str):
        return LONE_SURROGATE.sub(REPLACEMENT, value)
    if isinstance(value, dict):
        return {replace_lone_surrogates(k): replace_lone_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [replace_lone_surrogates(v) for v in value]
    return value


def escape_lone_surrogates(text: str) -> str:
    """``text`` with each lone surrogate written as its ``\\udXXX`` escape: a message that
    quotes a bad value must itself be text."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
