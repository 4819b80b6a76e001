"""Lazy greedy picks under a grammar (``structured/lazy.py``, issue #36): a greedy row's mask is
filled only when its argmax is not allowed. The check must say exactly what the mask says, and
the tokens must be those of rows whose masks are always filled."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.engine.structured.lazy import LazyGrammarRows
from batchgen_data.engine.structured.manager import StructuredOutputManager
from batchgen_data.engine.structured.params import StructuredOutputsParams
from batchgen_data.engine.structured.request import StructuredRequest

CONSTRAINTS = [
    {"json": {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 9},
                                               "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]},
                                                        "minItems": 2}},
              "required": ["name", "tags"], "additionalProperties": False}, "disable_any_whitespace": True},
    {"json": {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                                               "b": {"enum": ["x y", "x z"]}, "c": {"type": "number"},
                                               "d": {"type": "string", "pattern": "^[a-z]{2,5}$"}},
              "required": ["a", "b", "c", "d"]}},
    {"json": {"type": "object"}},
    {"regex": r"(\d{3}-\d{4}|[A-Z][a-z]+ [A-Z][a-z]+)"},
    {"regex": "[a-z]{5}( [0-9]{2})?"},
    {"choice": ["yes", "no", "maybe not"]},
    {"grammar": 'root ::= "a" [b-d]* "e"'},
]


@pytest.fixture(scope="module")
def manager(demo_path):
    from batchgen_data.model import ModelConfig
    from transformers import AutoTokenizer

    config = ModelConfig.from_pretrained(demo_path)
    hf = AutoTokenizer.from_pretrained(str(demo_path))
    manager = StructuredOutputManager(demo_path, config.vocab_size, frozenset(config.eos_token_ids), hf)
    yield manager, hf
    manager.close()


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(constraint=st.sampled_from(CONSTRAINTS), seed=st.integers(0, 2**31 - 1))
def test_the_check_says_what_the_mask_says(manager, constraint, seed):
    """On the demo's 152k vocabulary, state by state along random walks: every allowed token,
    a sample of the others, the special and padding tokens. Where the grammar forces its next
    tokens the check says no (the row is filled: the library's mask is the forced token alone)."""
    manager, hf = manager
    vocab = manager.vocab_size
    matcher = manager.compiler.submit(StructuredOutputsParams(**constraint)).result(timeout=60).new_matcher()
    request = StructuredRequest(future=None, matcher=matcher)
    lazy = LazyGrammarRows([0], [request], manager)
    rng = np.random.default_rng(seed)
    padding = np.arange(len(hf), vocab)
    for _ in range(30):
        mask = allocate_token_bitmask(1, vocab)
        fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        tokens = np.concatenate([np.flatnonzero(allowed)[:300], rng.integers(0, vocab, 300), padding[::5],
                                 hf.all_special_ids])
        forced = bool(matcher.compute_ff_tokens())
        for token in tokens.tolist():
            assert (lazy.first_allowed(0, [token]) == token) == (bool(allowed[token]) and not forced), (constraint, token)
        choices = np.flatnonzero(allowed)
        if matcher.is_stopped() or not len(choices):
            break
        assert matcher.consume_token(int(rng.choice(choices)))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(constraint=st.sampled_from(CONSTRAINTS), ties=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_the_first_allowed_candidate_is_the_masked_argmax(manager, constraint, ties, seed):
    """The lazy pick from a row's largest logits (``top_ids_at``, ``first_allowed``) is the
    first maximum over the mask's allowed tokens wherever it picks, and it declines only where
    the grammar forces its next tokens or no candidate is allowed; with many equal logits."""
    import torch

    from batchgen_data.engine.sample.bitmask import LAZY_CANDIDATES
    from batchgen_data.engine.sample.kernels import top_ids_at
    from batchgen_data.model.native import _ACTIVE, use_native_kernels

    manager, _ = manager
    vocab = manager.vocab_size
    matcher = manager.compiler.submit(StructuredOutputsParams(**constraint)).result(timeout=60).new_matcher()
    lazy = LazyGrammarRows([0], [StructuredRequest(future=None, matcher=matcher)], manager)
    rng = np.random.default_rng(seed)
    was = _ACTIVE["on"]
    use_native_kernels(True)
    try:
        for _ in range(20):
            mask = allocate_token_bitmask(1, vocab)
            fill_next_token_bitmask(matcher, mask, 0)
            allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
            choices = np.flatnonzero(allowed)
            logits = torch.from_numpy(rng.standard_normal((1, vocab)).astype(np.float32))
            if ties:
                logits = logits.mul(2).round()
            if len(choices):  # an allowed token among the largest, at a random place, or none
                logits[0, int(rng.choice(choices))] += float(rng.choice([0.0, 2.0, 5.0]))
            candidates = top_ids_at(logits, [0], LAZY_CANDIDATES)[0]
            picked = lazy.first_allowed(0, candidates)
            masked = np.where(allowed, logits[0].numpy(), -np.inf)
            if picked is not None:
                assert picked == int(np.argmax(masked))  # numpy's argmax: the first maximum
            else:
                assert matcher.compute_ff_tokens() or not allowed[candidates].any()
            if matcher.is_stopped() or not len(choices):
                break
            assert matcher.consume_token(int(rng.choice(choices)))
    finally:
        use_native_kernels(was)


BOUNDED = {"json": {"type": "object", "properties": {"name": {"type": "string", "minLength": 3, "maxLength": 30},
                                                     "note": {"type": "string"}},
                    "required": ["name", "note"], "additionalProperties": False}, "disable_any_whitespace": True}


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    with Engine(tiny_checkpoint("qwen3_moe")[0], EngineConfig(block_size=8)) as engine:
        yield engine


def _run(engine, monkeypatch, lazy: bool):
    monkeypatch.setattr(StructuredOutputManager, "lazy_greedy", lazy)
    prompts = [f"Review {i}: the food was {w}." for i, w in enumerate(["great", "cold", "fine", "late", "odd"])]
    greedy = dict(max_tokens=40, temperature=0)
    params = [
        SamplingParams(**greedy, structured_outputs=BOUNDED),
        SamplingParams(**greedy, structured_outputs={"regex": "[a-z ]{20,60}"}),
        SamplingParams(**greedy, structured_outputs=CONSTRAINTS[0]),
        # neighbours the lazy picks must leave alone: a sampled row, a logprobs row, a plain row
        SamplingParams(max_tokens=40, temperature=1.0, seed=5, structured_outputs=BOUNDED),
        SamplingParams(**greedy, logprobs=2, structured_outputs=BOUNDED),
    ]
    outs = engine.generate(prompts, params)
    plain = engine.generate(prompts[:1], SamplingParams(**greedy))
    return [(o.token_ids, o.finish_reason) for o in outs + plain], [o.logprobs for o in outs]


def test_tokens_equal_those_of_always_filled_masks(engine, monkeypatch):
    structured = engine.executor.structured
    picks = structured.lazy_picks
    lazy_tokens, lazy_logprobs = _run(engine, monkeypatch, True)
    assert structured.lazy_picks > picks  # the lazy path ran
    filled_tokens, filled_logprobs = _run(engine, monkeypatch, False)
    assert lazy_tokens == filled_tokens
    # The logprob row is never lazy; its values match to float rounding (a second run of the
    # same prompts reads its prefix from the cache, so its floats may differ in the last bits).
    for lazy_row, filled_row in zip(lazy_logprobs, filled_logprobs):
        for a, b in zip(lazy_row or [], filled_row or []):
            assert a.keys() == b.keys()
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)

