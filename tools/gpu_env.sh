# Sourced by the prepared GPU scripts (gpu_check.sh, gpu_bench.sh) from the repository root:
#   . tools/gpu_env.sh DEFAULT_OUT
# sets OUT (created) and PY, installs wheels from $WHEELS when given (for machines
# without megatron-core and our dependencies), exports PYTHONPATH, prints the GPU.
# shellcheck shell=bash
OUT=${OUT:-$1}
mkdir -p "$OUT"
PY=${PY:-python3}
if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/moe_rl_site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/moe_rl_site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
