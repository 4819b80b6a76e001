"""Cross-actor rebalancing: one stage's actors share their rows through a work pool, and at the
tail busy actors give sequences back to idle ones by the engine's one move rule.

Owns:
- ``core/``: the policy, pure Python (no torch, no Ray; time comes in as ``now`` arguments): work
  items and their leases (``pool.py``, ``leasing.py``), who shares the work (``members.py``,
  ``compute.py``), running small sets beside rows long for the job (``pacing.py``,
  ``projection.py``), the tail plan (``tail.py``), the move rule and its cost model
  (``move_rule.py``, ``replay.py``), the step model (``step_model.py``), learned output lengths
  (``lengths.py``), the load reports it reads (``progress.py``), rows that move (``moved.py``).
  The engine's expert-parallel executor asks the same move rule between ranks.
- ``coordinator.py``: the pool behind async calls (leases held open until there is work), with
  an injected clock; ``ray_actor.py`` runs it as the stage's named Ray actor.
- ``transport.py``: how a client reaches the coordinator (``PoolTransport``: over Ray, or in
  the caller's own event loop).
- ``client/``: an actor's side (``RebalanceClient``: its batch calls, its lease loop), over a
  transport; the Ray Data stage (``operators/rebalance.py``) builds one per actor with its row
  results and its restart rule.
- ``simulate/``: a discrete-event simulator that drives ``core/`` over modelled actors, for the
  actor counts this machine cannot run.
May import: ``core/`` only floor 0 (errors, budget, hardware); the rest also the engine.
"""
