"""vLLM's logits processors and penalties (``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``min_p``, ``min_tokens``, ``logit_bias``, ``allowed_token_ids``,
``bad_words``) against independent references: ``transformers``' logits processors where they
exist, a plain per-row formula for presence and frequency; in the sampler (rows that do not ask
are bit-identical to a batch without them), through ``Engine.generate`` on the demo model, and
through the pipeline's row layer."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.engine.requests import resolve_token_params
from batchgen_data.engine.sample.kernels import sample
from batchgen_data.engine.sample.penalties import reference_penalties
from batchgen_data.engine.sample.processors import ProcessorRows
from batchgen_data.engine.sample.sampler import Sampler, SamplingBatch
from batchgen_data.engine.sample.steps import SAMPLING_STEPS
from batchgen_data.errors import ConfigError

VOCAB = 5000
EOS = 7
# A stand-in tokenizer for resolving bad words and end-of-sequence ids (``resolve_token_params``).
WORDS = {"bad": [11], " bad": [12], "very bad": [13, 11], " very bad": [14, 11], "ab": [21, 22], " ab": [23]}
TOKENIZER = SimpleNamespace(vocab_size=VOCAB, eos_token_ids=frozenset({EOS}), folder="fake", hf=SimpleNamespace(
    encode=lambda text, add_special_tokens=False: list(WORDS[text])))
PROCESSING_STEPS = tuple(s for s in SAMPLING_STEPS if type(s).__name__ not in ("Sample", "CaptureLogprobs"))


def _resolved(**kw) -> SamplingParams:
    return resolve_token_params(SamplingParams(**kw), TOKENIZER)


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def _history(num_rows: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(seed)  # small id ranges: tokens repeat, prompts and outputs overlap
    prompts = [rng.integers(0, 60, rng.integers(1, 30)).tolist() for _ in range(num_rows)]
    outputs = [rng.integers(30, 90, rng.integers(1, 20)).tolist() for _ in range(num_rows)]
    return prompts, outputs


def _batch(params: list[SamplingParams], prompts, outputs, steps: int = 0, with_processors: bool = True,
           logprobs=None, **kw) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build([p.temperature for p in params], [p.top_p for p in params], [p.top_k for p in params],
                               list(range(100, 100 + n)), [steps] * n, logprobs=logprobs,
                               processors=ProcessorRows.build(params, prompts, outputs) if with_processors else None,
                               **kw)


def _processed(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits after the sampler's steps before ``Sample``."""
    out = logits.clone()
    Sampler(PROCESSING_STEPS)(out, batch)
    return out


