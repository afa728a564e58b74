#!/usr/bin/env bash
# Run the same experiment command on every host of a Cloud TPU pod slice (multi-controller JAX: one process per
# host; jax.distributed.initialize() finds the coordinator, the process count and each host's id by itself on
# Cloud TPU, so no JAX_* variables are set here).
#   bash launch/tpu_pod.sh TPU_NAME ZONE COMMAND...
#   bash launch/tpu_pod.sh my-v5e-16 us-west4-a python3 -m experiments.serve --config=configs/serve.py --workdir=/tmp/x
# Environment: PROJECT (gcloud --project, optional); REPO_DIR (the repo on every host, relative to the home
# directory or absolute; default pdjax: clone it and `pip install -e .` there first, e.g. with this same script);
# DRY_RUN=1 prints the gcloud command (shell-quoted, copy-pasteable) instead of running it.
# A serving command is first compiled here for TOPOLOGY (required; e.g. TOPOLOGY=v5e:4x4; SKIP_AOT=1 skips it) by
# experiments.aot_compile, and nothing is launched when a step does not compile or fit (launch/aot_check.sh).
set -euo pipefail
source "$(dirname "$0")/aot_check.sh"
if [ $# -lt 3 ]; then
  echo "usage: $0 TPU_NAME ZONE COMMAND..." >&2
  exit 2
fi
name=$1 zone=$2
shift 2
aot_check 1 "$@"
remote="cd $(printf '%q' "${REPO_DIR:-pdjax}") && $(printf '%q ' "$@")"
remote=${remote% }
cmd=(gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command="$remote")
if [ -n "${PROJECT:-}" ]; then
  cmd+=(--project="$PROJECT")
fi
if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
