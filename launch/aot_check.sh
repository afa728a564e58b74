# Sourced by tpu_pod.sh and slurm.sbatch: before a pod or cluster runs a serving command (experiments.serve or
# experiments.api_server), compile its config here for the accelerators it will run on (experiments.aot_compile:
# every bucket of every group, per-device HBM, needs the 'tpu' extra) and stop the launch when a step does not
# compile or fit. TOPOLOGY names the slice (e.g. v5e:4x4, v6e:2x4); SKIP_AOT=1 skips the check. With DRY_RUN the
# check's command is printed (one line, before the launch's).
# aot_check REQUIRED COMMAND...: REQUIRED=1 refuses to launch a serving command without TOPOLOGY (a TPU pod: the
# check can always run); 0 runs it only when TOPOLOGY is set (a GPU cluster: TOPOLOGY=h100:2x8, the gpu-aot extra).
aot_check() {
  local required=$1; shift
  local serving=0 arg
  for arg in "$@"; do
    case $arg in experiments.serve|experiments.api_server) serving=1 ;; esac
  done
  if [ "$serving" = 0 ] || [ -n "${SKIP_AOT:-}" ]; then
    return 0
  fi
  if [ -z "${TOPOLOGY:-}" ]; then
    if [ "$required" = 1 ]; then
      echo "error: set TOPOLOGY to the slice's topology (e.g. TOPOLOGY=v5e:4x4) so the config is compiled for it" \
           "before the launch (experiments.aot_compile), or SKIP_AOT=1" >&2
      exit 2
    fi
    return 0
  fi
  local check=(python3 -m experiments.aot_compile --topology="$TOPOLOGY")
  for arg in "$@"; do
    case $arg in --config=*|--config.*) check+=("$arg") ;; esac
  done
  if [ -n "${DRY_RUN:-}" ]; then
    printf '%q ' "${check[@]}"
    echo
    return 0
  fi
  (cd "$(dirname "${BASH_SOURCE[0]}")/.." && "${check[@]}") || {
    echo "error: the ahead-of-time check failed (above): not launching" >&2
    exit 1
  }
}
