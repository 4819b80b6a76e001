"""The grammar library's tokenizer view, built from a token table kept on disk. No torch.

NOTE: llguidance builds its view of a tokenizer from the tokenizer's JSON: 0.8-1.0 s for the
demo's 152k vocabulary on this project's CPUs, most of it parsing that JSON again and decoding
every token to its bytes; the trie over those bytes takes ~0.2 s. A first constrained request
waits for it, which made a short job's first grammar cost 2.25x the job (issue #54). What the
view needs is each token's bytes and which tokens are special: the first build writes them to
``<cache>/grammar-token-tables/<key>.json``, keyed by a hash of the tokenizer's JSON, the model's
vocabulary size and the eos tokens, and a later process builds the view from that table (its
tokenize callback is the loaded tokenizer's own), ahead of the first request (``prewarm``).
The views' masks are the same (``tests/engine/test_token_table.py``). The file also lists the
views ("json", "text") built from it before, so a later process builds those ahead.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen_data.paths import cache_dir, write_cache_file

logger = logging.getLogger(__name__)

TABLE_VERSION = 2  # bump when the file's fields change: older files are then rebuilt

# Texts the library's own view and the tokenizer's ``encode`` must tokenize alike for a view
# from the table to be used: a sentencepiece tokenizer's ``encode`` prepends a space ("▁")
# where the library's view does not, and a view whose forced tokens differ gives other masks.
PROBES = ('{"name": "', ' x', 'a b', 'Hello world', '\n\n', '"}', '日本', '3.14')


@dataclass(frozen=True, slots=True)
class TokenTable:
    """Every token's bytes (index = token id, up to the model's vocabulary size; padding tokens
    have none), the special tokens' ids, and whether the tokenizer's ``encode`` tokenizes text
    as the library's own view does (``PROBES``; if not, views are the library's own)."""

    tokens: tuple[bytes, ...]
    special_ids: tuple[int, ...]
    tokenizes_as_library: bool = True


def table_key(tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> str:
    """The cache key of a tokenizer's table.

    Example:
        >>> table_key('{"model": {}}', 10, [2]) == table_key('{"model": {}}', 10, [2])
        True
        >>> table_key('{"model": {}}', 10, [2]) == table_key('{"model": {}}', 11, [2])
        False
    """
    digest = hashlib.sha256(tokenizer_json.encode("utf-8"))
    digest.update(json.dumps([TABLE_VERSION, vocab_size, sorted(eos_token_ids)]).encode())
    return digest.hexdigest()[:32]


def table_path(key: str) -> Path:
    return cache_dir() / "grammar-token-tables" / f"{key}.json"


def table_of(view: Any, encode: Any = None) -> TokenTable:
    """The token table of an ``llguidance.LLTokenizer`` (as it decodes each token); with
    ``encode``, whether it tokenizes the ``PROBES`` as the view does."""
    tokens = tuple(view.decode_bytes([t]) for t in range(view.vocab_size))
    alike = encode is None or all(view.tokenize_bytes(p.encode()) == list(encode(p)) for p in PROBES)
    return TokenTable(tokens, tuple(t for t in range(view.vocab_size) if view.is_special_token(t)), alike)


def view_of(table: TokenTable, encode: Any, vocab_size: int, eos_token_ids: list[int], slices: list[str]) -> Any:
    """An ``llguidance.LLTokenizer`` over ``table``; ``encode(bytes) -> list[int]`` tokenizes text
    as the model's tokenizer does (the library asks it for forced strings)."""
    import llguidance

    wrapper = llguidance.TokenizerWrapper(_Tokenizer(table, eos_token_ids[0] if eos_token_ids else None, encode))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos_token_ids or None, slices=slices)


# Texts whose tokens the view keeps (the forced strings of a job's grammars: a few, asked again
# for every row).
_ENCODED_CACHE = 4096


class _Tokenizer:
    """What ``llguidance.TokenizerWrapper`` reads off a tokenizer.

    NOTE: the library asks it to tokenize a grammar's forced text (``compute_ff_tokens``: a JSON
    row's ``{"name":"``) for every row that reaches it, ~3 times a row in a JSON job. Each call
    woke the Hugging Face tokenizer's rayon threads, which then spun beside the next step's LM
    head: 16 JSON rows x 16 tokens ran 1.13x the plain job's time, and 1.03x with those threads
    capped at one. The texts repeat, so their tokens are kept (``_ENCODED_CACHE``)."""

    def __init__(self, table: TokenTable, eos_token_id: int | None, encode: Any):
        self.tokens = list(table.tokens)
        self.special_token_ids = list(table.special_ids)
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        self._encode = encode
        self._encoded: dict[str, list[int]] = {}

    def __call__(self, text: bytes | str) -> list[int]:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        tokens = self._encoded.get(text)
        if tokens is None:
            tokens = self._encode(text)
            if len(self._encoded) >= _ENCODED_CACHE:
                self._encoded.clear()
            self._encoded[text] = tokens
        return list(tokens)


@dataclass(frozen=True, slots=True)
class StoredTable:
    table: TokenTable
    kinds: tuple[str, ...]  # the views built from it before


def load_table(path: Path) -> StoredTable | None:
    """The table stored at ``path``; None if there is none or it cannot be read (it is then
    rebuilt and written again)."""
    try:
        values = json.loads(path.read_text())
        blob = base64.b64decode(values["tokens"])
        tokens, start = [], 0
        for length in values["lengths"]:
            tokens.append(blob[start:start + length])
            start += length
        if values["version"] != TABLE_VERSION or start != len(blob):
            return None
        table = TokenTable(tuple(tokens), tuple(values["special_ids"]), bool(values["tokenizes_as_library"]))
        return StoredTable(table, tuple(values["kinds"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        logger.warning("ignoring the unreadable grammar token table %s: %s", path, err)
        return None


def save_table(path: Path, table: TokenTable, kinds: tuple[str, ...]) -> None:
    """Write ``table`` (a failure is a warning: the next process builds it again)."""
    values = {"version": TABLE_VERSION, "kinds": sorted(set(kinds)), "special_ids": list(table.special_ids),
              "tokenizes_as_library": table.tokenizes_as_library,
              "lengths": [len(t) for t in table.tokens],
              "tokens": base64.b64encode(b"".join(table.tokens)).decode("ascii")}
    try:
        write_cache_file(path, json.dumps(values))
    except OSError as err:
        logger.warning("could not cache the grammar token table at %s: %s", path, err)
