"""Hugging Face `transformers` baselines for the throughput benchmark.

Both baselines decode greedily on the same prompts and per-request output lengths as our engine,
with EOS ignored: request i always yields exactly ``output_lens[i]`` tokens.

* ``run_static``: ``model.generate`` on left-padded batches (what most users do).
* ``run_continuous``: transformers' own continuous batching (paged KV cache, background thread),
  with the KV cache bounded by ``num_blocks`` (its default takes a large share of free memory).

Disabling EOS: ``generate`` replaces an eos_token_id of ``None`` with ``model.generation_config``'s,
so we pass an id argmax can never return (the logits width): no stopping, logits untouched.
Continuous batching treats a negative eos id as "no EOS".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

PAD_ID = 0


@dataclass
class BaselineResult:
    name: str  # e.g. "hf-static-bs32-sorted", "hf-continuous"
    wall_s: float  # generation wall time; excludes model load and CB setup (see setup_s)
    num_output_tokens: int  # useful output tokens = sum(output_lens)
    output_token_ids: list[list[int]]  # per request, truncated to its own length, input order
    timeline: list[tuple[float, int]]  # (seconds since start, cumulative useful output tokens)
    setup_s: float = 0.0  # one-off setup outside wall_s (continuous: cache allocation + warmup)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def _never_eos_id(model) -> int:
    """A token id greedy decoding can never produce: one past the last logit."""
    return int(model.get_output_embeddings().weight.shape[0])


def run_static(
    model,
    prompts: list[list[int]],
    output_lens: list[int],
    batch_size: int = 32,
    sort_by_length: bool = True,
) -> BaselineResult:
    """Static batching: ``model.generate`` on left-padded batches of ``batch_size`` requests.

    Each batch decodes ``max(output_lens in batch)`` steps; each row is then truncated to its own
    output length, so tokens past a request's length are wasted work and are not counted.

    With ``sort_by_length`` the requests are grouped by output length (ties: prompt length) before
    batching. This is an ORACLE (a real server does not know output lengths in advance) that gives
    the static baseline its best case: the least padding and the least wasted decoding.
    The timeline has one point per finished batch.
    """
    assert len(prompts) == len(output_lens) and all(n >= 1 for n in output_lens)
    order = list(range(len(prompts)))
    if sort_by_length:
        order.sort(key=lambda i: (output_lens[i], len(prompts[i])))
    eos = _never_eos_id(model)
    outputs: list[list[int]] = [[] for _ in prompts]
    timeline: list[tuple[float, int]] = [(0.0, 0)]
    done = 0

    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            width = max(len(prompts[i]) for i in idx)
            # input_ids / attention_mask: [batch, width], left padded with PAD_ID / 0
            input_ids = torch.full((len(idx), width), PAD_ID, dtype=torch.long)
            attention_mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                n = len(prompts[i])
                input_ids[row, width - n :] = torch.tensor(prompts[i], dtype=torch.long)
                attention_mask[row, width - n :] = 1
            gen_config = GenerationConfig(
                max_new_tokens=max(output_lens[i] for i in idx),
                do_sample=False,
                num_beams=1,
                eos_token_id=eos,
                pad_token_id=PAD_ID,
            )
            out = model.generate(  # [batch, width + max_new_tokens]
                input_ids=input_ids.to(model.device),
                attention_mask=attention_mask.to(model.device),
                generation_config=gen_config,
            )
            new = out[:, width:].tolist()
            for row, i in enumerate(idx):
                outputs[i] = new[row][: output_lens[i]]
                done += output_lens[i]
            timeline.append((time.perf_counter() - start, done))
    wall = time.perf_counter() - start

    name = f"hf-static-bs{batch_size}" + ("-sorted" if sort_by_length else "")
    return BaselineResult(name, wall, sum(output_lens), outputs, timeline)


def run_continuous(
    model,
    prompts: list[list[int]],
    output_lens: list[int],
    num_blocks: int,
    max_batch_tokens: int,
    block_size: int = 16,
) -> BaselineResult:
    """transformers continuous batching with a bounded paged KV cache and per-request lengths.

    The KV cache holds ``num_blocks`` blocks of ``block_size`` tokens (each block covers every
    layer), i.e. at most ``num_blocks * block_size`` cached tokens; each scheduler step processes
    at most ``max_batch_tokens`` tokens. ``block_size`` is passed as
    ``ContinuousBatchingConfig.page_size`` (its ``block_size`` field is deprecated since 5.17).
    Under cache pressure transformers preempts requests and later recomputes them ("soft reset").

    ``generate_batch`` takes a single ``max_new_tokens`` for all requests, so we drive the manager
    directly: ``add_request(..., max_new_tokens=output_lens[i])`` per request, then collect the
    finished results with ``get_result``; generation runs in a background thread. ``wall_s`` runs
    from the first ``add_request`` to the last result; cache allocation + warmup go to ``setup_s``.
    The timeline has one point per finished request.
    """
    assert len(prompts) == len(output_lens) and all(n >= 1 for n in output_lens)
    longest = max(len(p) + n for p, n in zip(prompts, output_lens))
    if longest > num_blocks * block_size:  # the scheduler would fail such a request at runtime
        raise ValueError(f"a request needs {longest} cached tokens > {num_blocks=} * {block_size=}")
    gen_config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max(output_lens),  # default only; overridden per request below
        eos_token_id=-1,  # negative = no EOS in continuous batching (None would log a warning)
        pad_token_id=PAD_ID,
    )
    cb_config = ContinuousBatchingConfig(
        page_size=block_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        allow_block_sharing=False,  # no prefix caching: every request does its full prefill
    )
    hints = WorkloadHints(  # what generate_batch passes; used to size defaults we do not set
        max_prompt_length=max(len(p) for p in prompts),
        max_generated_length=max(output_lens),
        num_requests=len(prompts),
    )
    outputs: list[list[int]] = [[] for _ in prompts]
    timeline: list[tuple[float, int]] = [(0.0, 0)]
    done = 0

    setup_start = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen_config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=5,
        workload_hints=hints,
    ) as manager:
        start = time.perf_counter()
        setup_s = start - setup_start
        for i, (p, n) in enumerate(zip(prompts, output_lens)):
            manager.add_request(list(p), request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        remaining = len(prompts)
        while remaining:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("continuous batching thread stopped with requests pending")
                continue
            if not result.is_finished():  # non-streaming requests only report when finished
                continue
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            i = int(result.request_id[1:])
            outputs[i] = list(result.generated_tokens)[: output_lens[i]]
            done += output_lens[i]
            remaining -= 1
            timeline.append((time.perf_counter() - start, done))
        wall = time.perf_counter() - start

    return BaselineResult("hf-continuous", wall, sum(output_lens), outputs, timeline, setup_s)


if __name__ == "__main__":
    # Self-test on a tiny random Mixtral: both baselines must match per-request greedy generate.
    import random

    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny model: extra OpenMP threads only add contention
    rng = random.Random(0)
    cfg = MixtralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg).eval()
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(10)]
    lens = [1, 30] + [rng.randint(1, 30) for _ in prompts[2:]]

    ref = []  # each prompt alone (batch size 1, no padding), EOS disabled
    with torch.inference_mode():
        for p, n in zip(prompts, lens):
            eos = _never_eos_id(model)
            gc = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=eos)
            out = model.generate(torch.tensor([p]), generation_config=gc)  # [1, len(p) + n]
            ref.append(out[0, len(p) :].tolist())
    assert [len(r) for r in ref] == lens
    n_eos = sum(cfg.eos_token_id in r for r in ref)
    print(f"reference continues past EOS id {cfg.eos_token_id} in {n_eos} request(s)")

    results = [
        run_static(model, prompts, lens, batch_size=4, sort_by_length=True),
        run_static(model, prompts, lens, batch_size=4, sort_by_length=False),
        run_continuous(model, prompts, lens, num_blocks=16, max_batch_tokens=64, block_size=16),
    ]
    ok = True
    for r in results:
        lens_ok = [len(o) for o in r.output_token_ids] == lens
        bad = [i for i, (o, e) in enumerate(zip(r.output_token_ids, ref)) if o != e]
        ok &= lens_ok and not bad and r.num_output_tokens == sum(lens)
        print(
            f"{r.name:22s} wall={r.wall_s:.3f}s setup={r.setup_s:.3f}s "
            f"tok/s={r.tokens_per_s:.0f} lens_ok={lens_ok} mismatched={bad}"
        )
    print("SELF-TEST", "PASSED" if ok else "FAILED")
    raise SystemExit(0 if ok else 1)
