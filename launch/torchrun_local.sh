#!/usr/bin/env bash
# One experiment on N local ranks (CPU: gloo; GPU: one rank per device).
#   launch/torchrun_local.sh 2 configs/demo.yaml fl.rounds=2
# The trained model is bitwise identical for 1, 2 or 8 ranks with the same seed (research mode).
set -euo pipefail
NPROC=${1:?usage: torchrun_local.sh NPROC CONFIG [key=value ...]}
shift
exec python -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node="$NPROC" \
  -m cluster_fl train "$@"
