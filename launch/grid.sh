#!/usr/bin/env bash
# Submit a grid (default: the paper's) to SLURM with submitit; rerunning it submits only what is
# missing or failed. Extra arguments go to `cluster-fl grid` (e.g. --dry-run, --set fl.rounds=2).
#   launch/grid.sh configs/grids/paper.yaml --dry-run
#   CLUSTER=local launch/grid.sh configs/grids/tiny.yaml --wait
set -euo pipefail
GRID=${1:-configs/grids/paper.yaml}
shift || true
exec cluster-fl grid "$GRID" --cluster "${CLUSTER:-slurm}" "$@"
