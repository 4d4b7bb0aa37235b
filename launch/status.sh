#!/usr/bin/env bash
# Where a grid stands: done / running / pending / failed / missing per cell and seed.
#   launch/status.sh configs/grids/paper.yaml
set -euo pipefail
exec cluster-fl status "${1:-configs/grids/paper.yaml}" "${@:2}"
