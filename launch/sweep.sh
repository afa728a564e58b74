#!/usr/bin/env bash
# Run a sweep config on this machine, resumable: rerunning the same command skips finished points.
#   bash launch/sweep.sh configs/sweeps/sarathi_ablation_paper.py:chat /tmp/abl_chat [PARALLEL]
# PARALLEL defaults to the number of CPU cores for simulator sweeps and to 1 for real-engine sweeps (one engine
# per accelerator; on CPU, parallel engines would share the same cores and distort each other's timings).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 CONFIG[:ARG] WORKDIR [PARALLEL]" >&2
  exit 2
fi
config=$1 workdir=$2
cd "$(dirname "$0")/.."
if [ $# -ge 3 ]; then
  parallel=$3
elif grep -q 'backend = "sim"\|paper_base' "${config%%:*}"; then
  parallel=$(nproc)
else
  parallel=1
fi
exec python3 -m experiments.sweep --config="$config" --workdir="$workdir" --parallel="$parallel"
