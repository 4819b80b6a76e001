"""MIGRATE: what moving a sequence costs (``costs.py``), how a step's time grows with the running
set (``step_model.py``), what a job's rows generate (``lengths.py``), and the one rule that
decides what moves (``planner.py``), for expert-parallel ranks and Ray actors alike. Torch-free."""
