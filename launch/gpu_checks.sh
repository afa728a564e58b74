#!/usr/bin/env bash
# The accelerator checks as one prepared script (device time is short; run it once, read the outputs after).
#   bash launch/gpu_checks.sh [OUT_DIR]
# 1. compiled Pallas kernels vs the numpy oracle (pytest -m gpu; on a TPU machine: -m tpu),
# 2. attention benchmark: our kernels, the jnp reference and jax's bundled paged_attention side by side,
# 3. model-step benchmark on an 8B-shaped spec,
# 4. engine loop: sync vs async scheduling,
# 5. calibration of the simulator on this machine's engine.
# Every step writes its own file under OUT_DIR and a failure does not stop the later steps.
set -u
OUT=${1:-${OUT:-/tmp/pdjax_gpu}}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)      # a relative OUT_DIR is relative to the caller's directory, not to the repo
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
marker=gpu
python3 -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'tpu' else 1)" 2>/dev/null && marker=tpu
step() {  # step NAME COMMAND...: run, keep stdout as NAME.out and stderr as NAME.log, report the status
  local name=$1; shift
  local start=$SECONDS
  "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
  echo "$name: exit $? in $((SECONDS - start)) s"
}
step kernels python3 -m pytest -q -m "$marker" tests/test_pallas_attention.py tests/test_kernel_model.py
step bench_attention python3 -m experiments.bench_attention
step bench_step python3 -m experiments.bench_step --spec=llama-3-8b
step bench_engine python3 -m experiments.bench_engine --checkpoint=tiny-byte --repeat=3
step calibrate python3 -m experiments.calibrate --config=configs/serve.py --config.model.checkpoint=llama-3-8b \
  --config.model.dtype=bfloat16 --config.sim.hardware="${HARDWARE:-h200}" --out="$OUT/profile.json"
tail -n 3 "$OUT/kernels.out"
