#!/usr/bin/env bash
# results/repro/ from the study's run folders (issue 14 item 4): per regime the WER table, the
# paired comparison against flat and the update-norm table (md and csv), and the figures of
# both regimes together. Runs only `cluster-fl table` / `plot`: seconds, no training.
#   launch/repro_results.sh [RESULTS_ROOT=results] [OUT=results/repro]
set -euo pipefail
ROOT=${1:-results}
OUT=${2:-$ROOT/repro}
mkdir -p "$OUT"
found=()
for regime in heavy mild; do
  runs="$ROOT/repro-$regime"
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
