"""Sampling: the sampler and its steps in declared order (``sampler.py``), the grammar bitmask
kernel (``bitmask.py``), logprob capture (``logprob_capture.py``) and entries (``logprobs.py``)."""
