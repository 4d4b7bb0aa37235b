#!/usr/bin/env bash
# The pre-registered study (results/repro/PROTOCOL.md) step by step, resumable: every step puts
# its inputs in place and checks them (launch/repro_prepare.sh), and a grid skips its finished
# runs, so after a crash, a lost machine or a session's end the same command goes on where it
# stopped. Steps, in the protocol's compute order (default: all of them):
#   sweep    the client-LR sweep on tuning seed 100, then its picks (launch/repro_lr_sweep.sh)
#   heavy    the heavy regime's 9 methods x 5 seeds, with round-0
#   mild     the mild regime's, with round-0
#   eurollm  the third architecture (§13), from its own committed starting model
#   private  the epsilon <= 10 table (§13) on the 2,400-speaker corpus
#   tables   results/repro/ (launch/repro_results.sh)
#   launch/repro_study.sh [STEP]...
# CLUSTER=local (default: this machine's cores, two runs at a time) or slurm (submitted and
# waited for); PRIVATE_DEVICE (default: cuda on slurm, cpu locally) is the epsilon <= 10 grid's
# run.device; PARALLEL (default 2) how many of its runs go at a time on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER=${CLUSTER:-local}
if [ "$CLUSTER" = slurm ]; then PRIVATE_DEVICE=${PRIVATE_DEVICE:-cuda}; else PRIVATE_DEVICE=${PRIVATE_DEVICE:-cpu}; fi

grid() {  # grid NAME [options]: one of configs/grids/repro-*.yaml, waited for
  local name=$1
  shift
  echo "repro_study: grid $name ($CLUSTER)"
  cluster-fl grid "configs/grids/repro-$name.yaml" --cluster "$CLUSTER" --wait "$@"
}

[ $# -gt 0 ] || set -- sweep heavy mild eurollm private tables
for step in "$@"; do
  case $step in
    sweep) launch/repro_prepare.sh main
           grid lr-sweep
           launch/repro_lr_sweep.sh ;;
    heavy|mild) launch/repro_prepare.sh main
           grid "$step" --round0 ;;
    eurollm) launch/repro_prepare.sh eurollm
           grid eurollm --round0 ;;
    private) launch/repro_prepare.sh starting-model private
           # the grid asks a GPU a run, all 9 at once; on CPU, as the other grids: two runs at a
           # time, one thread each (9 runs at once on 2 cores would finish none for hours)
           cpu=()
           [ "$PRIVATE_DEVICE" = cpu ] && cpu=(--parallel "${PARALLEL:-2}" --set run.threads=1)
           grid private --round0 --set "run.device=$PRIVATE_DEVICE" "${cpu[@]}" ;;
    tables) launch/repro_results.sh ;;
    *) echo "usage: $0 [sweep|heavy|mild|eurollm|private|tables]..." >&2; exit 2 ;;
  esac
done
