"""logprobs and prompt_logprobs against transformers, and through suspension, MIGRATE and
chunked prefill: the same values wherever the sequence ran."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.engine.core.sequence import SequenceStatus
from batchgen_data.errors import ConfigError
from batchgen_data.model import MoEModel
from batchgen_data.model.kv_cache import KVCache
from batchgen_data.model.native import active_native

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 40, 41], [20, 21, 22], list(range(30, 62)), [100, 7, 300, 42, 17, 99]]
MAX_NEW = 6
TOL = 2e-4  # fp32 noise between two implementations of the same model


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "logprobs": 3,
                             "prompt_logprobs": 2, **kw})


def _hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [T, V]


def _check_position(entry: dict, reference: torch.Tensor, token: int, k: int) -> None:
    """One position: the token first, with its logprob and rank, then the top k in order."""
    assert next(iter(entry)) == token
    assert abs(entry[token].logprob - reference[token].item()) < TOL
    assert entry[token].rank == int((reference >= reference[token]).sum())
    top = reference.topk(k)
    listed = [t for t in entry if t != token or entry[t].rank <= k]
    assert sorted(listed, key=lambda t: entry[t].rank)[:k] == top.indices.tolist()
    for rank, (value, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        assert abs(entry[t].logprob - value) < TOL and entry[t].rank == rank
    assert len(entry) in (k, k + 1)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_logprobs_and_prompt_logprobs_match_transformers(tiny_checkpoint, arch):
    folder, hf = tiny_checkpoint(arch)
    with Engine(folder, EngineConfig(block_size=8)) as engine:
        outs = engine.generate(PROMPTS, _params())
    for prompt, out in zip(PROMPTS, outs):
        reference = _hf_logprobs(hf, prompt, out.token_ids)
        assert len(out.logprobs) == MAX_NEW
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            _check_position(entry, reference[len(prompt) - 1 + i], token, 3)
            assert entry[token].decoded_token == engine.tokenizer.decode([token], skip_special_tokens=False)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            _check_position(out.prompt_logprobs[j], reference[j - 1], prompt[j], 2)


@pytest.fixture(params=["native", "torch"])
def kernels(request, monkeypatch):
    """The engine with its native kernels (one read of each logits row for the capture) or with
    torch's passes only."""
    from batchgen_data.model import native

    if request.param == "torch":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.load_native.cache_clear()
    yield request.param
    native.load_native.cache_clear()
    native.use_native_kernels(False)


def test_logprobs_match_transformers_in_every_mode(tiny_checkpoint, kernels):
    """One batch mixing every way a row asks: greedy and seeded sampling, k = 0, 5 and 20, a
    row without logprobs, and a row whose logit_bias changes its sampling but not its logprobs
    (vLLM's raw logprobs); then a batch of greedy rows only (the argmax and the capture in one
    read of each row). Every value against transformers' log-softmax."""
    folder, hf = tiny_checkpoint("qwen3_moe")
    prompts = PROMPTS + [[9, 8, 7, 6]]
    mixed = [_params(logprobs=5, temperature=0.9, seed=3, prompt_logprobs=None),
             _params(logprobs=0, prompt_logprobs=None),
             SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
             _params(logprobs=2, logit_bias={11: 5.0, 12: -3.0}, prompt_logprobs=None),
             _params(logprobs=20, temperature=0.7, seed=11, prompt_logprobs=5)]
    with Engine(folder, EngineConfig(block_size=8)) as engine:
        assert (active_native() is not None) == (kernels == "native")
        outs = engine.generate(prompts, mixed)
        greedy = engine.generate(prompts, _params(logprobs=4, prompt_logprobs=None))
    rows = [*((p, o, params.logprobs) for p, o, params in zip(prompts, outs, mixed)),
            *((p, o, 4) for p, o in zip(prompts, greedy))]
    for prompt, out, k in rows:
        if k is None:
            assert out.logprobs is None
            continue
        reference = _hf_logprobs(hf, prompt, out.token_ids)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            _check_position(entry, reference[len(prompt) - 1 + i], token, k)
    for j in range(1, len(prompts[4])):
        _check_position(outs[4].prompt_logprobs[j], _hf_logprobs(hf, prompts[4], [])[j - 1], prompts[4][j], 5)


