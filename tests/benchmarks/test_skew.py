"""The skew grid runner (``benchmarks/skew.py``): its scenarios cover the issue's dimensions and
classes, its summary applies the targets, and one tiny off/on pair runs end to end (real local
Ray, bounded in time)."""

from __future__ import annotations

import pytest

from benchmarks import skew


def test_the_grid_covers_every_dimension_and_class_and_is_seeded():
    scenarios = skew.grid(seed=0, num_drawn=10)
    assert scenarios == skew.grid(seed=0, num_drawn=10) != skew.grid(seed=1, num_drawn=10)
    assert {s.kind for s in scenarios} == {"in-set", "queued", "shuffled", "mixed"}
    assert {s.actors for s in scenarios} == {2, 3}
    assert {s.position for s in scenarios} == {"front", "middle", "spread", "shuffled"}
    assert None in {s.max_num_seqs for s in scenarios} and 8 in {s.max_num_seqs for s in scenarios}
    assert min(s.rows for s in scenarios) <= 48 and max(s.rows for s in scenarios) >= 256
    assert all(s.rows // s.block_size >= 3 for s in scenarios)
    assert all(s.steps_without_rebalancing() <= skew._MAX_STEPS for s in scenarios)
    # Rows: the long ones where the scenario puts them, shuffled ones by the seed.
    front = skew.Scenario("f", 12, 4, 3, "front", 64, 4, 8, 2)
    assert [r["sampling_params"]["max_tokens"] for r in skew.make_rows(front, 0)][:4] == [64, 64, 64, 4]
    spread = skew.Scenario("s", 12, 4, 3, "spread", 64, 4, 8, 2)
    assert spread.long_indices(0) == [0, 4, 8]
    assert skew.Scenario("q", 48, 16, 12, "front", 64, 4, 8, 2).kind == "queued"
    assert skew.Scenario("m", 48, 8, 12, "front", 64, 4, 8, 2).kind == "mixed"  # over two blocks


def _pair(off_wall, on_wall, off_span, on_span, on_step_s=0.03):
    run = lambda wall, span, step: {"wall_s": wall, "span_s": span, "median_step_s": step}  # noqa: E731
    return {"off": run(off_wall, off_span, on_step_s), "on": run(on_wall, on_span, on_step_s)}


def test_the_summary_applies_each_classes_target():
    in_set = skew.Scenario("i", 48, 16, 4, "front", 128, 8, None, 2)
    steady = [_pair(10.0, 10.0, 5.0, 4.9), _pair(10.0, 9.9, 5.0, 5.0), _pair(10.0, 10.4, 5.0, 5.1)]
    summary = skew.summarize(in_set, steady)
    assert summary["met"] and summary["worst_pair"] == 2 and summary["wall_min"] == pytest.approx(10 / 10.4)
    assert not skew.summarize(in_set, steady + [_pair(10.0, 10.6, 5.0, 5.0)] * 2)["met"]  # one pair below 0.95
    queued = skew.Scenario("q", 48, 16, 16, "front", 128, 8, 8, 2)  # ideal: 144 steps
    gains = [_pair(15.0, 10.0, 12.0, 4.5), _pair(15.0, 10.5, 12.0, 4.6)]
    assert skew.summarize(queued, gains)["met"]
    slow_span = [_pair(15.0, 10.0, 12.0, 4.8 * 1.2)] * 2  # 1.2x more than 144 steps of 30 ms: not near the ideal
    assert not skew.summarize(queued, slow_span)["met"]
    assert "| q | queued |" in skew.table([{"scenario": skew.asdict(queued), "pairs": gains,
                                           "summary": skew.summarize(queued, gains)}], "benchmarks/skew.py --quick")


@pytest.mark.timeout(300)
def test_one_pair_runs_end_to_end(ray_cluster, tmp_path):
    import ray

    tiny = skew.Scenario("tiny", 12, 4, 3, "front", 24, 4, 8, 2)
    rows = skew.make_rows(tiny, 0)
    pair = {side: skew.run_case(ray, tiny, rows, side == "on", tmp_path / side) for side in ("off", "on")}
    assert pair["on"]["span_s"] > 0 and pair["off"]["wall_s"] > 0
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("batchgen-pool-")]
    result = {"scenario": skew.asdict(tiny), "pairs": [pair], "summary": skew.summarize(tiny, [pair])}
    lines = skew.worst_pair_lines(result)
    assert any("on actor" in line and "calibration" in line for line in lines)
