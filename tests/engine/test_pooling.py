"""Pooling requests (``Engine.embed`` / ``Engine.classify``) with vLLM's semantics: the values
transformers computes on the same checkpoint, whatever shares the forward, however the prompt is
chunked, and with their KV freed the step they finish."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from tiny_checkpoints import build_checkpoint, build_classifier_checkpoint

from batchgen_data import ConfigError, Engine, EngineConfig, SamplingParams
from batchgen_data.engine.async_engine import AsyncEngine
from batchgen_data.engine.pooling_params import PoolingParams

# No token 0 (the tiny checkpoints' pad id, which transformers' classifier skips as padding).
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 75)), [100], [7, 300, 42, 17, 99],
           list(range(200, 236))]
ATOL = 1e-4  # fp32, against transformers
SAME_ATOL = 1e-5  # fp32, the engine against itself under another batch composition


def _hf_states(hf, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The final-normed hidden state at each prompt's last position, one prompt at a time."""
    base = hf.model if hasattr(hf, "model") else hf
    with torch.no_grad():
        return [base(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]


def _close(values: list[float] | None, ref: torch.Tensor, atol: float = ATOL) -> bool:
    return values is not None and len(values) == len(ref) and torch.allclose(torch.tensor(values), ref, atol=atol)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt-qwen3-moe-cls")
    return folder, build_classifier_checkpoint("qwen3_moe", folder, num_labels=3)


@pytest.fixture(scope="module")
def matryoshka(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt-qwen3-moe-mrl")
    return folder, build_checkpoint("qwen3_moe", folder, matryoshka_dimensions=[16, 32])


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_embeddings_are_transformers_last_normed_state_l2_normalized(tiny_checkpoint, arch):
    folder, hf = tiny_checkpoint(arch)
    states = _hf_states(hf, PROMPTS)
    engine = Engine(folder, EngineConfig(max_num_seqs=8, block_size=8))
    outs = engine.embed(PROMPTS)
    assert all(o.finish_reason == "stop" and o.error is None for o in outs)
    assert all(o.num_generated_tokens == 0 and o.token_ids == [] and o.text == "" for o in outs)
    assert all(_close(o.embeddings, F.normalize(s, dim=-1)) for o, s in zip(outs, states))
    raw = engine.embed(PROMPTS, PoolingParams(normalize=False))
    assert all(_close(o.embeddings, s) for o, s in zip(raw, states))


def test_demo_model_embeddings_match_transformers(demo_path):
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(demo_path), dtype=torch.float32).eval()
    engine = Engine("demo")
    prompts = [engine.tokenizer.encode(text) for text in ("Hello world", "Embed this support ticket, please.")]
    outs = engine.embed(prompts)
    assert all(_close(o.embeddings, F.normalize(s, dim=-1)) for o, s in zip(outs, _hf_states(hf, prompts)))
    assert len(outs[0].embeddings) == engine.model_config.hidden_size


def test_dimensions_truncate_then_normalize_on_a_matryoshka_checkpoint(matryoshka, demo_path):
    folder, hf = matryoshka
    states = _hf_states(hf, PROMPTS[:3])
    engine = Engine(folder, EngineConfig(max_num_seqs=8, block_size=8))
    outs = engine.embed(PROMPTS[:3], PoolingParams(dimensions=16))
    assert all(_close(o.embeddings, F.normalize(s[:16], dim=-1)) for o, s in zip(outs, states))
    [unsupported] = engine.embed(PROMPTS[:1], PoolingParams(dimensions=8))
    assert unsupported.finish_reason == "error" and "supports [16, 32]" in unsupported.error
    [plain] = Engine("demo").embed(["Hello"], PoolingParams(dimensions=8))
    assert plain.finish_reason == "error" and "matryoshka" in plain.error


def test_classify_gives_softmax_of_transformers_classifier_logits(classifier):
    folder, hf = classifier
    with torch.no_grad():
        logits = [hf(torch.tensor([p])).logits[0] for p in PROMPTS]
    engine = Engine(folder, EngineConfig(max_num_seqs=8, block_size=8))
    outs = engine.classify(PROMPTS)
    assert all(o.error is None and o.finish_reason == "stop" for o in outs)
    assert all(_close(o.embeddings, torch.softmax(ref, dim=-1)) for o, ref in zip(outs, logits))
    raw = engine.classify(PROMPTS, PoolingParams(use_activation=False))
    assert all(_close(o.embeddings, ref) for o, ref in zip(raw, logits))


def test_a_single_label_head_uses_sigmoid(tmp_path):
    hf = build_classifier_checkpoint("mixtral", tmp_path, num_labels=1)
    with torch.no_grad():
        logits = [hf(torch.tensor([p])).logits[0] for p in PROMPTS[:3]]
    outs = Engine(tmp_path, EngineConfig(max_num_seqs=8)).classify(PROMPTS[:3])
    assert all(_close(o.embeddings, torch.sigmoid(ref)) for o, ref in zip(outs, logits))


def test_classify_without_a_head_and_generate_on_a_classifier_are_clear_errors(demo_path, classifier):
    [no_head] = Engine("demo").classify(["Is this spam?"])
    assert no_head.finish_reason == "error" and no_head.embeddings is None
    assert "classify needs a sequence-classification head" in no_head.error
    [no_lm_head] = Engine(classifier[0]).generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert no_lm_head.finish_reason == "error" and "sequence classifier" in no_lm_head.error


def test_pooling_rows_join_the_forwards_of_generating_rows_under_chunked_prefill(tiny_checkpoint):
    """Embeddings and tokens are those of each row run alone, while pooling chunks, prefill
    chunks and decode steps share forwards (and so the combined expert batches)."""
    folder, hf = tiny_checkpoint("qwen3_moe")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone_engine = Engine(folder, EngineConfig(max_num_seqs=8, block_size=8))
    alone_tokens = [alone_engine.generate([p], greedy)[0].token_ids for p in PROMPTS[:3]]
    alone_embeddings = [alone_engine.embed([p])[0].embeddings for p in PROMPTS]
    alone_raw = [alone_engine.embed([p], PoolingParams(normalize=False))[0].embeddings for p in PROMPTS]

    engine = Engine(folder, EngineConfig(max_num_seqs=8, attention_batch_size=3, max_num_batched_tokens=16,
                                         block_size=8, enable_prefix_caching=False))
    steps = []  # per forward: (pooling tokens, pooling rows completed, decode tokens)
    execute = engine.executor.runner.execute

    def recording_execute(out):
        pooling = [(q, last) for s, q, last in zip(out.seqs, out.query_lens, out.samples) if s.is_pooling]
        decode = sum(q for s, q in zip(out.seqs, out.query_lens) if not s.is_pooling and q == 1)
        steps.append((sum(q for q, _ in pooling), sum(last for _, last in pooling), decode))
        return execute(out)

    engine.executor.runner.execute = recording_execute
    params = [greedy] * 3 + [PoolingParams(task="embed")] * len(PROMPTS) + \
             [PoolingParams(task="embed", normalize=False)] * len(PROMPTS)
    outs = engine.generate(PROMPTS[:3] + PROMPTS + PROMPTS, params)
    n = len(PROMPTS)
    assert [o.token_ids for o in outs[:3]] == alone_tokens
    assert all(_close(o.embeddings, torch.tensor(e), SAME_ATOL) for o, e in zip(outs[3:3 + n], alone_embeddings))
    assert all(_close(o.embeddings, torch.tensor(e), SAME_ATOL) for o, e in zip(outs[3 + n:], alone_raw))
    states = _hf_states(hf, PROMPTS)
    assert all(_close(o.embeddings, F.normalize(s, dim=-1)) for o, s in zip(outs[3:3 + n], states))
    assert any(pool_tokens and decode for pool_tokens, _, decode in steps)  # combined forwards
    assert sum(completed for _, completed, _ in steps) == 2 * n
    assert sum(pool_tokens for pool_tokens, _, _ in steps) == 2 * sum(map(len, PROMPTS))  # each token once
    assert len(steps) > 2 * sum(map(len, PROMPTS)) // 16  # a 45-token prompt ran in chunks of <= 16


def test_a_pooling_rows_blocks_are_freed_in_the_step_it_finishes(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3_moe")
    engine = Engine(folder, EngineConfig(max_num_seqs=8, block_size=8))
    scheduler = engine.executor.scheduler
    generating = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    pooling = engine.add_request(PROMPTS[2], PoolingParams(task="embed"))
    while not pooling.is_finished:
        engine.step()
    assert not generating.is_finished
    assert [s.request_id for s in scheduler.running] == [generating.request_id]
    assert engine.executor.blocks.num_used == len(scheduler.running[0].block_ids)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.executor.blocks.num_used == 0


def test_pooling_rows_take_a_shared_prefix_from_the_cache_only_when_asked(tiny_checkpoint):
    """By default a pooled row computes its whole prompt, so identical prompts give identical
    embeddings whatever was cached (Ray Data LLM's tests compare them with ==); with
    ``skip_reading_prefix_cache=False`` (vLLM's default for LAST pooling) it takes the cached
    prefix, and its embedding is equal to float precision."""
    folder, _ = tiny_checkpoint("qwen3_moe")
    prefix = list(range(100, 140))
    prompts = [prefix + [7, 8, 9], prefix + [11, 12]]
    engine = Engine(folder, EngineConfig(max_num_seqs=8, block_size=8))
    first, again = engine.embed(prompts[:1])[0], engine.embed(prompts[:1])[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 0
    assert again.embeddings == first.embeddings  # bitwise
    cached = Engine(folder, EngineConfig(max_num_seqs=8, block_size=8))
    reading = PoolingParams(skip_reading_prefix_cache=False)
    first, second = cached.embed(prompts[:1], reading)[0], cached.embed(prompts[1:], reading)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 40
    uncached = Engine(folder, EngineConfig(max_num_seqs=8, block_size=8, enable_prefix_caching=False)).embed(prompts)
    assert _close(second.embeddings, torch.tensor(uncached[1].embeddings), SAME_ATOL)


def test_a_pooling_row_migrates_mid_prefill(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3_moe")
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=8)
    [reference] = Engine(folder, config).embed([PROMPTS[2]])
    source, target = Engine(folder, config), Engine(folder, config)
    handle = source.add_request(PROMPTS[2], PoolingParams(task="embed"))
    source.step()  # one 16-token chunk of 45
    state = source.export_sequence(handle, with_kv=True)
    moved = target.import_sequence(state)
    while not moved.is_finished:
        target.step()
    assert _close(moved.output.embeddings, torch.tensor(reference.embeddings), SAME_ATOL)


def test_a_pooling_prompt_may_fill_the_context(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3_moe")
    engine = Engine(folder, EngineConfig(max_num_seqs=4, block_size=8, max_model_len=16))
    prompt = list(range(10, 26))  # 16 tokens: no room for a generated one, none needed
    assert engine.embed([prompt])[0].error is None
    assert "context limit is 16" in engine.generate([prompt])[0].error
    [truncated] = engine.embed([prompt + [5, 6]], PoolingParams(truncate_prompt_tokens=-1))
    assert truncated.num_input_tokens == 16


def test_async_engine_runs_pooling_params_beside_sampling_params(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3_moe")
    engine = Engine(folder, EngineConfig(max_num_seqs=8, block_size=8))
    [expected] = engine.embed(PROMPTS[:1])
    aengine = AsyncEngine(engine)

    async def both():
        return await asyncio.gather(aengine.generate(PROMPTS[:1], PoolingParams(task="embed")),
                                    aengine.generate(PROMPTS[1:2], SamplingParams(max_tokens=3)))

    try:
        [embedded], [generated] = asyncio.run(both())
    finally:
        aengine.shutdown()
    assert _close(embedded.embeddings, torch.tensor(expected.embeddings), SAME_ATOL)
    assert generated.num_generated_tokens == 3 and generated.embeddings is None


@pytest.mark.timeout(300)
def test_expert_parallel_ranks_pool_like_one_process(classifier):
    folder, _ = classifier
    single = Engine(folder, EngineConfig(max_num_seqs=4, block_size=8))
    expected_probs, expected_embeddings = single.classify(PROMPTS), single.embed(PROMPTS)
    engine = Engine(folder, EngineConfig(expert_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=16,
                                         block_size=8))
    try:
        probs, embeddings = engine.classify(PROMPTS), engine.embed(PROMPTS)
        ranks = engine.stats().ranks
    finally:
        engine.close()
    for got, want in zip(probs + embeddings, expected_probs + expected_embeddings):
        assert _close(got.embeddings, torch.tensor(want.embeddings), SAME_ATOL)
    assert all(rank.num_forward_tokens > 0 for rank in ranks)  # pooling rows spread over the ranks


def test_pooling_params_take_vllms_names_and_refuse_what_vllm_refuses():
    assert PoolingParams(task="embed").normalize is True
    assert PoolingParams(task="classify").use_activation is True
    assert PoolingParams().for_task("embed") == PoolingParams(task="embed", normalize=True)
    assert PoolingParams.from_dict({"dimensions": 32, "normalize": None}).dimensions == 32
    assert PoolingParams().max_tokens == 0
    for bad, message in [
        (dict(task="score"), "task must be one of"),
        (dict(dimensions=0), "dimensions must be an int >= 1"),
        (dict(normalize="yes"), "normalize must be a bool"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(task="classify", normalize=True), "task 'classify' takes ['use_activation']"),
        (dict(task="embed", use_activation=False), "task 'embed' takes ['dimensions', 'normalize']"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            PoolingParams(**bad)
    with pytest.raises(ConfigError, match="cannot run as task 'embed'"):
        PoolingParams(task="classify").for_task("embed")
    with pytest.raises(ConfigError, match="unknown pooling parameter"):
        PoolingParams.from_dict({"softmax": True})
