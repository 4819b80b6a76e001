"""Cross-actor rebalancing: one stage's actors share their rows through a work pool, and at the
tail busy actors give sequences back to idle ones by the engine's one move rule.

Owns:
- ``core/``: the policy, pure Python (no torch, no Ray; time comes in as ``now`` arguments): work
  items and their leases (``pool.py``, ``leasing.py``), who shares the work (``members.py``,
  ``compute.py``), the tail plan (``tail.py``), the move rule and its cost model
  (``move_rule.py``, ``replay.py``), the step model (``step_model.py``), learned output lengths
  (``lengths.py``) and the load reports it reads (``progress.py``). The engine's expert-parallel
  executor asks the same move rule between ranks.
- ``coordinator.py``: the pool behind async calls (leases held open until there is work), with
  an injected clock; ``ray_actor.py`` runs it as the stage's named Ray actor.
- ``simulate/``: a discrete-event simulator that drives ``core/`` over modelled actors, for the
  actor counts this machine cannot run.
The stage's side (``operators/rebalance.py``: an actor's client) uses it.
May import: ``core/`` only floor 0 (errors, budget, hardware); the rest also the engine.
"""
