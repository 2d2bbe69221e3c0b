# Sourced by the prepared GPU scripts (gpu_check.sh, gpu_bench.sh) from the repository root:
#   . tools/gpu_env.sh DEFAULT_OUT
# sets OUT (created) and PY; installs the wheels of $WHEELS when given (megatron-core and the small
# pure-Python packages a GPU machine lacks) into $SITE under a timeout of WHEELS_TIMEOUT_S (60) s, and
# exports SETUP_S (the seconds it took) and SETUP_PROBLEM (empty when it worked: the caller decides
# what a failed install stops); exports PYTHONPATH; prints the GPU when nvidia-smi is there.
# DRY_RUN set (not 0): installs nothing.
# shellcheck shell=bash
OUT=${OUT:-$1}
mkdir -p "$OUT"
PY=${PY:-python3}
SITE=${SITE:-/tmp/moe_rl_site}
SETUP_S=0
SETUP_PROBLEM=
if [ -n "${WHEELS:-}" ] && [ "${DRY_RUN:-0}" = 0 ]; then
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    setup_start=$SECONDS
    if ! timeout "${WHEELS_TIMEOUT_S:-60}" "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --target "$SITE" "$WHEELS"/*.whl; then
      SETUP_PROBLEM="pip install of $WHEELS/*.whl failed or ran past ${WHEELS_TIMEOUT_S:-60} s"
    fi
    SETUP_S=$(( SECONDS - setup_start ))
    export PYTHONPATH=$SITE:${PYTHONPATH:-}
  else
    SETUP_PROBLEM="WHEELS=$WHEELS holds no .whl file"
  fi
fi
export SETUP_S SETUP_PROBLEM
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
