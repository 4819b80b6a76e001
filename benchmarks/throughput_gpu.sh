#!/usr/bin/env bash
# The throughput benchmark on a CUDA GPU, in one command (bf16, larger batches):
#   bash benchmarks/throughput_gpu.sh [extra throughput.py args]
set -euo pipefail
cd "$(dirname "$0")/.."
export BATCHGEN_DATA_CACHE="${BATCHGEN_DATA_CACHE:-$PWD/.cache/batchgen-data}"
exec .venv/bin/python benchmarks/throughput.py --device cuda --dtype bfloat16 \
  --requests 2048 --max-num-seqs 1024 --attention-batch-size 256 --max-num-batched-tokens 8192 \
  --hf-cb-num-blocks 16384 --hf-cb-max-batch-tokens 2048 --static-batch-size 64 \
  --out runs/throughput-gpu "$@"
