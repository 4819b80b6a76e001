"""Where an expert-parallel rank's time in collectives goes: waiting for the slowest rank, or
exchanging tokens."""

from __future__ import annotations


def split_comm_time(spans: list[list[tuple[float, float]]]) -> dict:
    """Splits each rank's time in one step's collectives into waiting and exchanging.

    ``spans[r]`` holds rank r's (arrived, left) for each collective of the step, in order; every
    rank joins the same collectives (lockstep). No data moves before the last rank arrives: until
    then a rank waits for the slowest one (load imbalance, not communication); from then until it
    leaves, it exchanges. Per rank, wait + exchange = its time in collectives. Returns
    ``rank_wait_s`` and ``rank_exchange_s``; empty when the spans do not line up.
    """
    if len(spans) < 2 or not spans[0] or any(len(s) != len(spans[0]) for s in spans):
        return {}
    waits, exchanges = [0.0] * len(spans), [0.0] * len(spans)
    for joined in zip(*spans):
        last_in = max(arrived for arrived, _ in joined)
        for r, (arrived, left) in enumerate(joined):
            waits[r] += last_in - arrived
            exchanges[r] += max(0.0, left - last_in)
    return {"rank_wait_s": waits, "rank_exchange_s": exchanges}
