"""Structured outputs on a random model: only the constraint can make its outputs well formed.

Each constraint's outputs are checked against the constraint itself (``re.fullmatch``, a JSON
Schema validator, the grammar's language), and the same prompts without the constraint are
checked not to be well formed, so a test cannot pass by luck.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.engine.core.sequence import SequenceStatus
from batchgen_data.errors import ConfigError
from batchgen_data.model.kv_cache import KVCache

ARCH = "qwen3_moe"
PROMPTS = [f"Review {i}: the food was {w}." for i, w in enumerate(["great", "cold", "fine", "late", "superb", "odd"])]
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "flagged": {"type": "boolean"},
        "topics": {"type": "array", "items": {"type": "string", "enum": ["food", "price"]}, "maxItems": 2},
    },
    "required": ["label", "score", "flagged", "topics"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{2}-[0-9]{3}"
CHOICE = ["positive", "negative", "neutral"]
GRAMMAR = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z] [a-z]? [a-z]? "."'
GRAMMAR_RE = r"(yes|no) because [a-z]{1,3}\."


def _valid_json(text: str) -> bool:
    try:
        return jsonschema.Draft202012Validator(SCHEMA).is_valid(json.loads(text))
    except json.JSONDecodeError:
        return False


CASES = {
    "choice": ({"choice": CHOICE}, lambda t: t in CHOICE),
    "regex": ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
    "json": ({"json": SCHEMA, "disable_any_whitespace": True}, _valid_json),
    "grammar": ({"grammar": GRAMMAR}, lambda t: re.fullmatch(GRAMMAR_RE, t) is not None),
}


@pytest.fixture(scope="module")
def folder(tiny_checkpoint):
    return tiny_checkpoint(ARCH)[0]


@pytest.fixture(scope="module")
def engine(folder):
    with Engine(folder, EngineConfig(block_size=8)) as engine:
        yield engine


def _params(constraint=None, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, "temperature": 0, **kw}, structured_outputs=constraint)


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 3}],
                         ids=["greedy", "sampled"])
def test_outputs_are_well_formed_where_the_model_alone_is_not(engine, kind, sampling):
    constraint, is_well_formed = CASES[kind]
    outs = engine.generate(PROMPTS, _params(constraint, **sampling))
    assert all(o.finish_reason == "stop" and o.error is None for o in outs), [(o.text, o.finish_reason) for o in outs]
    assert all(is_well_formed(o.text) for o in outs), [o.text for o in outs]
    free = engine.generate(PROMPTS, _params(None, **sampling))
    assert not any(is_well_formed(o.text) for o in free)


def test_schema_values_vary_and_respect_bounds(engine):
    outs = engine.generate(PROMPTS, _params({"json": SCHEMA, "disable_any_whitespace": True}, temperature=1.0, seed=11))
    values = [json.loads(o.text) for o in outs]
    assert all(0 <= v["score"] <= 10 and isinstance(v["flagged"], bool) for v in values)
    assert len({o.text for o in outs}) > 1  # the constraint steers, the model still chooses


def test_guided_decoding_dict_is_structured_outputs():
    params = SamplingParams.from_dict({"max_tokens": 8, "guided_decoding": {"choice": CHOICE, "json": None, "regex": None}})
    assert params.structured_outputs.choice == tuple(CHOICE)
    assert SamplingParams.from_dict(params.to_dict()).structured_outputs == params.structured_outputs
    with pytest.raises(ConfigError, match="not both"):
        SamplingParams.from_dict({"guided_decoding": {"choice": CHOICE}, "structured_outputs": {"regex": "a"}})


@pytest.mark.parametrize("bad,message", [
    ({"choice": CHOICE, "regex": REGEX}, "exactly one"),
    ({}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"choice": []}, "choice"),
    ({"regexp": "a"}, "unknown structured_outputs field"),
])
def test_malformed_constraints_are_config_errors(bad, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(structured_outputs=bad)


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-order", "fifo"])
def test_bad_constraints_are_error_rows_and_neighbours_run(folder, caching):
    bad = {
        "invalid schema": ({"json": {"type": "objekt"}}, "objekt"),
        "invalid regex": ({"regex": "a(b"}, "unclosed group"),
        "invalid grammar": ({"grammar": "root ::= missing"}, "missing"),
        "unsupported schema feature": ({"json": {"type": "object", "if": {"required": ["a"]}}}, "if"),
    }
    good = _params({"regex": REGEX})
    params = [good] + [_params(c) for c, _ in bad.values()] + [good, _params(None, max_tokens=6)]
    with Engine(folder, EngineConfig(block_size=8, enable_prefix_caching=caching)) as engine:
        outs = engine.generate(PROMPTS[:1] * len(params), params)
    for out, (name, (_, needle)) in zip(outs[1:], bad.items()):
        assert out.finish_reason == "error" and out.token_ids == [], name
        assert "structured_outputs" in out.error and needle in out.error, (name, out.error)
    assert re.fullmatch(REGEX, outs[0].text) and outs[0].text == outs[-2].text
    assert outs[-1].num_generated_tokens == 6


def test_unconstrained_neighbours_keep_their_tokens(engine):
    free = [_params(None, max_tokens=12, ignore_eos=True), _params(None, max_tokens=12, temperature=0.8, seed=5)]
    alone = engine.generate(PROMPTS[:2], free)
    mixed = engine.generate(PROMPTS[:2] + PROMPTS[2:5], free + [_params(c) for c, _ in list(CASES.values())[:3]])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]


def test_max_tokens_cuts_a_grammar_short_with_length(engine):
    [out] = engine.generate(PROMPTS[:1], _params({"json": SCHEMA, "disable_any_whitespace": True}, max_tokens=4))
    assert out.finish_reason == "length" and out.num_generated_tokens == 4
    assert out.text.startswith("{")


def _kv_budget(folder, num_tokens: int, block_size: int = 8) -> int:
    from batchgen_data.model import MoEModel

    specs = MoEModel.from_pretrained(folder).kv_specs
    return KVCache.bytes_per_block(specs, block_size) * (-(-num_tokens // block_size))


def test_suspended_and_recomputed_sequence_keeps_its_grammar(folder, engine):
    constraint = {"json": SCHEMA, "disable_any_whitespace": True}
    prompts = PROMPTS * 2
    expected = [o.text for o in engine.generate(prompts, _params(constraint))]
    tight = EngineConfig(block_size=8, max_num_seqs=12, max_num_batched_tokens=64, swap_space_bytes=0,
                         kv_cache_memory_bytes=_kv_budget(folder, 200))
    with Engine(folder, tight) as small:
        outs = small.generate(prompts, _params(constraint))
        stats = small.executor.scheduler.stats
    assert stats.num_resumed_recompute > 0, "the KV budget should force suspension with recompute"
    assert [o.text for o in outs] == expected
    assert all(_valid_json(o.text) for o in outs)


@pytest.mark.parametrize("with_kv", [True, False], ids=["kv-shipped", "kv-recomputed"])
def test_constrained_sequence_migrates_mid_generation(folder, engine, with_kv):
    constraint = {"json": SCHEMA, "disable_any_whitespace": True}
    expected = [o.text for o in engine.generate(PROMPTS, _params(constraint))]
    source, target = Engine(folder, EngineConfig(block_size=8)), Engine(folder, EngineConfig(block_size=8))
    with source, target:
        seqs = [source.add_request(p, _params(constraint)) for p in PROMPTS]
        for _ in range(5):
            source.step()
        moved = [i for i, s in enumerate(seqs) if s.status is SequenceStatus.RUNNING and s.num_generated]
        assert len(moved) >= 2
        imported = {i: target.import_sequence(source.export_sequence(seqs[i], with_kv=with_kv)) for i in moved}
        for eng in (source, target):
            while eng.has_unfinished_requests():
                eng.step()
        texts = [imported[i].output if i in imported else s.output for i, s in enumerate(seqs)]
    assert [t.text for t in texts] == expected
    assert all(t.finish_reason == "stop" and _valid_json(t.text) for t in texts)


def test_stop_strings_still_apply_to_constrained_rows(engine):
    regex = r"[a-z]{3} [a-z]{3} [a-z]{3}"
    [free, stopped] = engine.generate(PROMPTS[:1] * 2, [_params({"regex": regex}), _params({"regex": regex}, stop=" ")])
    assert re.fullmatch(regex, free.text)
    assert stopped.finish_reason == "stop" and stopped.text == free.text.split(" ")[0]
