#!/usr/bin/env bash
# One prepared benchmark for a GPU machine: update-step and log-prob throughput and MFU
# of a ~2.4B-parameter Qwen3-MoE-shaped model (bf16, random init, nothing downloaded),
# moe_rl against bare megatron-core (tools/bench/gpu_update.py says what is measured).
# tools/gpu_check.sh runs the same benchmark on a model cut to 8 layers, among its other stages.
#
#   WHEELS=dir bash tools/gpu_bench.sh     # optional: install missing wheels from dir first
#   bash tools/gpu_bench.sh --batch 8 --iters 3   # options go to gpu_update.py
#
# Writes gpu_bench.md (and the log) under $OUT (default /tmp/moe_rl_gpu_bench) and prints it.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=tools/gpu_env.sh
. tools/gpu_env.sh /tmp/moe_rl_gpu_bench
if [ -n "$SETUP_PROBLEM" ]; then
  echo "gpu_bench.sh: $SETUP_PROBLEM" >&2
  exit 1
fi
"$PY" tools/bench/gpu_update.py --out "$OUT/gpu_bench.md" "$@" 2>&1 | tee "$OUT/gpu_bench.log"
exit "${PIPESTATUS[0]}"
