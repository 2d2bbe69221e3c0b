#!/usr/bin/env bash
# One prepared check for a GPU machine: the CUDA path of the policy (TE spec when
# transformer-engine imports, alltoall dispatcher, NCCL) against HF transformers.
#
#   WHEELS=dir bash tools/gpu_check.sh     # optional: install missing wheels from dir first
#
# Prints the environment, runs tests/gpu and `moe-rl check-parity` on one GPU, and
# writes parity.json and the pytest log under $OUT (default /tmp/moe_rl_gpu_check).
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
exit $(( status || $? ))
