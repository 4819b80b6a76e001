"""The host pool for the KV of suspended sequences, under ``EngineConfig.swap_space_bytes``. No torch.

A sequence suspended with its KV kept (swap), or imported with KV it will restore, holds its
tokens' bytes here until it resumes, moves on or finishes; one that does not fit is recomputed
instead. Every reservation is checked against the budget (an imported sequence's too).
"""

from __future__ import annotations


class HostKVPool:
    """``capacity_bytes`` of host memory, ``bytes_per_token`` per token of KV."""

    def __init__(self, capacity_bytes: int, bytes_per_token: int):
        self.capacity_bytes = capacity_bytes
        self.bytes_per_token = bytes_per_token
        self.used_bytes = 0

    def reserve(self, num_tokens: int) -> bool:
        """Hold ``num_tokens`` tokens of KV if they fit; False (nothing held) if not."""
        kv_bytes = num_tokens * self.bytes_per_token
        if self.used_bytes + kv_bytes > self.capacity_bytes:
            return False
        self.used_bytes += kv_bytes
        return True

    def release(self, num_tokens: int) -> None:
        self.used_bytes -= num_tokens * self.bytes_per_token
