"""The compiled CPU kernels compute what torch computes, on shapes they were not tuned for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen_data.model import gemm_tuning
from batchgen_data.model import layers
from batchgen_data.model.gemm_tuning import GemmPlan, tune
from batchgen_data.model.native import ENV_SWITCH, load_native


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 33), n=st.integers(1, 70), k=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_skinny_linear_matches_a_matmul(native, rows, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    out = native.skinny_linear(x, w)
    assert out.shape == (rows, n) and out.is_contiguous()
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-4)


def test_skinny_linear_takes_a_strided_weight_row_of_a_stacked_tensor(native):
    stacked = torch.randn(4, 96, 64)  # [E, N, K]: an expert's row is a contiguous view
    x = torch.randn(3, 64)
    torch.testing.assert_close(native.skinny_linear(x, stacked[2]), x @ stacked[2].T, rtol=1e-5, atol=1e-4)
    transposed = torch.randn(64, 96).T  # not contiguous: copied, still right
    torch.testing.assert_close(native.skinny_linear(x, transposed), x @ transposed.T, rtol=1e-5, atol=1e-4)


def _gathered_sdpa(q, k_cache, v_cache, table, ctx, scale, window):
    """The torch path: gather the pages, mask, SDPA."""
    b, nq, d = q.shape
    num_blocks, bs, nkv, _ = k_cache.shape
    p = table.shape[1]
    keys = k_cache[table].reshape(b, p * bs, nkv, d).transpose(1, 2)
    values = v_cache[table].reshape(b, p * bs, nkv, d).transpose(1, 2)
    pos = torch.arange(p * bs)
    mask = pos[None, :] < ctx[:, None]
    if window:
        mask &= pos[None, :] > ctx[:, None] - 1 - window
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask[:, None, None], scale=scale,
                                         enable_gqa=nq != nkv)
    return out.reshape(b, nq * d)


@settings(max_examples=40, deadline=None)
@given(seqs=st.integers(1, 12), kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 4]),
       head_dim=st.sampled_from([8, 32, 64, 80]), block_size=st.sampled_from([1, 4, 16]),
       max_ctx=st.integers(1, 70), window=st.sampled_from([0, 1, 5, 32]), seed=st.integers(0, 2**16))
def test_paged_decode_attention_matches_gathered_sdpa(native, seqs, kv_heads, group, head_dim, block_size, max_ctx,
                                                      window, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = seqs * (-(-max_ctx // block_size)) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    ctx = torch.randint(1, max_ctx + 1, (seqs,), generator=g)
    pages = -(-int(ctx.max()) // block_size)
    table = torch.randperm(num_blocks, generator=g)[: seqs * pages].view(seqs, pages)  # pages in any order
    q = torch.randn(seqs, kv_heads * group, head_dim, generator=g)
    scale = head_dim**-0.5
    out = native.paged_decode_attention(q, k_cache, v_cache, table, ctx, scale, window)
    torch.testing.assert_close(out, _gathered_sdpa(q, k_cache, v_cache, table, ctx, scale, window),
                               rtol=1e-4, atol=1e-5)


def test_paged_decode_attention_drops_negligible_weights_and_carries_nan(native):
    """Scores more than 87 below the row's maximum weigh 0 (as exp underflows in SDPA), and a
    NaN key makes its query heads' outputs NaN, as SDPA's do."""
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(4, 16, 2, 32, generator=g), torch.randn(4, 16, 2, 32, generator=g)
    table, ctx = torch.tensor([[0, 1], [2, 3]]), torch.tensor([30, 25])
    q = 40 * torch.randn(2, 4, 32, generator=g)  # scores spread over hundreds: most weights underflow
    out = native.paged_decode_attention(q, k_cache, v_cache, table, ctx, 32**-0.5, 0)
    torch.testing.assert_close(out, _gathered_sdpa(q, k_cache, v_cache, table, ctx, 32**-0.5, 0), rtol=1e-4, atol=1e-5)
    k_cache[2, 3, 1, 5] = float("nan")  # sequence 1, token 3, KV head 1: query heads 2 and 3
    out = native.paged_decode_attention(q, k_cache, v_cache, table, ctx, 32**-0.5, 0).view(2, 4, 32)
    ref = _gathered_sdpa(q, k_cache, v_cache, table, ctx, 32**-0.5, 0).view(2, 4, 32)
    assert torch.equal(out.isnan(), ref.isnan()) and out[1, 2:].isnan().all() and not out[0].isnan().any()


def test_the_tuner_tries_a_few_rows_kernel_only_up_to_its_row_limit(monkeypatch):
    seen: dict[str, set[int]] = {"skinny": set(), "linear": set()}

    def spy(name):
        def kernel(x, w):
            seen[name].add(x.shape[0])
            return F.linear(x, w)
        return kernel

    w = torch.randn(8, 16)
    monkeypatch.setitem(gemm_tuning.KERNEL_MAX_ROWS, "skinny", 4)
    tune({(8, 16): [w]}, {(8, 16): 64}, {"skinny": spy("skinny"), "linear": spy("linear")},
         timer=lambda kernel, x, ws: float(x.shape[0]))
    assert max(seen["skinny"]) <= 4 < max(seen["linear"])


def test_a_plan_naming_a_kernel_this_process_lacks_falls_back_to_the_static_rule(monkeypatch):
    monkeypatch.setattr(layers, "_PLAN", GemmPlan({(24, 16): ["skinny"] * 11}))
    monkeypatch.delitem(layers._KERNELS, "skinny", raising=False)
    x, w = torch.randn(3, 16), torch.randn(24, 16)
    torch.testing.assert_close(layers.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


def test_the_switch_turns_the_native_kernels_off(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "0")
    load_native.cache_clear()
    try:
        assert load_native() is None
        assert "skinny" not in gemm_tuning.available_kernels(native=True)
    finally:
        monkeypatch.delenv(ENV_SWITCH)
        load_native.cache_clear()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])  # q/k head norm and a dense layer in the second
def test_the_engine_decodes_through_the_native_kernels_and_matches_transformers(native, tiny_checkpoint, arch,
                                                                                    monkeypatch):
    from tiny_checkpoints import hf_greedy_continuations

    from batchgen_data import Engine, EngineConfig, SamplingParams

    fused_blocks = []

    class CountingLayer:
        @staticmethod
        def attention_block(h, *rest):
            fused_blocks.append(("attention", h.shape[0]))
            return native.decode_layer.attention_block(h, *rest)

        @staticmethod
        def moe_block(h, *rest):
            fused_blocks.append(("moe", h.shape[0]))
            return native.decode_layer.moe_block(h, *rest)

    class CountingLibrary:
        def __getattr__(self, name):
            return getattr(native.library, name)

        @staticmethod
        def decode_forward(h, tokens, *rest):
            fused_blocks.append(("forward", tokens))
            return native.library.decode_forward(h, tokens, *rest)

    class Counting:
        skinny_linear = native.skinny_linear
        paged_decode_attention = native.paged_decode_attention  # decoders in a step with prefill
        decode_layer = CountingLayer()
        library = CountingLibrary()
        first_argmax = native.first_argmax
        swiglu_experts = native.swiglu_experts

    monkeypatch.setattr("batchgen_data.model.native.load_native", lambda: Counting())
    folder, hf = tiny_checkpoint(arch)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 75)), [100]]
    engine = Engine(folder, EngineConfig(max_num_seqs=4, block_size=8))
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy_continuations(hf, prompts, 12)
    # Decode steps of up to 32 rows (fused_decode.MAX_TOKENS) ran every layer in one call where
    # every layer is one the kernels implement (Mixtral), else each block in one call (Qwen3-MoE's
    # dense layer); prefill took the torch path.
    expected = {"forward"} if arch == "mixtral" else {"attention", "moe"}
    assert {kind for kind, _ in fused_blocks} == expected and max(n for _, n in fused_blocks) == 4


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(0, 9), min_size=1, max_size=6), hidden=st.integers(1, 40),
       ffn=st.integers(1, 50), seed=st.integers(0, 2**16))
def test_swiglu_experts_match_the_torch_loop(native, counts, hidden, ffn, seed):
    g = torch.Generator().manual_seed(seed)
    num = len(counts)
    w_gate_up, w_down = torch.randn(num + 1, 2 * ffn, hidden, generator=g), torch.randn(num + 1, hidden, ffn, generator=g)
    x_sorted = torch.randn(sum(counts), hidden, generator=g)
    used = [e for e, n in enumerate(counts) if n]
    starts = [0]
    for e in used:
        starts.append(starts[-1] + counts[e])
    rows = [e + 1 for e in used]  # rows need not equal expert ids
    out = native.swiglu_experts(x_sorted, starts, rows, w_gate_up, w_down)
    expected = torch.zeros_like(x_sorted)
    for e, lo, hi in zip(used, starts, starts[1:]):
        gate, up = (x_sorted[lo:hi] @ w_gate_up[e + 1].T).chunk(2, dim=-1)
        expected[lo:hi] = (F.silu(gate) * up) @ w_down[e + 1].T
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_bad_indices_are_errors_not_stray_reads(native):
    pages = torch.randn(4, 8, 2, 16)
    q = torch.randn(2, 4, 16)
    good_table, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([16, 9])
    native.paged_decode_attention(q, pages, pages, good_table, lens, 0.25, 0)
    with pytest.raises(ValueError, match="block beyond the 4 pages"):
        native.paged_decode_attention(q, pages, pages, torch.tensor([[0, 1], [2, 4]]), lens, 0.25, 0)
    with pytest.raises(ValueError, match="block table does not name"):
        native.paged_decode_attention(q, pages, pages, good_table, torch.tensor([16, 17]), 0.25, 0)
    with pytest.raises(ValueError, match="fp32"):
        native.paged_decode_attention(q.double(), pages, pages, good_table, lens, 0.25, 0)
    w_gate_up, w_down, x = torch.randn(2, 6, 4), torch.randn(2, 4, 3), torch.randn(5, 4)
    native.swiglu_experts(x, [0, 2, 5], [0, 1], w_gate_up, w_down)
    with pytest.raises(ValueError, match="out of range"):
        native.swiglu_experts(x, [0, 2, 5], [0, 2], w_gate_up, w_down)
    with pytest.raises(ValueError, match="out of range"):
        native.swiglu_experts(x, [0, 2, 6], [0, 1], w_gate_up, w_down)
    with pytest.raises(ValueError, match="out of range"):
        native.swiglu_experts(x, [0, 2], [0, 1], w_gate_up, w_down)
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        native.skinny_linear(x, torch.randn(3, 5))


def test_a_library_cut_short_is_built_again(tmp_path, monkeypatch):
    from batchgen_data.model import native as native_pkg

    monkeypatch.setenv("BATCHGEN_DATA_CACHE", str(tmp_path))
    name = native_pkg.library_name()
    library = tmp_path / "native-kernels" / name / f"{name}.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"not a shared library")  # as a build killed while linking leaves it
    (library.parent / "lock").write_text("")  # and torch's lock file, which nobody will release
    native_pkg.load_native.cache_clear()
    try:
        again = native_pkg.load_native()
        if again is None:
            pytest.skip("the native kernels do not build here")
        assert library.stat().st_size > 1000  # rebuilt where later processes look for it
        x, w = torch.randn(2, 8), torch.randn(5, 8)
        torch.testing.assert_close(again.skinny_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    finally:
        native_pkg.load_native.cache_clear()


@pytest.mark.parametrize("arch,num_seqs", [("mixtral", 3), ("qwen3_moe", 3), ("mixtral", 13)])
def test_the_fused_decode_blocks_match_the_torch_path(native, tiny_checkpoint, arch, num_seqs):
    from batchgen_data.model import MoEModel
    from batchgen_data.model.attention.metadata import AttentionBatch, build_attention_metadata
    from batchgen_data.model.native import _ACTIVE, use_native_kernels

    folder, _ = tiny_checkpoint(arch)
    model = MoEModel.from_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    contexts = [int(c) for c in torch.randint(1, 18, (num_seqs,), generator=g)]  # each decodes one token
    blocks = torch.randperm(6 * num_seqs, generator=g).tolist()  # pages in any order
    tables = [blocks[5 * i : 5 * i + -(-c // 4)] for i, c in enumerate(contexts)]
    batch = AttentionBatch.combine([build_attention_metadata([1] * num_seqs, contexts, tables, 4)], model.rotary,
                                   torch.float32)
    h = torch.randn(num_seqs, model.config.hidden_size, generator=g)
    was = _ACTIVE["on"]
    try:
        for layer in model.layers:
            pages = [torch.randn(6 * num_seqs, 4, *shape, generator=g) for shape in layer.attention.kv_spec.shapes]
            results = {}
            for on in (False, True):
                use_native_kernels(on)
                kv = tuple(p.clone() for p in pages)
                results[on] = (layer.attention_block(h, batch, kv), kv, *layer.ffn_block(h))
            (ref, ref_kv, ref_ffn, ref_counts), (out, out_kv, out_ffn, out_counts) = results[False], results[True]
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
            for ours, theirs in zip(out_kv, ref_kv):  # the new K/V in their slots, the rest untouched
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out_ffn, ref_ffn, rtol=1e-4, atol=1e-5)
            assert (out_counts is None and ref_counts is None) or out_counts.tolist() == ref_counts.tolist()
    finally:
        use_native_kernels(was)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 40000), k=st.integers(1, 24), masked=st.floats(0.0, 0.99),
       scale=st.floats(0.1, 80.0), ties=st.booleans(), given_tokens=st.booleans(), seed=st.integers(0, 2**16))
def test_logit_topk_matches_torch(native, rows, vocab, k, masked, scale, ties, given_tokens, seed):
    """Log sum exp within float rounding; the top k, the chosen token and its rank exactly, over
    vocabularies that leave a tail outside the blocks, with masked (-inf) logits, logits far
    from 0 (no shift is safe) and many equal logits (the smaller token id first)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale + scale
    if ties:
        logits = logits.round()
    logits[torch.rand(rows, vocab, generator=g) < masked] = float("-inf")
    logits[:, 0] = torch.randn(rows, generator=g)  # every row keeps one finite logit
    if seed % 3 == 0:
        logits[:, -1] = 1000.0  # the tail's last token is the maximum
    k = min(k, vocab)
    chosen = torch.randint(0, vocab, (rows,), generator=g) if given_tokens else None
    top = native.logit_topk(logits, k, chosen)
    torch.testing.assert_close(top.log_norm, torch.logsumexp(logits.double(), dim=-1).float(),
                               rtol=2e-5, atol=2e-5)  # the portable (non-AVX) build sums serially
    for i in range(rows):  # torch.topk does not order ties: a stable sort does (value down, id up)
        order = torch.sort(logits[i], descending=True, stable=True).indices[:k]
        finite = logits[i, order].isfinite()  # -inf ties (rows of fewer than k finite logits) in any order
        assert top.top_ids[i][finite].tolist() == order[finite].tolist()
        assert torch.equal(top.top_values[i], logits[i, order])
    first_max = (logits == logits.amax(dim=-1, keepdim=True)).int().argmax(dim=-1)  # no NaN here
    expected = first_max if chosen is None else chosen
    assert torch.equal(top.chosen, expected)
    assert torch.equal(top.chosen_value, logits.gather(1, expected[:, None])[:, 0])
    assert torch.equal(top.rank, (logits >= top.chosen_value[:, None]).sum(dim=-1))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 3000), k=st.integers(1, 12), ties=st.booleans(),
       seed=st.integers(0, 2**16))
