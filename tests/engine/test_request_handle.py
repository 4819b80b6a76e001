"""What executors publish about requests and what a caller's handle shows (no model)."""

from __future__ import annotations

from batchgen_data.engine.core.progress import ProgressPublisher, RequestProgress
from batchgen_data.engine.core.request import NewRequest
from batchgen_data.engine.core.sequence import Sequence, SequenceStatus as S
from batchgen_data.engine.request_handle import RequestHandle
from batchgen_data.engine.sampling_params import SamplingParams


def _seq(request_id: int, status: S = S.WAITING) -> Sequence:
    seq = Sequence(request_id, [1, 2, 3], SamplingParams(max_tokens=8), seed=0)
    seq.status = status
    return seq


def test_publishes_what_ran_or_changed_status_never_what_stays_queued():
    publisher = ProgressPublisher()
    running, suspended = _seq(0, S.RUNNING), _seq(1, S.RUNNING)
    compiling, waiting = _seq(2, S.WAITING_FOR_GRAMMAR), _seq(3)
    first = publisher.publish([running, suspended], [compiling])
    assert [(p.request_id, p.status) for p in first] == [(0, S.RUNNING), (1, S.RUNNING), (2, S.WAITING_FOR_GRAMMAR)]
    suspended.status, compiling.status = S.SUSPENDED, S.WAITING  # yielded for memory; grammar compiled
    running.output_token_ids.append(7)
    second = publisher.publish([running], [])
    assert {(p.request_id, p.status) for p in second} == {(0, S.RUNNING), (1, S.SUSPENDED), (2, S.WAITING)}
    assert next(p for p in second if p.request_id == 0).num_generated == 1
    assert [p.request_id for p in publisher.publish([running], [])] == [0]  # 1 and 2 stay queued: not again
    assert all(p.request_id != waiting.request_id for p in first + second)
    imported = _seq(4, S.RUNNING)  # got a running slot at import, between two steps
    publisher.watch(imported)
    imported.status = S.SUSPENDED  # and yielded in the next step, before it ever ran
    third = publisher.publish([running], [])
    assert [(p.request_id, p.status) for p in third] == [(4, S.SUSPENDED), (0, S.RUNNING)]


def test_a_handle_shows_published_progress_and_takes_the_first_token_time():
    request = NewRequest(5, [1, 2, 3], SamplingParams(max_tokens=4), seed=1, arrival_s=1.0)
    progress = RequestProgress.of_new(request)
    handle = RequestHandle(5, request.prompt_token_ids, request.params, request.seed, request.arrival_s, progress)
    assert (handle.status, handle.num_generated, handle.num_tokens, handle.num_tokens_left) == (S.WAITING, 0, 3, 4)
    handle.observe(RequestProgress(5, S.RUNNING, 0, 4, 3, num_computed_tokens=2), now_s=2.0)  # a prefill chunk
    assert handle.status is S.RUNNING and handle.first_token_s is None and handle.num_computed_tokens == 2
    handle.observe(RequestProgress(5, S.RUNNING, 1, 4, 4, num_computed_tokens=3), now_s=3.0)
    handle.observe(RequestProgress(5, S.SUSPENDED, 2, 4, 5, has_host_kv=True), now_s=4.0)
    assert handle.first_token_s == 3.0 and handle.status is S.SUSPENDED and not handle.is_finished
