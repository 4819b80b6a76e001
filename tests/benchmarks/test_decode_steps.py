"""The decode-step benchmark measures what it says on a real engine, and reads llama.cpp's output."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from batchgen_data import Engine, EngineConfig
from batchgen_data.model import ModelConfig
from benchmarks.decode_steps import format_table, measure_engine, summarize
from benchmarks.llama_cpp import _parse_markdown


@pytest.mark.timeout(300)
def test_decode_rows_count_only_steps_where_every_row_decodes(tiny_checkpoint):
    folder, _ = tiny_checkpoint("mixtral")
    engine = Engine(folder, EngineConfig(max_num_seqs=4, collect_timeline=True))
    mcfg = ModelConfig.from_pretrained(folder)
    rows = [measure_engine(engine, mcfg, n, prompt_tokens=9, gen_tokens=6, bandwidth_gbs=10.0, gflops=100.0)
            for n in (1, 4)]
    for row in rows:
        assert row.decode_tokens_per_s > 0 and row.step_ms_min <= row.step_ms_median
        assert row.roofline_ms > 0 and row.prefill_tokens_per_s > 0
        assert set(row.module_ms) == {"attention", "moe", "logits", "other"}
    # 6 tokens each: the first comes from the prefill step, the other 5 from decode steps of all N.
    assert [r.num_decode_steps for r in rows] == [5, 5]
    table = format_table({"engine": [dict(asdict(r), over_roofline=r.over_roofline) for r in rows],
                          "llama_cpp": {"f32": [{"running": 1, "decode_tokens_per_s": rows[0].decode_tokens_per_s}]},
                          "ours_over": {"llama_cpp_f32": {1: 1.0}}})
    assert "| 1 |" in table and "| 4 |" in table and "1.00 |" in table and "| - | - |" in table


def test_llama_batched_bench_markdown_rows_parse():
    text = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |     64 |    1 |    192 |    0.036 |  3506.20 |    0.120 |   531.00 |    0.157 |  1225.00 |
|   128 |     64 |    8 |   1536 |    0.250 |  4096.00 |    0.640 |   800.00 |    0.890 |  1725.84 |
"""
    rows = _parse_markdown(text)
    assert [r["pl"] for r in rows] == [1, 8]
    assert rows[1]["speed_tg"] == 800.0 and rows[0]["t_tg"] == 0.120


def test_summaries_pair_each_round_with_itself():
    def rows(*rates):
        return [{"running": n, "decode_tokens_per_s": rate} for n, rate in zip((1, 8), rates)]

    rounds = [{"engine": rows(100, 800), "llama_cpp": {"f32": rows(200, 400)}},
              {"engine": rows(300, 900), "llama_cpp": {"f32": rows(300, 1000)}},
              {"engine": rows(50, 700), "llama_cpp": {"f32": rows(100, 700)}}]
    summary = summarize(rounds)
    assert [r["decode_tokens_per_s"] for r in summary["engine"]] == [100, 800]
    assert [r["decode_tokens_per_s"] for r in summary["llama_cpp"]["f32"]] == [200, 700]
    # Paired per round: 0.5, 1.0, 0.5 at N=1 and 2.0, 0.9, 1.0 at N=8 (not 100/200 and 800/700).
    assert summary["ours_over"]["llama_cpp_f32"] == {1: 0.5, 8: 1.0}
