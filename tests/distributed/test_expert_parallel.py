"""Expert parallelism across real rank processes: tokens, lockstep under uneven work, MIGRATE
between ranks, per-rank experts, and death of a rank. Every engine is closed in a ``finally``,
and the process tests check that no rank outlives its engine."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from tiny_checkpoints import ARCHITECTURES, hf_greedy_continuations

from batchgen_data import ConfigError, Engine, EngineConfig, EngineDeadError, SamplingParams
from batchgen_data.engine.executor.comm_time import split_comm_time
from batchgen_data.model import ModelConfig, MoEModel
from batchgen_data.model.kv_cache import KVCache

pytestmark = pytest.mark.timeout(240)

# One checkpoint per supported model_type.
EP_ARCHS = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "deepseek_v2", "glm4_moe", "gpt_oss"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 75)), [100], [7, 300, 42, 17, 99],
           list(range(200, 236)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13]]
MAX_NEW = 16


def _greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _kv_budget(folder, num_tokens: int, block_size: int = 8) -> int:
    return KVCache.bytes_per_block(MoEModel.from_pretrained(folder).kv_specs, block_size) * (-(-num_tokens // block_size))


def test_every_architecture_gives_the_single_process_tokens_under_a_tight_kv_budget(tiny_checkpoint):
    for arch in EP_ARCHS:
        assert arch in ARCHITECTURES
        folder, hf = tiny_checkpoint(arch)
        refs = hf_greedy_continuations(hf, PROMPTS, MAX_NEW)  # == the single-process engine (test_model_parity)
        config = EngineConfig(expert_parallel_size=2, block_size=8, max_num_seqs=4, attention_batch_size=2,
                              max_num_batched_tokens=48, kv_cache_memory_bytes=_kv_budget(folder, 72))
        engine = Engine(folder, config)
        try:
            outs = engine.generate(PROMPTS, _greedy())
            stats = engine.stats()
        finally:
            engine.close()
        assert [o.token_ids for o in outs] == refs, arch
        assert stats.num_suspended > 0, f"{arch}: the per-rank budget must force suspensions"
        assert all(r.num_forwards + r.num_idle_forwards == stats.num_forwards for r in stats.ranks), "lockstep"


def test_seeded_sampling_is_the_same_at_one_and_two_ranks(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3_moe")
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    single = Engine(folder, EngineConfig(block_size=8)).generate(PROMPTS, params)
    engine = Engine(folder, EngineConfig(expert_parallel_size=2, block_size=8))
    try:
        split = engine.generate(PROMPTS, params)
    finally:
        engine.close()
    assert [o.token_ids for o in split] == [o.token_ids for o in single]


def test_one_request_bad_prompts_and_a_drained_rank(tiny_checkpoint):
    """One request leaves a rank with nothing from the first step: it joins every step with a
    zero-token forward, so nothing hangs. Bad prompts come back as errors beside good ones."""
    folder, hf = tiny_checkpoint("mixtral")
    engine = Engine(folder, EngineConfig(expert_parallel_size=2, block_size=8))
    try:
        [alone] = engine.generate([PROMPTS[2]], _greedy())
        assert alone.token_ids == hf_greedy_continuations(hf, [PROMPTS[2]], MAX_NEW)[0]
        stats = engine.stats()
        assert sorted(r.num_idle_forwards > 0 for r in stats.ranks) == [False, True]
        mixed = engine.generate([PROMPTS[0], "", [10, 99999], PROMPTS[1], []], _greedy())
    finally:
        engine.close()
    refs = hf_greedy_continuations(hf, [PROMPTS[0], PROMPTS[1]], MAX_NEW)
    assert [mixed[0].token_ids, mixed[3].token_ids] == refs
    assert [o.finish_reason for o in mixed] == ["length", "error", "error", "length", "error"]
    assert "outside the vocabulary" in mixed[2].error


def test_collective_time_splits_into_waiting_for_the_last_rank_and_exchanging():
    # Two collectives: rank 1 arrives 3 s late to the first, rank 0 1 s late to the second.
    spans = [[(0.0, 4.0), (6.0, 7.5)], [(3.0, 4.5), (5.0, 7.0)]]
    split = split_comm_time(spans)
    assert split["rank_wait_s"] == pytest.approx([3.0, 1.0])
    assert split["rank_exchange_s"] == pytest.approx([1.0 + 1.5, 1.5 + 1.0])
    assert split_comm_time([[(0.0, 1.0)], []]) == {}  # spans that do not line up: no split


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding two ranks needs two CPUs")
def test_ranks_bind_to_their_own_cpus_and_report_wait_and_exchange(tiny_checkpoint):
    """Each rank gets its own CPU of those the driver may use; every step's collective time of
    each rank is its wait for the last rank plus the exchange, and one request leaves the other
    rank waiting."""
    folder, _ = tiny_checkpoint("mixtral")
    cpus = sorted(os.sched_getaffinity(0))
    engine = Engine(folder, EngineConfig(expert_parallel_size=2, block_size=8, collect_timeline=True))
    try:
        bound = [os.sched_getaffinity(pid) for pid in engine.executor.group.pids]
        engine.generate([PROMPTS[2]], _greedy())
        timeline = list(engine.timeline)
    finally:
        engine.close()
    unbound = Engine(folder, EngineConfig(expert_parallel_size=2, block_size=8, bind_rank_cpus=False))
    try:
        free = [os.sched_getaffinity(pid) for pid in unbound.executor.group.pids]
    finally:
        unbound.close()
    assert bound == [{cpus[0]}, {cpus[1]}]
    assert free == [set(cpus), set(cpus)]
    for step in timeline:
        for r in range(2):
            split = step["rank_wait_s"][r] + step["rank_exchange_s"][r]
            assert split == pytest.approx(step["rank_comm_s"][r], abs=2e-3, rel=0.05)
    assert max(sum(step["rank_wait_s"][r] for step in timeline) for r in range(2)) > 0


def test_migrate_between_ranks_keeps_tokens(tiny_checkpoint):
    """Placement evens tokens, not sequences: one long request fills one rank's budget while the
    other queues fourteen short ones behind a two-slot running set. The long rank has a free slot
    and nothing queued, so the tail moves queued sequences to it; tokens stay those of one process."""
    folder, hf = tiny_checkpoint("olmoe")
    prompts = [[3 + i, 40 + 2 * i, 7, 90 + i] for i in range(15)]
    lengths = [40] + [3] * 14
    refs = hf_greedy_continuations(hf, prompts, 40)
    engine = Engine(folder, EngineConfig(expert_parallel_size=2, block_size=8, max_num_seqs=2, attention_batch_size=2))
    try:
        outs = engine.generate(prompts, [_greedy(n) for n in lengths])
        stats = engine.stats()
    finally:
        engine.close()
    assert [o.token_ids for o in outs] == [ref[:n] for ref, n in zip(refs, lengths)]
    assert sum(r.num_migrated_out for r in stats.ranks) > 0
    assert sum(r.num_migrated_in for r in stats.ranks) == sum(r.num_migrated_out for r in stats.ranks)


def test_each_rank_loads_only_its_experts(tiny_checkpoint):
    folder, _ = tiny_checkpoint("deepseek_v3")
    config = ModelConfig.from_pretrained(folder)
    full = MoEModel.from_pretrained(folder).expert_store.nbytes
    engine = Engine(folder, EngineConfig(expert_parallel_size=2, block_size=8))
    try:
        owned = [ready.owned_experts for ready in engine.executor.group.ready]
        held = [ready.expert_weight_bytes for ready in engine.executor.group.ready]
    finally:
        engine.close()
    assert owned == [tuple(range(0, config.num_experts // 2)), tuple(range(config.num_experts // 2, config.num_experts))]
    assert held == [full // 2, full // 2]


def test_rank_peak_memory_is_the_ranks_own_not_the_drivers(tiny_checkpoint):
    """A rank is spawned by fork + exec: its ``ru_maxrss`` would start at the driver's peak."""
    folder, _ = tiny_checkpoint("mixtral")
    ballast = torch.ones(2 * 2**30 // 4)  # 2 GiB resident in the driver before the ranks start
    engine = Engine(folder, EngineConfig(expert_parallel_size=2, block_size=8))
    try:
        engine.generate([PROMPTS[0]], _greedy(4))
        peaks = [r.peak_rss_bytes for r in engine.stats().ranks]
    finally:
        engine.close()
        del ballast
    assert all(0 < peak < 2**30 for peak in peaks), peaks


def test_expert_count_not_divisible_by_ranks_is_a_config_error(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3_moe")  # 6 experts
    with pytest.raises(ConfigError, match="expert_parallel_size=4 must divide"):
        Engine(folder, EngineConfig(expert_parallel_size=4))


def test_sigkill_of_a_rank_fails_every_waiter_and_leaves_no_rank(tiny_checkpoint):
    folder, _ = tiny_checkpoint("mixtral")
    engine = Engine(folder, EngineConfig(expert_parallel_size=2, block_size=8, max_num_seqs=2, rank_timeout_s=20))
    pids = engine.executor.group.pids
    outcome: dict = {}

    def run() -> None:
        try:
            engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(40)], _greedy(200))
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            outcome["error"] = err

    thread = threading.Thread(target=run)
    try:
        thread.start()
        deadline = time.monotonic() + 60
        while engine.stats().num_forwards < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive(), "generate must not hang when a rank dies"
        assert isinstance(outcome.get("error"), EngineDeadError)
        assert time.monotonic() - killed_at < 15
        with pytest.raises(EngineDeadError):
            engine.generate([PROMPTS[0]], _greedy())
    finally:
        engine.close()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not any(_alive(pid) for pid in pids)


