"""Speculative decoding with the checkpoint's Multi-Token-Prediction layer (``method: "mtp"``):
its drafts against a ``transformers`` reference of the layer at every step, and tokens identical
to decoding without drafts (N=2 expert-parallel ranks: ``test_speculative.py``)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_checkpoints import build_checkpoint

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.errors import BatchGenError

MTP = {"method": "mtp", "num_speculative_tokens": 3}


class Recording:
    """Drafts from ``inner`` (some right, some wrong: every acceptance length occurs) while
    recording the MTP layer's drafts each row holds when asked: (its tokens, the drafts)."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def propose(self, seq, k):
        if seq.mtp_draft is not None and seq.mtp_draft[0] == seq.num_tokens:
            self.seen.append((list(seq.prompt_token_ids) + list(seq.output_token_ids), list(seq.mtp_draft[1])))
        return self.inner.propose(seq, k)


class PartlyRight:
    def __init__(self, outputs, seed=0):
        self.outputs, self.rng = outputs, random.Random(seed)

    def propose(self, seq, k):
        known = self.outputs.get(tuple(seq.prompt_token_ids), [])[seq.num_generated : seq.num_generated + k]
        cut = self.rng.randrange(len(known) + 1)
        return known[:cut] + [(t + 7) % 50 + 4 for t in known[cut : cut + 1]] + known[cut + 1 :]


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def reference_drafts(main, longer, mtp: dict, tokens: list[int], k: int) -> list[int]:
    """The MTP layer written out with ``transformers``' own decoder layer: position i takes the
    main model's output state h_i (after its final norm) and embed(t_{i+1}) (zero at position
    0); the last position's logits give d_1, and each further draft runs one position on."""
    n = len(tokens) - 1
    cfg = main.config
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    h = main.model(torch.tensor([tokens[:n]])).last_hidden_state[0]  # [n, H]
    e = main.model.embed_tokens(torch.tensor(tokens[1:]))
    e[0] = 0.0

    def combine(e, h):
        x = torch.cat([_rms(e, mtp[prefix + "enorm.weight"], cfg.rms_norm_eps),
                       _rms(h, mtp[prefix + "hnorm.weight"], cfg.rms_norm_eps)], dim=-1)
        return x @ mtp[prefix + "eh_proj.weight"].T

    x = combine(e, h)
    layer = longer.model.layers[cfg.num_hidden_layers]
    drafts = []
    for _ in range(k):
        pos = torch.arange(x.shape[0])[None]
        y = layer(x[None], attention_mask=None, position_ids=pos,
                  position_embeddings=longer.model.rotary_emb(x[None], pos))[0]
        logits = _rms(y[-1], mtp[prefix + "shared_head.norm.weight"], cfg.rms_norm_eps) @ main.lm_head.weight.T
        drafts.append(int(logits.argmax()))
        x = torch.cat([x, combine(main.model.embed_tokens(torch.tensor([drafts[-1]])), y[-1:])])
    return drafts


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_mtp_drafts_match_a_transformers_reference(mtp_checkpoint, arch):
    """Every draft the layer made, through prefill, decode steps with accepted and rejected
    drafts and block boundaries, equals the reference over the row's tokens at that point."""
    folder, main, longer, mtp = mtp_checkpoint(arch)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57], [77]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = Engine(folder, EngineConfig(block_size=8)).generate(prompts, params)
    engine = Engine(folder, EngineConfig(block_size=8, speculative_config=MTP))
    drafter = engine.executor.scheduler.drafter
    drafter.proposer = recording = Recording(PartlyRight({tuple(p): list(o.token_ids) for p, o in zip(prompts, plain)}))
    drafter.fixed_length = 3
    outs = engine.generate(prompts, params)
    engine.close()
    assert [list(o.token_ids) for o in outs] == [list(o.token_ids) for o in plain]
    assert drafter.stats.num_accepted_tokens > 0 and len(recording.seen) >= 12
    lengths = {len(d) for _, d in recording.seen}
    assert 3 in lengths and min(lengths) >= 1
    for tokens, drafts in recording.seen:
        assert drafts == reference_drafts(main, longer, mtp, tokens, len(drafts)), tokens


