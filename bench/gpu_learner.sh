#!/usr/bin/env bash
# The JAX learner benchmarks on a GPU in bf16, in one go (a few minutes):
#
#     bash bench/gpu_learner.sh            # results in bench-gpu/*.json (OUT=dir to change)
#
# Needs jax with CUDA, flax, optax, orbax-checkpoint, numpy, ml_dtypes and this repository on
# the path (no vLLM, no ml-collections, no model download: the ~1B Llama is random-initialised).
# Each line printed is one JSON result of bench/learner_step.py: the train step's model FLOP/s
# divided by a large bf16 jnp matmul's FLOP/s measured in the same run (target >= 0.4).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-gpu}
PY=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt" || true
run() {
    local name=$1
    shift
    echo "== $name: bench/learner_step.py $*"
    timeout 300 "$PY" bench/learner_step.py "$@" | tail -1 | tee "$OUT/$name.json"
}
run llama1b_bf16_b16_s1024 --model llama1b --dtype bfloat16 --batch 16 --seq 1024 --steps 5
run llama1b_bf16_b16_s1024_remat --model llama1b --dtype bfloat16 --batch 16 --seq 1024 \
    --steps 5 --remat
run llama1b_bf16_b8_s2048 --model llama1b --dtype bfloat16 --batch 8 --seq 2048 --steps 5
run llama1b_fp32_b8_s1024 --model llama1b --dtype float32 --batch 8 --seq 1024 --steps 5
