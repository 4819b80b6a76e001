"""The rebalancing policy, pure Python: no torch, no Ray, no clock of its own (every call that
depends on time takes ``now``), so the coordinator's actor, an engine's expert-parallel driver and
the simulator (``rebalance/simulate``) run the same code. May import floor 0 only (errors, budget,
hardware); the import-floor test holds it to that."""
