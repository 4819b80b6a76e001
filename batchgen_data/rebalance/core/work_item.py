"""One row in the shared work pool (``WorkItem``) and the prompt prefix it shares with others
(``prefix_key``, for cache affinity). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A sequence moves at most this many times: with the cooldown and the empty-slots rule this
# bounds ping-pong, and leaves the late stragglers (the most moved) still movable at the tail.
_MAX_MOVES = 4
# Cache affinity: an item's prefix key is the head of its prompt (characters of a text prompt,
# token ids, the first chat message); each worker remembers the keys of the items it leased
# most recently (``work_pool``), as a stand-in for the prefixes its engine's cache holds.
_PREFIX_KEY_CHARS = 256
_PREFIX_KEY_TOKENS = 64


def prefix_key(prompt: Any) -> Any:
    """What rows sharing a prompt prefix (one instruction template) have in common: the first
    characters of a text prompt, the first token ids, or the first chat message; None otherwise."""
    if isinstance(prompt, str):
        return prompt[:_PREFIX_KEY_CHARS]
    prompt = getattr(prompt, "messages", prompt)  # a ChatPrompt: its messages
    if isinstance(prompt, (list, tuple)) and prompt:
        first = prompt[0]
        if isinstance(first, dict):
            return ("messages", str(first.get("role")), str(first.get("content"))[:_PREFIX_KEY_CHARS])
        if all(isinstance(t, int) for t in prompt[:_PREFIX_KEY_TOKENS]):
            return tuple(prompt[:_PREFIX_KEY_TOKENS])
    return None


@dataclass(slots=True)
class WorkItem:
    item_id: str  # "<batch key>/<row index>"
    batch_key: str
    owner: str
    prompt: Any
    params: dict  # SamplingParams fields, plain data (``SamplingParams.to_dict``: ``max_tokens`` included)
    attempts: int = 0
    state: Any = None  # a started sequence given back mid-generation (MIGRATE), opaque here
    num_generated: int = 0  # tokens the given-back state already holds
    num_moves: int = 0
    not_for: str | None = None  # the worker that gave it back does not lease it again ...
    not_for_until: float = 0.0  # ... for a while (then anyone may: no item waits on a gone worker)
    # The receiver the move rule chose for it: until ``not_for_until`` only it leases it (a busy
    # worker with one slot free must not take a sequence moved off a busy worker to an idle one,
    # nor one receiver all the sequences a plan spread over several).
    meant_for: str | None = None
    prefix: Any = None  # ``prefix_key(prompt)``: cache affinity
    max_tokens: int = 0  # ``params["max_tokens"]``, read at every lease: kept as a field

    def __post_init__(self):
        self.max_tokens = int(self.params["max_tokens"])

    @property
    def movable(self) -> bool:
        return self.num_moves < _MAX_MOVES
