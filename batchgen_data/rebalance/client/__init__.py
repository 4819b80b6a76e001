"""A stage actor's side of the shared work pool: ``RebalanceClient`` (``client.py``, the owner side:
its batch calls), ``LeaseLoop`` (``lease_loop.py``, the worker side), the state they share
(``state.py``), its membership (``membership.py``) and counters (``stats.py``). The Ray Data
stage (``operators/rebalance.py``) builds one per actor.

NOTE: how one actor takes part.
  * The pool starts on demand (``run_batch``): while the stage has none, a batch whose rows fit
    the engine's free running slots and KV memory runs on the actor's own engine
    (``local_first.rows_here``), with no coordinator process and no round trip; a batch with
    rows that would queue starts the stage's coordinator (or finds it), starts the longest rows
    that fit at once and puts the rest in the pool. Once the pool exists every batch goes
    through it, and every actor joins it (registers, with how long it took to load) at its next
    call, or within a second while it runs rows outside the pool (``_watch_for_pool``). Once its engine is built, the client calibrates the engine's step model
    (``migration/calibration.py``: a few dummy decode steps at 2 and at a full running set, ~0.2
    s on the demo model, once per machine, model and settings: later engines read it from disk,
    ``calibration_cache.py``).
  * As an owner, ``run_batch`` submits the batch's valid rows to the coordinator and awaits their
    results; it then emits the rows itself (exactly once, in order). Rows it ran outside the
    pool are movable once the stage has a pool: one a tail plan names enters the pool as it moves
    (``WorkPool.adopt``, a batch of its own), and the owner awaits its result as a pooled one.
  * As a worker, a background loop leases pool items for the running slots its engine has free
    below ``max_num_seqs``, or about to free (a sequence that reaches its ``max_tokens`` within
    one measured lease round trip), the longest first, its own batches' among equals; runs
    them, and completes them. Leases come on events, not on a timer: the coordinator holds a
    lease call that gets nothing open until the pool has something for this actor (items, a
    give-back, the stage's pool emptied) or its wait bound, so an actor with room and nothing to
    take waits in one call; an engine with no room holds its call until its next slot is about
    to free, and a sequence that ends sooner (its result, or its give-back, reaching the
    coordinator) ends that call. A held call keeps the actor's leases alive, and a dead
    worker's leases expire back into the pool. No prefetch beyond that: a row leased ahead
    waits in that engine until one of its slots frees (with long rows running, a whole long
    sequence) while another actor could start it now, and prefetched rows refill freed slots
    before the actor ever reports them empty, so the pool's longest-first rule never gets to
    place long rows there (on the clustered skew workload, ~700 steps per actor instead of the
    560 of perfect packing). Each lease call carries the actor's load report
    (``WorkerProgress``: its engine's sequences from one snapshot, its step model, what a move
    costs).
  * If the coordinator cannot be reached, the owner runs its batch on its own engine: the job
    completes without rebalancing rather than losing rows.
  * At the tail (nothing pending), the pool names the sequences a worker should give back, by
    the engine's one move rule (``batchgen_data/engine/migration/planner.py``: the moves must pay
    for themselves, net of their cost), each with whether its KV travels (PARTITION of the
    straggler set). Its engine exports exactly those (``AsyncEngine.migrate_out``); the state
    travels through the coordinator as pickled bytes, and the receiver leases and continues it
    (MIGRATE). A given-back item is an ordinary pending item with a state attached, so leases,
    expiry and first-result-wins cover it unchanged.
  * Each call submits its rows under a key of its own, so two equal batches (unseeded sampled
    rows) get their own samples; a call that ends without its results (cancelled, failed) tells
    the pool to drop the batch, and the pool drops the batches of an owner it no longer hears
    from: nothing waits in it for a caller that is gone.
  * Ray Data shuts an actor down once it has no call in flight and no input is left, so an actor
    leases only while one of its own calls is open (items a held lease brings after its last
    call closed go straight back), and its last open call stays open while the stage still has
    outstanding work (pool items, or rows other actors run outside the pool: either may come to
    it at the tail, ``WorkPool.outstanding``) and until the items it leased are done:
    an actor is never stopped while holding leases. A new call arriving releases the held one.
    With ``max_concurrent_calls_per_actor=1`` no new call can arrive, so batches advance in
    rounds (an actor done with its batch helps the others finish theirs before it takes the
    next); with two or more calls per actor, as the operator's in-flight warning asks for, there
    is no such barrier.
"""

from batchgen_data.rebalance.client.client import RebalanceClient
from batchgen_data.rebalance.client.membership import PoolMembership, join_stage
from batchgen_data.rebalance.client.state import ResultCodec
from batchgen_data.rebalance.client.stats import RebalanceStats

__all__ = ["PoolMembership", "RebalanceClient", "RebalanceStats", "ResultCodec", "join_stage"]
