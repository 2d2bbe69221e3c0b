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
# Then the colocated shape on that one GPU (release / resume across evals; with SGLang installed
# also against a real SGLang server). Writes parity.json, the pytest log and each run's metrics under $OUT
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
# Colocated on one GPU (the trainer's rank and the server share GPU 0; the server starts with
# --enable-memory-saver and is released after every rollout, resumed before the next, with an
# eval every step and a step skipped by dynamic sampling between): the rewards must equal a
# non-colocated run of the same seed, and every step's engine log-probs the trainer's.
COLO=(--config launch/configs/rehearsal_cpu_colocated.yaml train.world_size=1 parallel.ep=1
      parallel.max_tokens_per_microbatch=null train.device_guard=false train.steps=4 log.progress=false)
for colocated in true false; do
  $PY -m moe_rl.cli train "${COLO[@]}" rollout.colocated=$colocated log.run_dir="$OUT/colocated_$colocated" \
    2>&1 | tail -n 5
  status=$(( status || PIPESTATUS[0] ))
done
$PY - "$OUT" <<'PY'
import json, sys
rows = {c: [json.loads(x) for x in open(f"{sys.argv[1]}/colocated_{c}/metrics.jsonl")] for c in ("true", "false")}
same = [a["reward/mean"] == b["reward/mean"] for a, b in zip(rows["true"], rows["false"])]
diffs = [r.get("drift/logp_abs_diff") for r in rows["true"] if "drift/logp_abs_diff" in r]
print("colocated vs not, rewards per step equal:", same, "| colocated |d logp| per trained step:", diffs)
sys.exit(0 if all(same) and len(same) == 4 and all(d <= 1e-3 for d in diffs) else 1)
PY
status=$(( status || $? ))
# With SGLang installed: a colocated SGLang server on the trainer's GPU, released and resumed across
# evals (its weights region comes back empty without --enable-weights-cpu-backup): the engine's
# log-probs must stay the trainer's on every trained step.
if $PY -c "import sglang" 2>/dev/null; then
  $PY -m moe_rl.cli train "${COLO[@]}" rollout.engine=sglang rollout.mem_fraction=0.3 \
    log.run_dir="$OUT/colocated_sglang" 2>&1 | tail -n 5
  status=$(( status || PIPESTATUS[0] ))
  $PY - "$OUT/colocated_sglang/metrics.jsonl" <<'PY'
import json, sys
diffs = [json.loads(x).get("drift/logp_abs_diff") for x in open(sys.argv[1])]
print("colocated SGLang |d logp| per step:", diffs)
sys.exit(0 if all(d is None or d <= 0.05 for d in diffs) else 1)
PY
  status=$(( status || $? ))
fi
exit $status
