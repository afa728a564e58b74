#!/usr/bin/env bash
# Run a sweep config on this machine, resumable: rerunning the same command skips finished points.
#   bash launch/sweep.sh configs/sweeps/sarathi_ablation_paper.py:chat /tmp/abl_chat [PARALLEL [FLAGS...]]
# Relative CONFIG and WORKDIR paths are relative to the directory you run this from (not to the repo).
# PARALLEL defaults to the number of CPU cores for simulator sweeps and to 1 for real-engine sweeps (one engine
# per accelerator; on CPU, parallel engines would share the same cores and distort each other's timings); pass
# "" to keep that default while giving FLAGS. FLAGS go to experiments.sweep as they are, e.g. --rerun_changed or
# --config.base.workload.num_requests=12.
# SWEEP_DRY_RUN=1 prints the command (with the resolved paths) instead of running it.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 CONFIG[:ARG] WORKDIR [PARALLEL [FLAGS...]]" >&2
  exit 2
fi
abspath() { case $1 in /*) printf '%s' "$1" ;; *) printf '%s/%s' "$PWD" "$1" ;; esac; }
config_file=${1%%:*}
config_arg=${1#"$config_file"}          # ":ARG" or empty
if [ ! -f "$config_file" ]; then
  echo "$0: config file '$config_file' not found (relative to $PWD)" >&2
  exit 2
fi
config=$(abspath "$config_file")$config_arg
workdir=$(abspath "$2")
parallel=${3:-}
if [ $# -ge 3 ]; then shift 3; else shift $#; fi
if [ -z "$parallel" ]; then
  if [ "$config_arg" = ":sim" ] || grep -q 'backend = "sim"\|paper_base' "$config_file"; then
    parallel=$(nproc)
  else
    parallel=1
  fi
elif ! [[ $parallel =~ ^[1-9][0-9]*$ ]]; then
  echo "$0: PARALLEL='$parallel', expected a positive integer" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
cmd=(python3 -m experiments.sweep --config="$config" --workdir="$workdir" --parallel="$parallel" "$@")
if [ -n "${SWEEP_DRY_RUN:-}" ]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
