"""The makespan no schedule can beat (``lower_bound_s``): start-up, then the larger of the whole
job's work spread evenly over the actors at their best throughput (a full running set of
``max_num_seqs``) and the longest row alone on an actor (its prefill, then one token a step at a
running set of one)."""

from __future__ import annotations

from collections.abc import Sequence

from batchgen_data.rebalance.simulate.model import ActorModel
from batchgen_data.rebalance.simulate.scenario import Row


def lower_bound_s(rows: Sequence[Row], num_actors: int, max_num_seqs: int, model: ActorModel) -> float:
    """Example:
        >>> m = ActorModel(base_s=0.01, per_seq_s=0.0, prefill_s_per_token=0.0, startup_s=1.0)
        >>> lower_bound_s([Row(0, 100, 100), Row(0, 10, 10)], num_actors=2, max_num_seqs=4, model=m)
        2.0
    """
    step = model.step_model
    per_token_s = step.step_s(max_num_seqs) / max_num_seqs  # a token at the best throughput
    work_s = sum(r.output_tokens * per_token_s + r.prompt_tokens * model.prefill_s_per_token for r in rows)
    longest_s = max(r.prompt_tokens * model.prefill_s_per_token + r.output_tokens * step.step_s(1) for r in rows)
    return model.startup_s + max(work_s / num_actors, longest_s)
