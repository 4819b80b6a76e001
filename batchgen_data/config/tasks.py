"""What an engine run does with a row: vLLM's task names, written once."""

# Prefill-only tasks (vLLM's pooling runners): a row gets its ``embeddings``, never samples.
POOLING_TASKS = ("embed", "classify")
# Every task a stage, the CLI and the processor accept (Ray's ``vLLMTaskType`` less "score").
TASK_TYPES = ("generate", *POOLING_TASKS)