def test_ranks_exit_when_their_driver_is_killed(tiny_checkpoint, tmp_path):
    """SIGKILL of the process that holds the engine: its ranks see end of file and exit."""
    import subprocess
    import sys

    folder, _ = tiny_checkpoint("mixtral")
    code = (
        "import sys, time; from batchgen_data import Engine, EngineConfig;"
        f"e = Engine({str(folder)!r}, EngineConfig(expert_parallel_size=2, block_size=8));"
        "print(*e.executor.group.pids, flush=True); time.sleep(600)"
    )
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        driver.kill()
        driver.wait(10)
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids), "a rank outlived its driver"
    finally:
        driver.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_close_stops_every_rank(tiny_checkpoint):
    folder, _ = tiny_checkpoint("mixtral")
    with Engine(folder, EngineConfig(expert_parallel_size=2, block_size=8)) as engine:
        pids = engine.executor.group.pids
        assert all(_alive(pid) for pid in pids)
    assert not any(_alive(pid) for pid in pids)
    assert torch.get_num_threads() >= 1


def test_cli_job_with_two_expert_parallel_ranks(tmp_path, demo_path):
    import json

    import pyarrow.parquet as pq

    from batchgen_data.jobs.cli import main

    rows = [{"id": i, "prompt": f"Ticket {i}: the parcel arrived {'late' if i % 2 else 'broken'}."} for i in range(6)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["run", str(tmp_path / "in.jsonl"), "--max-tokens", "4", "--max-num-seqs", "8", "--no-progress"]
    assert main([args[0], args[1], str(tmp_path / "one"), *args[2:]]) == 0
    assert main([args[0], args[1], str(tmp_path / "two"), *args[2:], "--expert-parallel-size", "2"]) == 0
    one, two = (pq.read_table(next((tmp_path / d).glob("part-*"))).to_pylist() for d in ("one", "two"))
    assert [r["generated_text"] for r in two] == [r["generated_text"] for r in one]
    assert all(r["__inference_error__"] is None for r in two)


def test_each_rank_caches_prefixes_and_gives_the_uncached_tokens(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3_moe")
    template = list(range(300, 340))  # five blocks of 8
    prompts = [template + [10 + i, 20 + i] for i in range(8)]
    single = Engine(folder, EngineConfig(block_size=8, enable_prefix_caching=False)).generate(prompts, _greedy(8))
    engine = Engine(folder, EngineConfig(expert_parallel_size=2, block_size=8))
    try:
        outs = engine.generate(prompts, _greedy(8))
        stats = engine.stats()
    finally:
        engine.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in single]
    assert all(r.prefix_cache_hits > 0 for r in stats.ranks)  # each rank's own cache
    assert stats.prefix_cache_hits == sum(r.prefix_cache_hits for r in stats.ranks)
    assert sum(o.num_cached_tokens for o in outs) == stats.prefix_cache_hits


def test_constrained_rows_and_logprobs_on_ranks_and_across_migrate(tiny_checkpoint):
    """Structured outputs and logprobs on expert-parallel ranks: each rank compiles its own
    grammars, and the sequences the tail moves between ranks give the single-process outputs."""
    import re

    folder, _ = tiny_checkpoint("olmoe")
    prompts = [[3 + i, 40 + 2 * i, 7, 90 + i] for i in range(15)]
    regex = r"[a-z]{2}-[0-9]{2}"
    params = [_greedy(40)] + [SamplingParams(max_tokens=16, temperature=0, structured_outputs={"regex": regex},
                                             logprobs=2, prompt_logprobs=1)] * 14
    with Engine(folder, EngineConfig(block_size=8, max_num_seqs=2)) as single:
        expected = single.generate(prompts, params)
    engine = Engine(folder, EngineConfig(expert_parallel_size=2, block_size=8, max_num_seqs=2, attention_batch_size=2))
    try:
        outs = engine.generate(prompts, params)
        stats = engine.stats()
    finally:
        engine.close()
    assert [o.text for o in outs] == [o.text for o in expected]
    assert all(o.finish_reason == "stop" and re.fullmatch(regex, o.text) for o in outs[1:])
    for got, want in zip(outs[1:], expected[1:]):
        assert [list(e) for e in got.logprobs] == [list(e) for e in want.logprobs]
        # a position the grammar narrows to fewer than k tokens lists -inf for the rest, as vLLM does
        assert all(g[t].logprob == w[t].logprob or abs(g[t].logprob - w[t].logprob) < 1e-4
                   for g, w in zip(got.logprobs, want.logprobs) for t in g)
        assert len(got.prompt_logprobs) == 4 and got.prompt_logprobs[0] is None
    assert sum(r.num_migrated_out for r in stats.ranks) > 0


def test_a_request_handle_shows_its_ranks_status_and_tokens(tiny_checkpoint):
    """What a caller holds follows the rank that runs its request: after a few steps a running
    request's handle says RUNNING with the tokens it has generated (not a driver-side copy that
    stays WAITING until it finishes)."""
    from batchgen_data.engine.core.sequence import SequenceStatus

    folder, _ = tiny_checkpoint("mixtral")
    engine = Engine(folder, EngineConfig(expert_parallel_size=2, block_size=8))
    try:
        handles = [engine.add_request(p, _greedy()) for p in PROMPTS[:4]]
        for _ in range(3):
            engine.step()
        seen = [(h.status, h.num_generated, h.num_tokens) for h in handles]
    finally:
        engine.close()
    assert all(status is SequenceStatus.RUNNING for status, _, _ in seen), seen
    assert all(0 < n < MAX_NEW and tokens == len(p) + n for (_, n, tokens), p in zip(seen, PROMPTS)), seen
