"""Constraints to grammars, compiled off the step path and cached by spec. No torch.

The grammar library is llguidance (chosen by measurement: docs/structured-outputs.md). Its
tokenizer view is built once per engine with the model's vocabulary size (a checkpoint pads its
vocabulary beyond the tokenizer's; the padding tokens are never allowed), from the tokenizer the
engine already loaded: 1.3-1.6 s for the demo's 152k vocabulary the first time on a machine,
nearly all of it the library's own build, which holds the GIL. That build leaves the view's
token table on disk (``token_table``), and where a table is stored, ``prewarm`` builds the views
an earlier process used from it (~0.8 s) beside the engine's model load, so the first
constrained request finds them built; with no table, the view is built when the first
constrained request comes (built ahead from the JSON it had made a 2-core engine's start 1.4 s
slower). A compiled grammar is a matcher in its start state; each sequence gets a copy of it.

NOTE: the library walks the vocabulary's token trie for every mask, except for a "slice" (the
tokens matching a regex such as ``[a-z]{1,10}``, each token in the first slice that matches it)
that the lexer's current state allows whole: that slice's mask is copied in. Its default slices
are the JSON string's characters, so a counted regex over letters (``[a-z]{400}``, a fixed-width
code) walked every letter token of the vocabulary per row per step. Regex and grammar
constraints therefore get a second view whose slices start with the common ASCII classes
(``CLASS_SLICES``); ``benchmarks/structured.py`` reports the fill per step. JSON constraints keep
the library's JSON slices: a letter slice ahead of them would claim the letter tokens out of the
JSON string slices, and every slice adds a check and a mask copy to each fill, which JSON string
states do not need. Slices change only how a mask is computed, never its bits.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from batchgen_data.engine.structured import token_table
from batchgen_data.engine.structured.params import StructuredOutputsParams
from batchgen_data.errors import RequestError, one_line

logger = logging.getLogger(__name__)

# Distinct constraints whose compiled grammar is kept (a job usually has one or a few; one per
# row must not grow memory without bound).
_CACHE_SIZE = 256
# Character classes a counted regex is usually written with, each as two slices: tokens of 1-10
# and of 11-30 characters (a state allows the first while at least 10 characters are left).
CLASS_SLICES = tuple(f"{cls}{{1,{n}}}" for cls in ("[a-z]", "[A-Z]", "[a-zA-Z]", "[a-zA-Z0-9]") for n in (10, 30))
# Words of the grammar library's messages when a constraint exceeds one of its limits (lexer fuel
# and states, grammar size, items per row) rather than being invalid.
_LIMIT_WORDS = ("too many", "too big", "too large", "fuel")


class CompiledGrammar:
    """A constraint's grammar in its start state; ``new_matcher`` gives a sequence its own."""

    def __init__(self, matcher: Any):
        self._start = matcher  # llguidance.LLMatcher, never advanced

    def new_matcher(self) -> Any:
        return self._start.deep_copy()


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` into ``CompiledGrammar``s on one background thread.

    Args:
        tokenizer_folder: the checkpoint folder holding the tokenizer files.
        vocab_size: the model's vocabulary size (rows of its logits).
        eos_token_ids: the tokens that end a sequence; the grammar allows them where it accepts.
        hf_tokenizer: the Hugging Face tokenizer already loaded from that folder, if any (saves
            loading it again).
    """

    def __init__(self, tokenizer_folder: str | Path, vocab_size: int, eos_token_ids: frozenset[int],
                 hf_tokenizer: Any = None):
        self.tokenizer_folder = Path(tokenizer_folder)
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._hf = hf_tokenizer
        self._pool: ThreadPoolExecutor | None = None
        self._views: dict[str, Any] = {}  # "json" / "text" -> llguidance.LLTokenizer
        self._table: tuple[Path, token_table.TokenTable, set[str]] | None = None  # (path, table, kinds stored)
        self._path: Path | None = None  # where this tokenizer's table is stored
        self._tokenizer_json: str | None = None
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar of ``params``: cached, or compiling in the background. A bad
        constraint's future raises ``RequestError`` naming the problem."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgen-grammar")
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def prewarm(self) -> None:
        """Build the tokenizer views an earlier process stored a token table for (see
        ``token_table``), on the compile thread, so a first constrained request need not wait
        for them; nothing if there is no such table or no loaded tokenizer to tokenize with."""
        if self._hf is None or _backend(self._hf) is None:
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgen-grammar")
            self._pool.submit(self._prebuild)

    def _prebuild(self) -> None:
        try:
            stored = self._token_table(self._hf, build=False)
            if stored is not None and stored[1].tokenizes_as_library:
                for kind in sorted(stored[2]):
                    self._ll_tokenizer(kind)
        except Exception as err:  # a view that fails here fails again, with its request, at first use
            logger.warning("could not build the grammar tokenizer views ahead: %s", one_line(str(err)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # -- on the compile thread ------------------------------------------------------------------

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance

        grammar = _to_llguidance(params)
        view = self._ll_tokenizer("json" if params.kind in ("json", "json_object") else "text")
        matcher = llguidance.LLMatcher(view, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(compile_error(params.kind, matcher.get_error()))
        return CompiledGrammar(matcher)

    def _ll_tokenizer(self, kind: str) -> Any:  # on the (single) compile thread
        """The tokenizer view for ``kind`` ("json" or "text"; see module NOTE): the first is
        built from the token table stored on disk (~0.4 s on the demo) or else from the
        tokenizer (~1.2 s), the second from the first (~0.3 s)."""
        view = self._views.get(kind)
        if view is None:
            slices = view_slices(kind)
            if self._views:
                view = next(iter(self._views.values())).with_slices(slices)
            else:
                view = self._first_view(slices)
            self._views[kind] = view
            if self._table is not None and kind not in self._table[2]:  # a later process builds it ahead
                path, table, kinds = self._table
                kinds.add(kind)
                token_table.save_table(path, table, tuple(kinds))
        return view

    def _first_view(self, slices: list[str]) -> Any:
        hf = self._hf or _load_hf(self.tokenizer_folder)
        backend = _backend(hf)
        if backend is None:
            return llguidance_hf_view(hf, self.vocab_size, self.eos_token_ids, slices)
        _, table, _ = self._token_table(hf)
        if not table.tokenizes_as_library:  # the library's own view (token_table.PROBES)
            return llguidance_view(backend.to_str(), self.vocab_size, _eos(hf, self.eos_token_ids), slices)
        # From the table: its tokenize callback keeps the forced texts' tokens (token_table NOTE).
        return token_table.view_of(table, _encoder(backend), self.vocab_size, _eos(hf, self.eos_token_ids), slices)

    def _token_table(self, hf: Any, build: bool = True) -> tuple[Path, token_table.TokenTable, set[str]] | None:
        """This tokenizer's table (path, table, kinds stored): read from disk, or else (with
        ``build``; without it, None) read off the library's own view (~0.2 s more than that view
        alone, once on a machine); once."""
        if self._table is None:
            backend = _backend(hf)
            path = self._table_path(backend)
            stored = token_table.load_table(path)
            if stored is not None:
                table, kinds = stored.table, set(stored.kinds)
            elif build:
                view = llguidance_view(self._tokenizer_json, self.vocab_size, _eos(hf, self.eos_token_ids), [])
                table, kinds = token_table.table_of(view, _encoder(backend)), set()
            else:
                return None
            self._table, self._tokenizer_json = (path, table, kinds), None
        return self._table

    def _table_path(self, backend: Any) -> Path:
        if self._path is None:
            self._tokenizer_json = backend.to_str()  # ~0.2 s on the demo: once (kept until the first view)
            self._path = token_table.table_path(token_table.table_key(self._tokenizer_json, self.vocab_size,
                                                                      self.eos_token_ids))
        return self._path


def view_slices(kind: str) -> list[str]:
    """The mask slices of the "json" or "text" tokenizer view (see module NOTE)."""
    import llguidance

    return llguidance.LLTokenizer.json_slices() if kind == "json" else [*CLASS_SLICES,
                                                                          *llguidance.LLTokenizer.general_slices()]


def _load_hf(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _encoder(backend: Any) -> Any:
    """Text to token ids as the fast tokenizer encodes it (no special tokens added)."""
    return lambda text: backend.encode(text, add_special_tokens=False).ids


def _eos(hf: Any, eos_token_ids: list[int]) -> list[int]:
    """The model's eos tokens, else the tokenizer's."""
    return eos_token_ids or ([hf.eos_token_id] if hf.eos_token_id is not None else [])


def _backend(hf: Any) -> Any:
    """The fast tokenizer under a Hugging Face one, where its JSON is the whole tokenizer (no
    padding or truncation to drop); else None."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or backend.padding is not None or backend.truncation is not None:
        return None
    return backend


def llguidance_view(tokenizer_json: str, vocab_size: int, eos: Any, slices: list[str]) -> Any:
    """llguidance's view built from a fast tokenizer's JSON (as ``llguidance.hf.from_tokenizer``
    builds it, without copying the tokenizer)."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos, slices=slices)


def llguidance_hf_view(hf: Any, vocab_size: int, eos_token_ids: list[int], slices: list[str]) -> Any:
    """llguidance's view of any other Hugging Face tokenizer (``llguidance.hf.from_tokenizer``)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos_token_ids or None, slices=slices)


def no_additional_properties(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that does not set
    it (vLLM's ``disable_additional_properties`` for its guidance backend)."""
    if isinstance(schema, list):
        return [no_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: no_additional_properties(value) for key, value in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _to_llguidance(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (as vLLM's guidance backend writes it)."""
    import llguidance

    kind = params.kind
    options: dict = {"whitespace_flexible": not params.disable_any_whitespace}
    if params.whitespace_pattern is not None:
        options["whitespace_pattern"] = params.whitespace_pattern
    try:
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            if params.disable_additional_properties:
                schema = no_additional_properties(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        if kind == "regex":
            return llguidance.grammar_from("regex", params.regex)
        if kind == "choice":
            # One lexeme whose alternatives are the choices (the same masks as the library's
            # "choice" grammar, which makes each choice a grammar symbol and panics past ~65,500 of
            # them): 100,000 choices compile in about a second.
            return llguidance.LLMatcher.grammar_from_lark(
                "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in params.choice))
        return llguidance.grammar_from("grammar", params.grammar)  # GBNF or Lark
    except ValueError as err:
        raise RequestError(compile_error(kind, str(err))) from None


def exceeds_limits(message: str) -> bool:
    """Whether the grammar library's error ``message`` says a constraint is beyond its limits."""
    text = message.lower()
    return any(word in text for word in _LIMIT_WORDS)


def compile_error(kind: str, message: str) -> str:
    """The grammar library's error on a constraint as one line for its row: a constraint beyond
    the library's limits (``regex too large to compile: ...``), a library failure, or what is
    invalid in it.

    Example:
        >>> compile_error("regex", "lexer error: too many expressions constructed\\n<state>...")
        'structured_outputs regex too large to compile: lexer error: too many expressions constructed'
    """
    reason = one_line(message)
    if exceeds_limits(reason):
        return f"structured_outputs {kind} too large to compile: {reason}"
    if reason.startswith("panic"):  # an assertion in the library (one line: its backtrace is cut)
        return f"structured_outputs {kind} could not be compiled (the grammar library failed: {reason})"
    return f"invalid structured_outputs {kind}: {reason}"
