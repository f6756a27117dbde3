#!/usr/bin/env bash
# The JAX learner benchmarks on a GPU in bf16, in one go (a few minutes):
#
#     bash bench/gpu_learner.sh            # results in bench-gpu/*.json (OUT=dir to change)
#     SMOKE=1 bash bench/gpu_learner.sh    # the same runs on a tiny random Llama, 1 step (CPU)
#
# Needs jax with CUDA, flax, optax, orbax-checkpoint, numpy, ml_dtypes and this repository on
# the path (no vLLM, no ml-collections, no model download: the ~1B Llama is random-initialised).
# PYTHON=path picks the interpreter. Each line printed is one JSON result of
# bench/learner_step.py: the train step's model FLOP/s divided by a large bf16 jnp matmul's
# FLOP/s measured in the same run (target >= 0.4). A run that fails (out of memory, say) does
# not stop the others; the script then exits 1 and names it.
# SMOKE=1 checks this script itself on a CPU (tests/test_bench.py): every run keeps its dtype and
# remat, but on a tiny random Llama (SMOKE_MODEL=folder, else learner_step's `tiny`, which needs
# torch and transformers to build) with tiny shapes and 1 step; its figures mean nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SMOKE_ARGS=()
if [[ ${SMOKE:-0} == 1 ]]; then
    # Later flags win in argparse: these replace each run's model, shapes and step count.
    SMOKE_ARGS=(--model "${SMOKE_MODEL:-tiny}" --batch 2 --seq 16 --steps 1 --matmul-size 256)
else
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt" || true
    # JAX takes 75% of the GPU by default; the bf16 16x1024 step without remat needs ~126 GiB
    # (an H200 has 140), and nothing else runs on the GPU meanwhile.
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
fi
FAILED=()
run() {
    local name=$1
    shift
    echo "== $name: bench/learner_step.py $* ${SMOKE_ARGS[*]}"
    if ! timeout 300 "$PY" bench/learner_step.py "$@" "${SMOKE_ARGS[@]}" | tail -1 |
        tee "$OUT/$name.json"; then
        FAILED+=("$name")
    fi
}
run llama1b_bf16_b16_s1024 --model llama1b --dtype bfloat16 --batch 16 --seq 1024 --steps 5
run llama1b_bf16_b16_s1024_remat --model llama1b --dtype bfloat16 --batch 16 --seq 1024 \
    --steps 5 --remat
# Remat at 2048: the attention keeps its T x T float32 scores for the backward pass, 64 GiB
# over the 16 layers at this length, which does not fit beside the rest on an H200.
run llama1b_bf16_b8_s2048_remat --model llama1b --dtype bfloat16 --batch 8 --seq 2048 \
    --steps 5 --remat
run llama1b_fp32_b8_s1024 --model llama1b --dtype float32 --batch 8 --seq 1024 --steps 5
if ((${#FAILED[@]})); then
    echo "failed: ${FAILED[*]}" >&2
    exit 1
fi
