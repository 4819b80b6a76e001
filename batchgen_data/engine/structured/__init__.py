"""Structured outputs: constrain a request's output to a JSON schema, regex, choice or grammar.

``params`` holds the user-facing ``StructuredOutputsParams`` (torch-free, no grammar library);
``compiler`` and ``manager`` drive llguidance for the scheduler; ``engine/sample/bitmask.py``
applies the masks to logits in the sampler.
"""
