"""The grammar tokenizer view built from a token table stored on disk (issue #54,
``engine/structured/token_table.py``) allows exactly what the library's own view built from the
tokenizer's JSON allows: the same mask and the same forced tokens in every state of a walk
through JSON, regex, choice and Lark constraints, on the demo's 152k vocabulary and on a small
trained BPE; and the compiler writes the table at a first build and builds a later process's
views from it, ahead of the first request."""

from __future__ import annotations

import logging
import time

import llguidance
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from batchgen_data.engine.structured import token_table
from batchgen_data.engine.structured.compiler import GrammarCompiler, llguidance_view, view_slices
from batchgen_data.engine.structured.params import StructuredOutputsParams

GRAMMARS = [
    llguidance.LLMatcher.grammar_from_json_schema(
        '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},'
        ' "required": ["name", "age"], "additionalProperties": false}'),
    llguidance.grammar_from("regex", r"[a-z]{3,8}-[0-9]{2}( [A-Z][a-z]+)?"),
    llguidance.LLMatcher.grammar_from_lark('start: CHOICE\nCHOICE: "yes, indeed" | "no" | "maybe later"'),
    llguidance.grammar_from("grammar", 'start: "say " word ("," word)*\nword: /[a-z]+/'),
]


def _tokenizers(demo_path, tmp_path):
    from transformers import AutoTokenizer

    from batchgen_data.model import ModelConfig
    from tiny_checkpoints import build_tokenizer

    config = ModelConfig.from_pretrained(demo_path)
    demo = AutoTokenizer.from_pretrained(str(demo_path))
    return [(demo, config.vocab_size, sorted(config.eos_token_ids)),
            (build_tokenizer(tmp_path / "bpe"), 600, [2])]


def _mask(matcher, vocab: int) -> np.ndarray:
    mask = allocate_token_bitmask(1, vocab)
    fill_next_token_bitmask(matcher, mask, 0)
    return mask


def _same_walks(a, b, vocab: int, seed: int) -> int:
    """Walk both views through every grammar by the same random allowed tokens; return the
    number of states compared."""
    rng = np.random.default_rng(seed)
    states = 0
    for grammar in GRAMMARS:
        ours, theirs = (llguidance.LLMatcher(view, grammar, log_level=0) for view in (a, b))
        for _ in range(24):
            mask = _mask(ours, vocab)
            assert np.array_equal(mask, _mask(theirs, vocab)), grammar
            assert ours.compute_ff_tokens() == theirs.compute_ff_tokens()
            states += 1
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])
            if ours.is_stopped() or not len(allowed):
                break
            token = int(rng.choice(allowed))
            assert ours.consume_token(token) and theirs.consume_token(token)
    return states


@pytest.mark.parametrize("kind", ["json", "text"])
def test_a_view_from_the_stored_table_allows_what_the_librarys_own_view_allows(demo_path, tmp_path, kind):
    for hf, vocab, eos in _tokenizers(demo_path, tmp_path):
        backend = hf.backend_tokenizer
        own = llguidance_view(backend.to_str(), vocab, eos, view_slices(kind))
        path = tmp_path / "table.json"
        token_table.save_table(path, token_table.table_of(own), (kind,))
        stored = token_table.load_table(path)
        assert stored.kinds == (kind,) and len(stored.table.tokens) == vocab
        view = token_table.view_of(stored.table, lambda text: backend.encode(text, add_special_tokens=False).ids,
                                   vocab, eos, view_slices(kind))
        assert view.vocab_size == own.vocab_size and view.eos_tokens == own.eos_tokens
        assert all(view.is_special_token(t) == own.is_special_token(t) for t in range(vocab))
        assert _same_walks(view, own, vocab, seed=vocab) >= 4 * 8


