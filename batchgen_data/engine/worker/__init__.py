"""The worker: the model runner that executes one scheduled step with module-based batching
(``model_runner.py``) and the running set planned with the fetch cost of streamed experts
(``offload.py``)."""