def test_topk_at_reads_the_named_rows_in_place(native, rows, vocab, k, ties, seed):
    from batchgen_data.engine.sample.kernels import top_ids_at

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    if ties:
        logits = logits.round()
    logits[torch.rand(rows, vocab, generator=g) < 0.2] = float("-inf")
    picked = [r for r in range(rows) if (r + seed) % 2 == 0] or [0]
    k = min(k, vocab)
    got = native.topk_at(logits, picked, k)
    for i, r in enumerate(picked):
        order = torch.sort(logits[r], descending=True, stable=True).indices[:k]
        finite = logits[r, order].isfinite()
        assert got[i][finite].tolist() == order[finite].tolist()
    logits[picked[0], vocab // 2] = float("nan")
    from batchgen_data.model.native import _ACTIVE, use_native_kernels

    was = _ACTIVE["on"]
    use_native_kernels(True)
    try:
        assert top_ids_at(logits, picked, k)[0] == []  # a NaN row: no candidates (its mask is filled)
    finally:
        use_native_kernels(was)


def test_logprobs_take_one_native_read_of_each_row_and_keep_their_values(native, monkeypatch):
    """``token_logprobs`` through the native kernel gives what the torch passes give."""
    from batchgen_data.engine.sample import logprob_capture
    from batchgen_data.model import native as native_module

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 152_064, generator=g) * 4
    chosen = torch.randint(0, 152_064, (6,), generator=g)
    chosen[1] = logits[1].argmax()
    ks = [0, 1, 5, 20, 3, 5]
    monkeypatch.setattr(native_module, "_ACTIVE", {"on": False})
    torch_path = logprob_capture.token_logprobs(logits.clone(), chosen, ks)
    monkeypatch.setattr(native_module, "_ACTIVE", {"on": True})
    assert logprob_capture.logit_topk(logits, 20, chosen) is not None
    native_path = logprob_capture.token_logprobs(logits.clone(), chosen, ks)
    for a, b in zip(torch_path, native_path):
        assert a.token_ids == b.token_ids and a.ranks == b.ranks
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_rows_holding_nan_or_inf_get_that_log_sum_exp_and_take_the_torch_passes(native, monkeypatch):
    from batchgen_data.engine.sample import logprob_capture
    from batchgen_data.model import native as native_module

    logits = torch.randn(5, 1000)
    logits[1, 517] = float("nan")
    logits[2, 999] = float("nan")  # in the tail outside the blocks
    logits[3, 3] = float("inf")
    logits[4] = float("-inf")
    log_norm = native.logit_topk(logits, 5).log_norm
    assert log_norm.isnan().tolist() == [False, True, True, False, False]
    assert log_norm[3] == float("inf") and log_norm[4] == float("-inf")
    monkeypatch.setattr(native_module, "_ACTIVE", {"on": True})
    assert logprob_capture.logit_topk(logits, 5) is None
    assert logprob_capture.logit_topk(logits[[0]], 5) is not None


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 3000), ties=st.booleans(), nans=st.integers(0, 3),
       seed=st.integers(0, 2**16))
