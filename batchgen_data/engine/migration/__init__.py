"""MIGRATE: what moving a sequence costs (``costs.py``), how a step's time grows with the running
set (``step_model.py``, calibrated at engine start by ``calibration.py``), what a job's rows
generate (``lengths.py``), what rebalancing reads of an engine (``engine_probe.py``), and the one
rule that decides what moves (``planner.py``), for expert-parallel ranks and Ray actors alike.
Torch-free."""
