#!/usr/bin/env bash
# The expert-parallel benchmark on one node of GPUs, in one command: 8 ranks (one GPU each, NCCL),
# bf16, against one GPU. UNTESTED: no GPU machine has run it yet.
#   bash benchmarks/expert_parallel_gpu.sh [extra expert_parallel.py args]
set -euo pipefail
cd "$(dirname "$0")/.."
export BATCHGEN_DATA_CACHE="${BATCHGEN_DATA_CACHE:-$PWD/.cache/batchgen-data}"
export DS_ACCELERATOR=cuda
exec .venv/bin/python benchmarks/expert_parallel.py --device cuda --dtype bfloat16 --ranks 8 \
  --requests 2048 --max-num-seqs 1024 --attention-batch-size 256 --max-num-batched-tokens 8192 \
  --out runs/expert-parallel-gpu "$@"