def test_the_native_argmax_is_torchs_first_maximum(native, rows, vocab, ties, nans, seed):
    """Greedy sampling's native argmax against ``max(dim).indices``: ties (the first wins), NaN
    (the first NaN wins), -inf, rows of one value, and widths that are not a vector multiple."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    if ties:
        logits = logits.round()
    logits[torch.rand(rows, vocab, generator=g) < 0.3] = float("-inf")
    for _ in range(nans):
        logits[int(torch.randint(rows, (1,), generator=g)), int(torch.randint(vocab, (1,), generator=g))] = float("nan")
    if seed % 5 == 0:
        logits[0] = float("-inf")
    assert torch.equal(native.first_argmax(logits), logits.max(dim=-1).indices)


@pytest.mark.parametrize("num_seqs", [1, 5])
def test_the_whole_forward_kernel_equals_the_per_layer_kernels(native, tiny_checkpoint, monkeypatch, num_seqs):
    """One ``decode_forward`` call over every layer gives the same hidden states (bitwise), KV
    pages and routed counts as the layer-by-layer fused blocks."""
    import batchgen_data.model.decoder as decoder
    from batchgen_data.model import MoEModel
    from batchgen_data.model.attention.metadata import AttentionBatch, build_attention_metadata
    from batchgen_data.model.model import ForwardTrace
    from batchgen_data.model.native import _ACTIVE, use_native_kernels

    folder, _ = tiny_checkpoint("mixtral")
    model = MoEModel.from_pretrained(folder)
    g = torch.Generator().manual_seed(num_seqs)
    contexts = [int(c) for c in torch.randint(1, 18, (num_seqs,), generator=g)]
    blocks = torch.randperm(6 * num_seqs, generator=g).tolist()
    tables = [blocks[5 * i : 5 * i + -(-c // 4)] for i, c in enumerate(contexts)]
    ids = torch.randint(4, 500, (num_seqs,), generator=g)
    pages = [[torch.randn(page.shape, generator=g) for page in layer] for layer in model.new_kv_cache(6 * num_seqs, 4).layers]
    per_layer_calls = []
    real_block = decoder.fused_moe_block
    monkeypatch.setattr(decoder, "fused_moe_block", lambda layer, h: per_layer_calls.append(1) or real_block(layer, h))
    was = _ACTIVE["on"]
    results = []
    try:
        use_native_kernels(True)
        for whole in (True, False):
            cache = model.new_kv_cache(6 * num_seqs, 4)
            for mine, theirs in zip(cache.layers, pages):
                for a, b in zip(mine, theirs):
                    a.copy_(b)
            model.fused_forward = None if whole else (cache, None)  # no address table: the per-layer path
            batch = AttentionBatch.combine([build_attention_metadata([1] * num_seqs, contexts, tables, 4)],
                                           model.rotary, torch.float32)
            trace = ForwardTrace()
            results.append((model.forward(ids, batch, cache, trace), cache, trace.expert_totals()))
            assert len(per_layer_calls) == (0 if whole else len(model.layers))
    finally:
        use_native_kernels(was)
        model.fused_forward = None
    (h1, kv1, totals1), (h2, kv2, totals2) = results
    assert torch.equal(h1, h2) and totals1 == totals2 and totals1[1] == 2 * num_seqs * len(model.layers)
    for a, b in zip(kv1.layers, kv2.layers):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
