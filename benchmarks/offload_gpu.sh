#!/usr/bin/env bash
# The offloading benchmark on one GPU, in one command: bf16, the experts in a pinned host tier and
# a GPU pool of what the weight budget leaves, copied on the store's own CUDA stream; accelerate
# with max_memory={0: budget, "cpu": host} at the same budget. Peak GPU memory is reported beside
# RssAnon. UNTESTED: no GPU machine has run it yet.
#   bash benchmarks/offload_gpu.sh [extra offload.py args]
set -euo pipefail
cd "$(dirname "$0")/.."
export BATCHGEN_DATA_CACHE="${BATCHGEN_DATA_CACHE:-$PWD/.cache/batchgen-data}"
export DS_ACCELERATOR=cuda
exec .venv/bin/python benchmarks/offload.py --device cuda --dtype bfloat16 --budget 180MB --kv 4GiB \
  --requests 1024 --p95-output 64 --max-num-seqs 1024 --max-num-batched-tokens 8192 \
  --accelerate-batch-sizes 64,256 --out runs/offload-gpu "$@"