def test_the_compiler_stores_the_table_and_a_later_one_builds_its_views_ahead(demo_path, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from batchgen_data.model import ModelConfig

    monkeypatch.setenv("BATCHGEN_DATA_CACHE", str(tmp_path))
    config = ModelConfig.from_pretrained(demo_path)
    hf = AutoTokenizer.from_pretrained(str(demo_path))
    regex = StructuredOutputsParams(regex="[a-z]{4}")
    first = GrammarCompiler(demo_path, config.vocab_size, config.eos_token_ids, hf)
    try:
        first.prewarm()  # no table yet: nothing built ahead
        first.submit(regex).result(timeout=120)
        files = list((tmp_path / "grammar-token-tables").glob("*.json"))
        assert len(files) == 1 and token_table.load_table(files[0]).kinds == ("text",)
    finally:
        first.close()
    later = GrammarCompiler(demo_path, config.vocab_size, config.eos_token_ids, hf)
    try:
        later.prewarm()
        deadline = time.monotonic() + 120
        while "text" not in later._views and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(later._views) == {"text"}  # built ahead, before any request
        matcher = later.submit(regex).result(timeout=120).new_matcher()
        assert matcher.consume_tokens(hf.encode("abcd", add_special_tokens=False)) and matcher.is_accepting()
    finally:
        later.close()


def test_an_unreadable_table_is_a_warning_and_is_built_again(tmp_path, caplog):
    path = tmp_path / "t.json"
    path.write_text('{"version": 1, "tokens": "not base64!"')
    with caplog.at_level(logging.WARNING):
        assert token_table.load_table(path) is None
    assert "unreadable grammar token table" in caplog.text
    assert token_table.load_table(tmp_path / "missing.json") is None


def test_the_forced_text_of_every_row_is_tokenized_once(tmp_path):
    # The library asks the view to tokenize a grammar's forced text for every row that reaches
    # it; each call woke the tokenizer's threads (token_table NOTE). The view keeps the tokens.
    from tiny_checkpoints import build_tokenizer

    backend = build_tokenizer(tmp_path / "bpe").backend_tokenizer
    own = llguidance_view(backend.to_str(), 600, [2], view_slices("json"))
    texts = []

    def encode(text):
        texts.append(text)
        return backend.encode(text, add_special_tokens=False).ids

    view = token_table.view_of(token_table.table_of(own), encode, 600, [2], view_slices("json"))
    forced = [llguidance.LLMatcher(view, GRAMMARS[0], log_level=0).compute_ff_tokens() for _ in range(8)]
    assert forced[0] and all(f == forced[0] for f in forced)
    assert forced[0] == llguidance.LLMatcher(own, GRAMMARS[0], log_level=0).compute_ff_tokens()
    assert texts and len(texts) == len(set(texts))  # each text once, for all 8 rows


def _sentencepiece_style(folder):
    """A byte-fallback BPE whose pre-tokenizer prepends "▁" (as Llama's and Mistral's do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>",
                                                                   *(f"<0x{i:02X}>" for i in range(256))])
    tok.train_from_iterator(["the quick brown fox says yes no maybe later name age"] * 50 + ['é 日本 {"a": 1}'] * 10,
                            trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    hf.save_pretrained(str(folder))
    return hf


def test_a_tokenizer_that_encodes_unlike_the_library_gets_the_librarys_own_view(tmp_path, monkeypatch):
    # Its encode prepends "▁" to a forced text where the library's view does not: a view over
    # the table would force other tokens, so the table records it and the library's view is used.
    monkeypatch.setenv("BATCHGEN_DATA_CACHE", str(tmp_path / "cache"))
    hf = _sentencepiece_style(tmp_path / "sp")
    vocab, eos = len(hf) + 7, [hf.eos_token_id]
    own = llguidance_view(hf.backend_tokenizer.to_str(), vocab, eos, view_slices("json"))
    for _ in range(2):  # the first compiler writes the table, the second reads it
        compiler = GrammarCompiler(tmp_path / "sp", vocab, frozenset(eos), hf)
        try:
            compiler.prewarm()
            compiler.submit(StructuredOutputsParams(json={"type": "object"})).result(timeout=60)
            _, table, _ = compiler._table
            assert not table.tokenizes_as_library
            for grammar in GRAMMARS:  # the start states: where the table's view forced another token
                ours, theirs = (llguidance.LLMatcher(v, grammar, log_level=0) for v in (compiler._views["json"], own))
                assert np.array_equal(_mask(ours, vocab), _mask(theirs, vocab))
                assert ours.compute_ff_tokens() == theirs.compute_ff_tokens()
        finally:
            compiler.close()
    bpe = build_tokenizer_for_test(tmp_path / "bpe")
    backend = bpe.backend_tokenizer
    assert token_table.table_of(llguidance_view(backend.to_str(), 600, [2], []),
                                lambda text: backend.encode(text, add_special_tokens=False).ids).tokenizes_as_library


def build_tokenizer_for_test(folder):
    from tiny_checkpoints import build_tokenizer

    return build_tokenizer(folder)