@pytest.mark.parametrize("swap", [0, 1 << 30])
def test_mtp_drafts_survive_suspension(mtp_checkpoint, swap):
    """A KV pool too small for the running set: rows are suspended and come back by recompute
    (no swap space) or swap-in; the layer's KV comes back with them (its drafts still equal the
    reference) and the tokens are the plain run's."""
    from batchgen_data.model import MoEModel
    from batchgen_data.model.kv_cache import KVCache

    folder, main, longer, mtp = mtp_checkpoint("deepseek_v3")
    rng = random.Random(4)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.choice([3, 9, 20]))] for _ in range(10)]
    params = SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)
    budget = KVCache.bytes_per_block(MoEModel.from_pretrained(folder, with_mtp=True).kv_specs, 8) * 14
    config = dict(block_size=8, max_num_seqs=10, max_num_batched_tokens=64, kv_cache_memory_bytes=budget,
                  swap_space_bytes=swap, refill_threshold=1.0)
    plain = Engine(folder, EngineConfig(**config)).generate(prompts, params)
    engine = Engine(folder, EngineConfig(**config, speculative_config=MTP))
    drafter = engine.executor.scheduler.drafter
    drafter.proposer = recording = Recording(PartlyRight({tuple(p): list(o.token_ids) for p, o in zip(prompts, plain)}, 4))
    drafter.fixed_length = 3
    outs = engine.generate(prompts, params)
    suspended = engine.stats().num_suspended
    engine.close()
    assert [list(o.token_ids) for o in outs] == [list(o.token_ids) for o in plain]
    assert suspended > 0 and drafter.stats.num_accepted_tokens > 0
    for tokens, drafts in recording.seen:
        assert drafts == reference_drafts(main, longer, mtp, tokens, len(drafts)), tokens


@pytest.mark.parametrize("seeded", [False, True])
def test_tokens_identical_with_mtp_drafts(mtp_checkpoint, seeded):
    """The layer's own drafts, chosen by the policy (no fixed length), greedy and seeded rows,
    with the prefix cache on: the same tokens as plain decoding."""
    folder, *_ = mtp_checkpoint("deepseek_v3")
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.choice([3, 9, 20]))] for _ in range(6)]
    prompts += [prompts[0][:] for _ in range(2)]  # shared prefixes
    params = [SamplingParams(max_tokens=rng.choice([6, 20, 40]), temperature=0.8 if seeded else 0, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]
    config = dict(block_size=8, enable_prefix_caching=True)
    plain = Engine(folder, EngineConfig(**config)).generate(prompts, params)
    engine = Engine(folder, EngineConfig(**config, speculative_config=MTP))
    outs = engine.generate(prompts, params)
    stats = engine.executor.scheduler.drafter.stats
    engine.close()
    assert [list(o.token_ids) for o in outs] == [list(o.token_ids) for o in plain]
    assert stats.num_drafted_tokens > 0


def test_mtp_needs_a_checkpoint_with_the_layer(tiny_checkpoint):
    folder, _ = tiny_checkpoint("deepseek_v3")
    with pytest.raises(BatchGenError, match="num_nextn_predict_layers"):
        Engine(folder, EngineConfig(speculative_config=MTP))


def test_mtp_layer_weights_count_once(mtp_checkpoint, tmp_path):
    """The layer's tensors count in the resident weights only when it is loaded; the copies of
    the embedding and head its release format stores are never read."""
    from batchgen_data.model import MoEModel

    folder, *_ = mtp_checkpoint("deepseek_v3")
    without = MoEModel.from_pretrained(folder)
    with_mtp = MoEModel.from_pretrained(folder, with_mtp=True)
    plain = tmp_path / "plain"
    build_checkpoint("deepseek_v3", plain)
    assert without.dense_weight_bytes == MoEModel.from_pretrained(plain).dense_weight_bytes
    layer = with_mtp.mtp
    own = sum(t.numel() for t in (layer.enorm, layer.hnorm, layer.eh_proj, layer.head_norm)) * 4
    assert with_mtp.dense_weight_bytes > without.dense_weight_bytes + own
    assert layer.head is with_mtp.lm_head and layer.embed_tokens is with_mtp.embed_tokens
    assert len(with_mtp.kv_specs) == len(without.kv_specs) + 1


def test_the_layer_drafts_only_what_the_policy_would_keep():
    """The runner drafts (each token costs the layer and the head once more) only as far as the
    policy would keep a draft next step: k for rows whose drafts hold, nothing for rows whose
    drafts fail or for a large running set, 1 token when a probe is due."""
    from types import SimpleNamespace

    from batchgen_data.engine.spec.drafter import Drafter
    from batchgen_data.engine.spec.policy import PROBE_EVERY, RowAcceptance
    from batchgen_data.config.speculative import SpeculativeConfig

    drafter = Drafter(SpeculativeConfig(**MTP), max_model_len=256)
    for q in range(1, 65):  # a memory-bound step at few tokens, compute-bound at many
        drafter.observe(q, 0.002 + 0.0006 * q)

    def rows(n, accepted, rejected):
        return [SimpleNamespace(draft_acceptance=RowAcceptance(accepted=accepted, rejected=rejected)) for _ in range(n)]

    assert drafter.lookahead(rows(2, 9, 1)) == 3
    assert drafter.lookahead(rows(48, 9, 1)) == 0
    drafter.job_acceptance = RowAcceptance(accepted=0, rejected=40)
    assert drafter.lookahead(rows(2, 0, 8)) == 0
    drafter._steps_since_probe = PROBE_EVERY - 1
    assert drafter.lookahead(rows(2, 0, 8)) == 1
    drafter.enabled = False
    assert drafter.lookahead(rows(2, 9, 1)) == 0
