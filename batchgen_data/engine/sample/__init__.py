"""Sampling: the sampler and its steps in declared order (``sampler.py``), the grammar bitmask
kernel (``bitmask.py``), vLLM's logits processors and penalties (``processors.py``,
``penalties.py``), logprob capture (``logprob_capture.py``) and entries (``logprobs.py``)."""