def _hf_frequency_presence(row: torch.Tensor, output: list[int], frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's definition, one token at a time (fp32, as vLLM computes it)."""
    row = row.clone()
    for token, count in Counter(output).items():
        row[token] -= torch.tensor(frequency, dtype=torch.float32) * count
        row[token] -= torch.tensor(presence, dtype=torch.float32)
    return row


def _reference(logits_row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM's order with transformers' processors: allowed ids, bad words, min_tokens, bias,
    repetition penalty; then presence and frequency by formula. ``logits_row``: [1, V]."""
    x = logits_row.clone()
    out_ids = torch.tensor([output])
    if p.allowed_token_ids is not None:
        blocked = torch.ones(VOCAB, dtype=torch.bool)
        blocked[p.allowed_token_ids] = False
        x = x.masked_fill(blocked, float("-inf"))
    if p.bad_words:  # vLLM matches the output only (transformers' input_ids here)
        x = NoBadWordsLogitsProcessor([list(ids) for ids in p.bad_words_token_ids])(out_ids, x)
    if p.min_tokens:
        x = MinNewTokensLengthLogitsProcessor(0, p.min_tokens, sorted(p.all_stop_token_ids))(out_ids, x)
    if p.logit_bias:
        x = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()])(out_ids, x)
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([prompt + output]), x)
    return _hf_frequency_presence(x[0], output, p.frequency_penalty, p.presence_penalty)[None]


# --- the sampler ------------------------------------------------------------------------------


def test_penalties_match_transformers_and_the_openai_formula_bit_for_bit():
    n = 8
    logits = _logits(n)
    prompts, outputs = _history(n)
    params = [SamplingParams(temperature=0)] * n
    params[1] = SamplingParams(temperature=0, repetition_penalty=1.7)
    params[3] = SamplingParams(temperature=0, frequency_penalty=0.8, presence_penalty=-0.5)
    params[4] = SamplingParams(temperature=0.7, repetition_penalty=0.6, frequency_penalty=-1.3, presence_penalty=2.0)
    params[6] = SamplingParams(temperature=0, presence_penalty=1.5)
    out = _processed(logits, _batch(params, prompts, outputs))
    for i, p in enumerate(params):
        assert torch.equal(out[i:i + 1], _reference(logits[i:i + 1], p, prompts[i], outputs[i])), i
    dense = reference_penalties(logits, [p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                                [p.presence_penalty for p in params], prompts, outputs)
    assert torch.equal(out, dense)  # vLLM's dense apply_penalties, every row


def test_repetition_penalty_covers_the_prompt_and_the_others_only_the_output():
    logits = torch.full((1, VOCAB), 2.0)
    logits[0, 1] = -2.0
    params = [SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)]
    out = _processed(logits, _batch(params, [[1, 3]], [[4, 4, 4]]))
    assert out[0, 1] == -4.0 and out[0, 3] == 1.0  # prompt only: repetition alone (x * r if x <= 0 else x / r)
    assert out[0, 4] == 2.0 / 2 - 0.5 * 3 - 0.25  # output: repetition, then frequency x 3, then presence
    assert out[0, 5] == 2.0  # unseen


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_min_p_filters_as_transformers_after_temperature(temperature):
    n = 12
    logits = _logits(n, seed=1)
    min_ps = [0.0, 0.01, 0.05, 0.1, 0.3, 0.6, 0.9, 1.0, 0.2, 0.02, 0.0, 0.5]
    params = [SamplingParams(temperature=temperature, min_p=m, top_k=50 if i % 3 == 0 else 0,
                             top_p=0.9 if i % 4 == 0 else 1.0) for i, m in enumerate(min_ps)]
    filtered = logits.clone()
    for i, m in enumerate(min_ps):  # transformers' warper on the temperature-scaled logits
        scores = MinPLogitsWarper(m)(None, logits[i:i + 1] / temperature)
        filtered[i][scores[0] == float("-inf")] = float("-inf")
    assert (filtered == float("-inf")).any(dim=1)[1:10].all()  # the test filters something
    for step in range(5):
        with_min_p = sample(logits, _batch(params, [[1]] * n, [[2]] * n, steps=step))
        prefiltered = sample(filtered, _batch(params, [[1]] * n, [[2]] * n, steps=step, with_processors=False))
        assert torch.equal(with_min_p, prefiltered)


def test_min_p_does_not_change_greedy_rows():
    logits = _logits(4, seed=2)
    params = [SamplingParams(temperature=0, min_p=0.9)] * 4
    assert ProcessorRows.build(params, [[1]] * 4, [[2]] * 4) is None  # argmax-invariant: nothing to do
    assert torch.equal(Sampler()(logits.clone(), _batch(params, [[1]] * 4, [[2]] * 4)).token_ids, logits.argmax(-1))


def test_allowed_token_ids_bad_words_min_tokens_and_logit_bias_match_transformers_in_vllms_order():
    logits = _logits(6, seed=3)
    prompts, outputs = [[40, 41, 11]] * 6, [[30, 13], [31, 14], [5], [9, 21], [13], [12, 12]]
    allowed = list(range(0, 200, 3)) + [11, 12, 14]
    params = [
        _resolved(temperature=0, allowed_token_ids=allowed),
        _resolved(temperature=0, bad_words=["bad", "very bad", "ab"]),
        _resolved(temperature=0.8, min_tokens=4, stop_token_ids=[9, 3000], max_tokens=8),
        _resolved(temperature=0, logit_bias={"5": 4.5, 11: -100, "4999": 2.25}),
        _resolved(temperature=0, allowed_token_ids=allowed, bad_words=["very bad"], min_tokens=3, logit_bias={6: 9.0},
                  repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2),
        SamplingParams(temperature=0),
    ]
    out = _processed(logits, _batch(params, prompts, outputs))
    for i, p in enumerate(params):
        assert torch.equal(out[i:i + 1], _reference(logits[i:i + 1], p, prompts[i], outputs[i])), i
    assert out[1, 11] == float("-inf") and out[1, 12] == float("-inf")  # "bad", " bad": always
    assert out[1, 11] == out[1, 12] and out[4, 11] == float("-inf")  # "very bad" after 13
    assert out[2, EOS] == out[2, 9] == out[2, 3000] == float("-inf")  # 1 token of 4: stops masked
    tokens = Sampler()(logits.clone(), _batch(params, prompts, outputs)).token_ids
    assert tokens[0].item() in allowed and tokens[3].item() == out[3].argmax().item()


def test_min_tokens_stops_masking_once_reached():
    params = [_resolved(temperature=0, min_tokens=2, logit_bias={EOS: 100})]
    logits = _logits(1, seed=4)
    assert Sampler()(logits.clone(), _batch(params, [[1]], [[2]])).token_ids.item() != EOS
    assert Sampler()(logits.clone(), _batch(params, [[1]], [[2, 3]])).token_ids.item() == EOS


def test_rows_that_do_not_ask_are_bit_identical_to_a_batch_without_processors():
    n = 10
    logits = _logits(n, seed=5)
    prompts, outputs = _history(n, seed=5)
    plain = [SamplingParams(temperature=[0, 0.8, 1.0, 0.5][i % 4], top_k=[0, 20, 0, 5][i % 4],
                            top_p=[1.0, 1.0, 0.9, 0.8][i % 4]) for i in range(n)]
    mixed = list(plain)
    mixed[2] = _resolved(temperature=1.0, top_p=0.9, min_p=0.1, repetition_penalty=1.3, logit_bias={8: 2.0})
    mixed[7] = _resolved(temperature=0, allowed_token_ids=[1, 2, 3], bad_words=["bad"], min_tokens=5,
                         presence_penalty=1.0)
    logprobs = [2 if i % 3 == 0 else None for i in range(n)]
    for step in range(4):
        base = Sampler()(logits.clone(), _batch(plain, prompts, outputs, steps=step, logprobs=logprobs))
        both = Sampler()(logits.clone(), _batch(mixed, prompts, outputs, steps=step, logprobs=logprobs))
        others = [i for i in range(n) if i not in (2, 7)]
        assert torch.equal(base.token_ids[others], both.token_ids[others])
        assert [base.logprobs[i] for i in others] == [both.logprobs[i] for i in others]
    processed = _processed(logits, _batch(mixed, prompts, outputs))
    assert torch.equal(processed[others], logits[others])
    assert ProcessorRows.build(plain, prompts, outputs) is None  # plain rows build nothing


def test_logprobs_stay_the_models_distribution_before_processors():
    """vLLM's default ``logprobs_mode="raw_logprobs"``: the forced token's logprob is its
    probability under the model, not after the bias."""
    logits = _logits(3, seed=6)
    params = [SamplingParams(temperature=0, logit_bias={17: 100.0}, repetition_penalty=1.5), SamplingParams(temperature=0),
              SamplingParams(temperature=0, allowed_token_ids=[3, 4])]
    out = Sampler()(logits.clone(), _batch(params, [[1, 2]] * 3, [[3]] * 3, logprobs=[3, 3, 3]))
    assert out.token_ids.tolist()[0] == 17 and out.token_ids[2].item() in (3, 4)
    raw = torch.log_softmax(logits, dim=-1)
    for row in (0, 2):
        entry = out.logprobs[row]
        chosen = out.token_ids[row].item()
        assert entry.token_ids[0] == chosen and math.isclose(entry.logprobs[0], raw[row, chosen].item(), abs_tol=1e-5)
        top = raw[row].topk(3)
        listed = dict(zip(entry.token_ids, entry.logprobs))
        for token, value in zip(top.indices.tolist(), top.values.tolist()):
            assert math.isclose(listed[token], value, abs_tol=1e-5)


def test_a_greedy_grammar_row_picks_after_its_processors():
    logits = torch.zeros(2, VOCAB)
    logits[:, 40] = 3.0
    logits[:, 41] = 2.0
    mask = np.zeros((2, (VOCAB + 31) // 32), np.int32)
    mask[:, 1] = (1 << 8) | (1 << 9) | (1 << 10)  # tokens 40-42: few, so a plain greedy row is picked early
    params = [SamplingParams(temperature=0, logit_bias={41: 5.0}), SamplingParams(temperature=0)]
    batch = _batch(params, [[1]] * 2, [[2]] * 2, bitmask_rows=[0, 1], token_bitmask=mask)
    assert Sampler()(logits.clone(), batch).token_ids.tolist() == [41, 40]


# --- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize("values,message", [
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number greater than zero"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number, got inf"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ({"min_p": float("nan")}, "min_p must be a finite number, got nan"),
    ({"min_tokens": -1}, "min_tokens must be an int greater than or equal to 0"),
    ({"min_tokens": 20, "max_tokens": 16}, "min_tokens must be less than or equal to max_tokens=16, got 20"),
    ({"logit_bias": {"five": 1.0}}, "cannot be converted to an integer token id: 'five'"),
    ({"logit_bias": {5: float("nan")}}, r"logit_bias\[5\] must be a finite number, got nan"),
    ({"logit_bias": [5, 1.0]}, "logit_bias must be a dict"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids must be ints"),
    ({"bad_words": ["ok", ""]}, "bad_words cannot contain an empty string"),
    ({"bad_words": "word"}, "bad_words must be a list of strings"),
])
def test_invalid_values_are_config_errors_with_vllms_ranges(values, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**values)


def test_logit_bias_keys_may_be_strings_and_biases_are_clamped_as_in_vllms_openai_layer():
    params = SamplingParams(logit_bias={"5": 500, " 7 ": -1e9, 9: 1})
    assert params.logit_bias == {5: 100.0, 7: -100.0, 9: 1.0}
    assert SamplingParams(bad_words=["x", "y", "x"]).bad_words == ["x", "y"]  # repeats dropped, as vLLM
    defaults = SamplingParams.defaults()
    assert {k: defaults[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                                     "min_tokens", "logit_bias", "allowed_token_ids", "bad_words")} == {
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0,
        "logit_bias": None, "allowed_token_ids": None, "bad_words": None}
    assert SamplingParams.from_dict(SamplingParams(min_tokens=2, logit_bias={"3": 1}).to_dict()).logit_bias == {3: 1.0}


def test_bad_words_tokenize_with_and_without_a_leading_space_as_vllm():
    assert _resolved(bad_words=["bad", " very bad", "ab"]).bad_words_token_ids == (
        (11,), (12,), (13, 11), (14, 11), (21, 22))  # " ab" is one token where "ab" is two: not a variant
    shared = SamplingParams(min_tokens=2, stop_token_ids=[3])
    resolved = resolve_token_params(shared, TOKENIZER)
    assert resolved.all_stop_token_ids == {3, EOS} and shared.all_stop_token_ids == {3}  # the caller's is kept
    plain = SamplingParams(temperature=0.5)
    assert resolve_token_params(plain, TOKENIZER) is plain


# --- the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(demo_path):
    with Engine(demo_path, EngineConfig(max_num_seqs=8)) as engine:
        yield engine


PROMPTS = ["Label this review: the kettle leaks.", "Hello there", "Summarise: late but refunded.", "Hi"]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 6, "temperature": 0, "ignore_eos": True, **kw})


def test_a_large_logit_bias_forces_a_token_and_leaves_the_other_rows_alone(engine):
    plain = engine.generate(PROMPTS, _greedy())
    mixed = engine.generate(PROMPTS, [_greedy(), _greedy(logit_bias={"1234": 100}), _greedy(), _greedy()])
    assert mixed[1].token_ids == [1234] * 6
    assert [o.token_ids for i, o in enumerate(mixed) if i != 1] == [o.token_ids for i, o in enumerate(plain) if i != 1]


def test_allowed_token_ids_restrict_every_sampled_token(engine):
    allowed = [100, 2000, 30000, 151000]
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True,
                                                   allowed_token_ids=allowed))
    assert all(set(o.token_ids) <= set(allowed) and len(o.token_ids) == 12 for o in outs)
    assert len({t for o in outs for t in o.token_ids}) > 1  # it samples among them


def test_bad_words_never_appear(engine):
    plain = engine.generate(PROMPTS, _greedy(max_tokens=10))
    words = sorted({engine.tokenizer.decode([o.token_ids[k]]).strip() for o in plain for k in (0, 2)} - {""})
    params = _greedy(max_tokens=10, bad_words=words)
    banned = resolve_token_params(params, engine.tokenizer).bad_words_token_ids
    outs = engine.generate(PROMPTS, params)
    for out in outs:
        ids = out.token_ids
        for seq in banned:
            assert not any(tuple(ids[i:i + len(seq)]) == seq for i in range(len(ids) - len(seq) + 1)), (seq, ids)
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]


def test_min_tokens_holds_back_end_of_sequence_and_stop_tokens(engine):
    eos = min(engine.tokenizer.eos_token_ids)
    forced = {eos: 100.0}
    early = engine.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0, logit_bias=forced))[0]
    assert early.num_generated_tokens == 1 and early.finish_reason == "stop"
    held = engine.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0, logit_bias=forced, min_tokens=5))[0]
    assert held.num_generated_tokens == 6 and held.finish_reason == "stop"
    assert not set(held.token_ids[:5]) & engine.tokenizer.eos_token_ids and held.token_ids[5] == eos
    ignored = engine.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0, logit_bias=forced, min_tokens=5,
                                                        ignore_eos=True))[0]
    assert ignored.num_generated_tokens == 8 and not set(ignored.token_ids[:5]) & engine.tokenizer.eos_token_ids
    stop = engine.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0, logit_bias={77: 100.0},
                                                     stop_token_ids=[77], min_tokens=3))[0]
    assert stop.num_generated_tokens == 4 and stop.token_ids[3] == 77 and 77 not in stop.token_ids[:3]


def test_stop_strings_count_only_after_min_tokens(engine):
    full = engine.generate(["Tell me"], _greedy(max_tokens=24))[0]
    ids, text = full.token_ids, full.text
    stop = engine.tokenizer.decode(ids[:2]).strip()[:3]
    assert stop and text.find(stop) < len(engine.tokenizer.decode(ids[:4]))
    early = engine.generate(["Tell me"], _greedy(max_tokens=24, stop=stop))[0]
    assert early.text == text[: text.find(stop)]
    late = engine.generate(["Tell me"], _greedy(max_tokens=24, stop=stop, min_tokens=6))[0]
    held = len(engine.tokenizer.decode(ids[:6]))
    later = text.find(stop, max(0, held - len(stop) + 1))  # vLLM does not search the first 6 tokens' text
    assert late.num_generated_tokens > 6
    assert late.text == (text if later < 0 else text[:later])


def test_stop_rules_hold_back_end_of_sequence_stop_tokens_and_stop_strings_until_min_tokens():
    """vLLM's ``check_stop`` (end of sequence, stop tokens: not below ``min_tokens``) and its
    detokenizer (stop strings: only past ``min_tokens``, ending after that text), even where
    the sampler could not mask (a grammar's forced token)."""
    from batchgen_data.engine.core.sequence import Sequence
    from batchgen_data.engine.core.stop_rules import stop_reason

    chars = {1: "a", 2: "b", 3: "c", EOS: "", 9: ""}

    def reason(params: SamplingParams, output: list[int]) -> tuple[str | None, int | None]:
        seq = Sequence(0, [1], params, seed=0)
        seq.output_token_ids = list(output)
        found = stop_reason(seq, output[-1], frozenset({EOS}), 100, lambda ids: "".join(chars[t] for t in ids))
        return found, seq.stop_text_len

    held = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[9], stop=["ab"])
    assert reason(held, [EOS]) == (None, None) and reason(held, [3, 3, EOS]) == ("stop", None)
    assert reason(held, [9]) == (None, None) and reason(held, [3, 3, 9]) == ("stop", None)
    assert reason(held, [1, 2, 3]) == (None, None)  # not past min_tokens
    assert reason(held, [1, 2, 3, 3]) == (None, None)  # "ab" ends inside the first 3 tokens' text
    assert reason(held, [1, 2, 3, 1, 2]) == ("stop", 3)
    straddling = SamplingParams(max_tokens=10, min_tokens=1, stop=["ab"])
    assert reason(straddling, [1, 2]) == ("stop", 0)  # starts in the held text, ends after it
    assert reason(SamplingParams(max_tokens=10, stop=["ab"]), [1, 2]) == ("stop", 0)
    assert reason(held, [3] * 10) == ("length", None)


def test_penalised_greedy_equals_a_greedy_loop_with_transformers_processors(tiny_checkpoint):
    folder, hf = tiny_checkpoint("qwen3_moe")
    prompts = [[5, 6, 7, 8, 9, 5, 6], [20, 21, 22, 20], list(range(30, 50))]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.4, presence_penalty=0.3)
    with Engine(folder, EngineConfig(block_size=8)) as engine:
        outs = engine.generate(prompts + [[1, 2, 3]], [params] * 3 + [SamplingParams(max_tokens=3, temperature=0)])
    repetition = RepetitionPenaltyLogitsProcessor(1.3)
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(10):
                logits = hf(torch.tensor([ids])).logits[:, -1].float()
                logits = repetition(torch.tensor([ids]), logits)
                logits = _hf_frequency_presence(logits[0], ids[len(prompt):], 0.4, 0.3)
                ids.append(int(logits.argmax()))
        assert out.token_ids == ids[len(prompt):]


def test_out_of_vocabulary_ids_are_error_rows(engine):
    good, bias, allowed = engine.generate(["Hi"] * 3, [_greedy(max_tokens=2), _greedy(logit_bias={151936: 1.0}),
                                                       _greedy(allowed_token_ids=[5, -1])])
    assert good.error is None
    assert bias.finish_reason == "error" and "token_id(s) [151936] in logit_bias contain out-of-vocab" in bias.error
    assert allowed.finish_reason == "error" and "allowed_token_ids contains out-of-vocab token id(s) [-1]" in allowed.error


# --- the pipeline's rows ----------------------------------------------------------------------

ROW_PARAMS = [
    {"presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2,
     "logit_bias": {"5": 3.0, "7": -1.0}, "allowed_token_ids": [5, 7, 9], "bad_words": ["foo", "bar"],
     "temperature": 0.7, "max_tokens": 4},
    {"logit_bias": {"9": 2.0}, "max_tokens": 3},
    None,
]


def _row_batches():
    rows = [{"prompt": f"row {i}", "sampling_params": p} for i, p in enumerate(ROW_PARAMS)]
    columns = {"prompt": [r["prompt"] for r in rows], "sampling_params": [r["sampling_params"] for r in rows]}
    table = pa.Table.from_pylist(rows)  # a struct column: every key in every row, null where unset
    numpy = {"prompt": np.array(columns["prompt"], dtype=object), "sampling_params": np.empty(3, dtype=object)}
    numpy["sampling_params"][:] = [None if p is None else {k: np.asarray(v) if isinstance(v, list) else v
                                                            for k, v in p.items()} for p in ROW_PARAMS]
    return {"dict": columns, "numpy": numpy, "pyarrow": table, "pandas": table.to_pandas()}


@pytest.mark.parametrize("fmt", ["dict", "numpy", "pyarrow", "pandas"])
def test_rows_with_processor_fields_reach_the_engine(fmt, engine):
    from batchgen_data.operators.rows import StageConfig
    from batchgen_data.operators.stage import prepare_batch

    prepared = prepare_batch(_row_batches()[fmt], StageConfig())
    assert [row.error for row in prepared.rows] == [None, None, None]
    first, second, third = (row.params for row in prepared.rows)
    assert first == SamplingParams(**{**ROW_PARAMS[0], "logit_bias": {5: 3.0, 7: -1.0}})
    assert second.logit_bias == {9: 2.0} and second.max_tokens == 3 and second.allowed_token_ids is None
    assert third.logit_bias is None and third.min_tokens == 0
    outs = engine.generate(prepared.prompts, prepared.params)
    assert outs[0].error is None and set(outs[0].token_ids) <= {5, 7, 9} and outs[0].num_generated_tokens >= 2
    assert outs[1].error is None and outs[2].error is None


def test_an_invalid_processor_field_makes_an_error_row():
    from batchgen_data.operators.rows import StageConfig, prepare_rows

    columns = {"prompt": ["a", "b", "c"], "sampling_params": [{"presence_penalty": 3}, {"logit_bias": {"x": 1}},
                                                             {"min_tokens": 5.0, "max_tokens": 6}]}
    rows = prepare_rows(columns, 3, StageConfig())
    assert "presence_penalty must be in [-2, 2]" in rows[0].error and "logit_bias" in rows[1].error
    assert rows[2].error is None and rows[2].params.min_tokens == 5
