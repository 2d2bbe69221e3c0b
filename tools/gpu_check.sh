#!/usr/bin/env bash
# The prepared GPU check: one script for one lease of one GPU (9 minutes, the machine's start
# included). Its stages (tools/gpu/plan.py) answer, each under its own timeout and with its own
# record, so that one failure hides nothing:
#   environment         torch / CUDA / GPU / megatron-core / transformer-engine / transformers / sglang
#   gpu_tests           tests/gpu (TE spec, alltoall dispatcher, NCCL vs HF transformers)
#   update_mfu          update-step MFU of moe_rl and of bare megatron-core (tools/bench/gpu_update.py)
#   r3_decode           `moe-rl serve` on CUDA, 48 decoded tokens: engine vs trainer routes and log-probs, R3
#   r3_two_turn         `moe-rl train` with R3 on two-turn tool episodes: mismatch per turn
#   weight_sync         disk and tensor sync seconds; the nccl protocol over gloo to a server on this GPU
#   async               samples/s with algo.max_staleness=0 vs 1
#   colocated           colocated release / resume with decoding: rewards and log-probs unchanged
#   *_sglang            the same against a real SGLang server (skipped, with the reason, when sglang
#                       does not import: its CUDA wheels do not fit the carried wheels)
#
#   WHEELS=dir bash tools/gpu_check.sh               # install the wheels in dir first (optional)
#   bash tools/gpu_check.sh --only async,colocated   # some stages (--skip a,b leaves some out)
#   DRY_RUN=1 bash tools/gpu_check.sh                # or --dry-run: no GPU; prints every stage's
#                                                    # commands, checks their configs, runs nothing
#
# Writes under $OUT (default /tmp/moe_rl_gpu_check) results.json (one record per stage, a summary),
# gpu_check.log (every stage's output), train_metrics.json (the train runs' metrics) and
# gpu_update.md (the benchmark's report); scratch under $WORK (default /tmp/moe_rl_gpu_work).
# Exits 1 when a stage failed (skips are not failures). tools/gpu/driver.py says the rest.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
args=()
for a in "$@"; do
  if [ "$a" = --dry-run ]; then DRY_RUN=1; else args+=("$a"); fi
done
if [ "${DRY_RUN:-0}" != 0 ]; then
  DRY_RUN=1
  args+=(--dry-run)
fi
# shellcheck source=tools/gpu_env.sh
. tools/gpu_env.sh /tmp/moe_rl_gpu_check
WORK=${WORK:-/tmp/moe_rl_gpu_work}
"$PY" tools/gpu/driver.py --out "$OUT" --work "$WORK" --python "$PY" ${args[@]+"${args[@]}"}
