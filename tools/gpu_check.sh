#!/usr/bin/env bash
# One prepared check for a GPU machine: the CUDA path of the policy (TE spec when
# transformer-engine imports, alltoall dispatcher, NCCL) against HF transformers.
#
#   WHEELS=dir bash tools/gpu_check.sh     # optional: install missing wheels from dir first
#
# Prints the environment, runs tests/gpu and `moe-rl check-parity` on one GPU, then
# `moe-rl train` for 3 steps with R2 and with R3: one trainer rank under NCCL (fp32, padded
# micro-batches since TE has no fp32 packed attention) and `moe-rl serve` on the same GPU
# (weights synced from disk: NCCL refuses two ranks of one GPU in the nccl update group).
# Writes parity.json, the pytest log and each run's metrics under $OUT
# (default /tmp/moe_rl_gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=tools/gpu_env.sh
. tools/gpu_env.sh /tmp/moe_rl_gpu_check
$PY - <<'PY'
import torch, importlib
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
for mod in ("megatron.core", "transformer_engine", "transformers"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception as e:
        print(mod, "NOT AVAILABLE:", type(e).__name__, str(e).splitlines()[0][:120])
PY
$PY -m pytest -q -s -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/pytest_gpu.log"
status=${PIPESTATUS[0]}
$PY - <<PY
from moe_rl.testing import make_tiny_qwen3_moe
make_tiny_qwen3_moe("$OUT/tiny_hf")
PY
$PY -m moe_rl.cli check-parity --hf-model "$OUT/tiny_hf" --layouts single --json "$OUT/parity.json" --tolerance 1e-3
status=$(( status || $? ))
for replay in r2 r3; do
  $PY -m moe_rl.cli train --config launch/configs/tiny_cpu.yaml train.steps=3 train.world_size=1 \
    parallel.ep=1 parallel.max_tokens_per_microbatch=null algo.replay=$replay train.eval_every=0 train.save_every=0 \
    log.progress=false log.tensorboard=false log.run_dir="$OUT/train_$replay" 2>&1 | tail -n 20
  status=$(( status || PIPESTATUS[0] ))
  echo "--- metrics of the $replay run (step, reward, pg_loss, rollout mismatch, |d logp|, step s) ---"
  $PY - "$OUT/train_$replay/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    print(m["step"], *(f"{k}={m.get(k, float('nan')):.4g}" for k in
          ("reward/mean", "loss/pg_loss", "drift/rollout_mismatch", "drift/logp_abs_diff", "perf/step_s")))
PY
done
exit $status
