#!/usr/bin/env bash
# results/repro/ from the study's run folders: per regime the WER table, the paired comparison
# against flat (seed-level paired t-test, Holm across the table: results/repro/PROTOCOL.md) and
# the update-norm table (md and csv), and the figures of both regimes together. Runs only
# `cluster-fl table` / `plot`: seconds, no training.
#   launch/repro_results.sh [RESULTS_ROOT=results] [OUT=results/repro] [PREFIX=prereg]
# PREFIX names the experiments read, <PREFIX>-heavy and <PREFIX>-mild: `prereg`, the
# pre-registered study (configs/grids/repro-*.yaml, issue 27); `repro`, the first study (issue 14).
set -euo pipefail
ROOT=${1:-results}
OUT=${2:-$ROOT/repro}
PREFIX=${3:-prereg}
mkdir -p "$OUT"
found=()
for regime in heavy mild; do
  runs="$ROOT/$PREFIX-$regime"
  [ -d "$runs" ] && compgen -G "$runs/*/final.parquet" >/dev/null || { echo "no runs in $runs yet"; continue; }
  found+=("$runs")
  for fmt in md csv; do
    cluster-fl table "$runs" --format "$fmt" --out "$OUT/$regime.$fmt"
    # a regime still running may have no flat run (or no diagnostics) yet: say so, go on
    cluster-fl table "$runs" --against flat --format "$fmt" --out "$OUT/$regime-vs-flat.$fmt" \
      || echo "  ($regime: no paired table yet)"
    cluster-fl table "$runs" --norms --format "$fmt" --out "$OUT/$regime-norms.$fmt" \
      || echo "  ($regime: no norm table yet)"
  done
done
[ ${#found[@]} -gt 0 ] || { echo "no study runs under $ROOT" >&2; exit 1; }
rm -rf "$OUT/figures"
cluster-fl plot "${found[@]}" --out "$OUT/figures"
