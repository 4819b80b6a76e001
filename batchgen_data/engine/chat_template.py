"""Chat templates rendered with a per-row budget of time and size. No torch.

A chat template is code (from the checkpoint or from the user) run once per ``messages`` row: one
row's template must not hang the job or fill the machine's memory. ``render_chat_template``
renders as transformers' ``apply_chat_template`` does (the same sandbox settings, filters and
globals; the variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the
special tokens and the caller's kwargs), in the bounded sandbox of ``chat_sandbox.py``: a row
whose template runs past ``ChatTemplateLimits.time_limit_s`` or builds more than ``max_chars``
characters fails with a one-line ``RequestError`` naming the limit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchgen_data.engine.chat_sandbox import RenderBudget, compile_template, within
from batchgen_data.errors import ConfigError

# A row's chat template must render within this many seconds (and never hang the job).
CHAT_TEMPLATE_TIME_LIMIT_S = 5.0
# Most characters a row's rendered chat (or any text built while rendering it) may hold: ~4 M
# tokens, beyond the context of any model the engine serves.
MAX_RENDERED_CHARS = 16_000_000
# The names a message's reasoning goes by (templates read ``reasoning_content``; gpt-oss's reads
# ``thinking``), in transformers' order.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


@dataclass(slots=True, frozen=True)
class ChatTemplateLimits:
    """Per-row bounds on rendering a chat template.

    Args:
        time_limit_s (float, default 5.0): seconds one row's rendering may take.
        max_chars (int, default 16,000,000): characters the rendered chat (or any text built
            while rendering it) may hold.

    Example:
        >>> ChatTemplateLimits(time_limit_s=1.0).max_chars
        16000000
    """

    time_limit_s: float = CHAT_TEMPLATE_TIME_LIMIT_S
    max_chars: int = MAX_RENDERED_CHARS

    def __post_init__(self) -> None:
        limit = self.time_limit_s
        is_number = isinstance(limit, (int, float)) and not isinstance(limit, bool)
        if not is_number or not math.isfinite(limit) or limit <= 0:
            raise ConfigError(f"time_limit_s must be a finite number of seconds > 0, got {limit!r}")
        if isinstance(self.max_chars, bool) or not isinstance(self.max_chars, int) or self.max_chars < 1:
            raise ConfigError(f"max_chars must be an int >= 1, got {self.max_chars!r}")


def render_chat_template(source: str, messages: list[dict], variables: dict[str, Any],
                         limits: ChatTemplateLimits = ChatTemplateLimits()) -> str:
    """The chat ``messages`` rendered with the template ``source`` and the template
    ``variables`` (special tokens, ``add_generation_prompt``, the caller's kwargs; they may set
    ``tools`` and ``documents``, which are None otherwise).

    Raises ``RequestError`` naming the limit when a ``limits`` bound trips; a template's own
    errors (``raise_exception``, undefined names) raise as Jinja raises them.

    Example:
        >>> render_chat_template("{{ messages[0]['content'] }}!", [{"role": "user", "content": "hi"}], {})
        'hi!'
    """
    context = {"tools": None, "documents": None, **_plain(variables), "messages": _template_messages(messages)}
    budget = RenderBudget(time.monotonic() + limits.time_limit_s, limits.time_limit_s, limits.max_chars)
    with within(budget):
        template = compile_template(source)
        pieces, num_chars = [], 0
        for piece in template.generate(context):
            num_chars += len(piece)
            budget.check_size(num_chars)
            budget.check_time()
            pieces.append(piece)
    return "".join(pieces)


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: keys holding None dropped (templates
    test for a key, not for None), and the reasoning under each of its names."""
    out = []
    for message in _plain(messages):
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value: Any) -> Any:
    """Template data as plain JSON-like values: any other object (a numpy array has methods a
    template could call, ``tofile`` among them) becomes a placeholder naming its type, as
    transformers does."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, str):  # subclasses (enums...) back to the base type
        return str.__str__(value)
    if isinstance(value, (int, float)):
        return int(value) if isinstance(value, int) else float(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"
