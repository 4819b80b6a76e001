"""The character-class slices of regex and grammar constraints (issue #36) change how a mask is
computed, never its bits: on the demo's 152k vocabulary, each mask a counted regex gives through
the compiler equals the library's plain trie walk (no slices) and, token by token, the library's
own verdict on each token (``validate_tokens``)."""

import llguidance
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from batchgen_data.engine.structured.compiler import CLASS_SLICES, GrammarCompiler, llguidance_view, view_slices
from batchgen_data.engine.structured.params import StructuredOutputsParams

CLASSES = ["[a-z]", "[A-Z]", "[a-zA-Z]", "[a-zA-Z0-9]", "[0-9]", "[a-f0-9]", "[a-z ]", "[^a-z]"]


@pytest.fixture(scope="module")
def views(demo_path):
    from batchgen_data.model import ModelConfig
    from transformers import AutoTokenizer

    config = ModelConfig.from_pretrained(demo_path)
    hf = AutoTokenizer.from_pretrained(str(demo_path))
    eos = sorted(config.eos_token_ids)
    compiler = GrammarCompiler(demo_path, config.vocab_size, frozenset(eos), hf)
    plain = llguidance_view(hf.backend_tokenizer.to_str(), config.vocab_size, eos, [])  # no slices: the whole trie walked
    yield compiler, plain, config.vocab_size, eos
    compiler.close()


def _allowed(matcher, vocab: int) -> np.ndarray:
    mask = allocate_token_bitmask(1, vocab)
    fill_next_token_bitmask(matcher, mask, 0)
    return np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def test_text_constraints_get_the_class_slices_and_json_keeps_the_librarys():
    assert view_slices("text")[: len(CLASS_SLICES)] == list(CLASS_SLICES)
    assert view_slices("text")[len(CLASS_SLICES):] == llguidance.LLTokenizer.general_slices()
    assert view_slices("json") == llguidance.LLTokenizer.json_slices()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cls=st.sampled_from(CLASSES), count=st.integers(1, 60), prefix=st.sampled_from(["", "id-", "X"]),
       seed=st.integers(0, 2**31 - 1))
def test_counted_class_masks_equal_the_plain_walk_and_the_token_verdicts(views, cls, count, prefix, seed):
    compiler, plain, vocab, eos = views
    regex = f"{prefix}{cls}{{{count}}}"
    ours = compiler.submit(StructuredOutputsParams(regex=regex)).result(timeout=60).new_matcher()
    reference = llguidance.LLMatcher(plain, llguidance.grammar_from("regex", regex), log_level=0)
    rng = np.random.default_rng(seed)
    for _ in range(8):
        allowed = _allowed(ours, vocab)
        assert np.array_equal(allowed, _allowed(reference, vocab)), regex
        # The library's verdict on single tokens: every allowed one and a sample of the rest; an
        # end-of-sequence token is allowed exactly where the grammar accepts.
        sample = np.concatenate([np.flatnonzero(allowed)[:400], rng.integers(0, vocab, 600)])
        for token in sample.tolist():
            expected = reference.is_accepting() if token in eos else reference.validate_tokens([token]) == 1
            assert bool(allowed[token]) == expected, (regex, token)
        choices = np.flatnonzero(allowed)
        if ours.is_stopped() or not len(choices):
            break
        token = int(rng.choice(choices))
        assert ours.consume_token(token) and reference.consume_token(token)