def _collect(outs) -> list:
    return [[{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in o.logprobs] for o in outs]


def _close(a, b) -> bool:
    return all(ea.keys() == eb.keys() and all(math.isclose(ea[t][0], eb[t][0], abs_tol=1e-5) and ea[t][1] == eb[t][1]
                                            for t in ea)
               for xa, xb in zip(a, b) for ea, eb in zip(xa, xb))


def test_logprobs_survive_suspension_recompute_and_chunked_prefill(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3_moe")
    prompts = PROMPTS * 3
    params = _params(max_tokens=30)  # sequences outgrow their pages: some are suspended
    with Engine(folder, EngineConfig(block_size=8)) as engine:
        expected = engine.generate(prompts, params)
    specs = MoEModel.from_pretrained(folder).kv_specs
    tight = EngineConfig(block_size=8, max_num_seqs=12, max_num_batched_tokens=16, swap_space_bytes=0,
                         kv_cache_memory_bytes=KVCache.bytes_per_block(specs, 8) * 20)
    with Engine(folder, tight) as engine:
        outs = engine.generate(prompts, params)
        assert engine.executor.scheduler.stats.num_resumed_recompute > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert _close(_collect(outs), _collect(expected))
    for got, want in zip(outs, expected):
        assert [None if e is None else list(e) for e in got.prompt_logprobs] == \
               [None if e is None else list(e) for e in want.prompt_logprobs]


@pytest.mark.parametrize("with_kv", [True, False], ids=["kv-shipped", "kv-recomputed"])
def test_logprobs_travel_with_a_migrated_sequence(tiny_checkpoint, with_kv):
    folder, _ = tiny_checkpoint("qwen3_moe")
    with Engine(folder, EngineConfig(block_size=8)) as engine:
        expected = engine.generate(PROMPTS, _params())
    source, target = Engine(folder, EngineConfig(block_size=8)), Engine(folder, EngineConfig(block_size=8))
    with source, target:
        seqs = [source.add_request(p, _params()) for p in PROMPTS]
        for _ in range(3):
            source.step()
        moved = [i for i, s in enumerate(seqs) if s.status is SequenceStatus.RUNNING and s.num_generated]
        assert moved
        imported = {i: target.import_sequence(source.export_sequence(seqs[i], with_kv=with_kv)) for i in moved}
        for eng in (source, target):
            while eng.has_unfinished_requests():
                eng.step()
        outs = [imported[i].output if i in imported else s.output for i, s in enumerate(seqs)]
    assert _close(_collect(outs), _collect(expected))
    assert all(len(o.prompt_logprobs) == len(p) for o, p in zip(outs, PROMPTS))


def test_prompt_logprobs_take_no_cached_prefix_and_requests_without_pay_nothing(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3_moe")
    shared = list(range(30, 62))
    with Engine(folder, EngineConfig(block_size=8)) as engine:
        [first] = engine.generate([shared + [1]], SamplingParams(max_tokens=2, temperature=0))
        [cached, full] = engine.generate([shared + [2], shared + [3]],
                                         [SamplingParams(max_tokens=2, temperature=0), _params(max_tokens=2)])
    assert first.logprobs is None and first.prompt_logprobs is None
    assert cached.num_cached_tokens > 0 and cached.logprobs is None
    assert full.num_cached_tokens == 0 and len(full.prompt_logprobs) == len(shared) + 1


@pytest.mark.parametrize("bad", [{"logprobs": -1}, {"logprobs": 21}, {"prompt_logprobs": 2.5}, {"logprobs": True}])
def test_out_of_range_logprobs_are_config_errors(bad):
    with pytest.raises(ConfigError, match="logprobs must be an int in \\[0, 20\\]"):
        SamplingParams(**bad)


def test_token_texts_decoded_in_one_call_equal_decoding_each_token(demo_path):
    """``decode_each`` (logprobs' ``decoded_token``, one Rust call) against ``decode([t])`` per
    token on the demo's tokenizer: special tokens, byte-level pieces and the model's padding ids
    beyond the tokenizer."""
    import random

    from batchgen_data.engine.tokenizer import PromptTokenizer
    from batchgen_data.model import ModelConfig

    config = ModelConfig.from_pretrained(demo_path)
    tokenizer = PromptTokenizer(demo_path, config.vocab_size)
    ids = random.Random(0).sample(range(config.vocab_size), 2000) + list(tokenizer.hf.all_special_ids)
    ids += list(range(len(tokenizer.hf), config.vocab_size, 7))
    assert tokenizer.decode_each(ids) == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
