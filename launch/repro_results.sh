#!/usr/bin/env bash
# results/repro/ from the study's run folders: per grid the WER table, the paired comparison
# against flat (seed-level paired t-test, Holm across the table: results/repro/PROTOCOL.md) and
# the update-norm table (md and csv) -- the two regimes (heavy, mild) and the secondary grids of
# PROTOCOL §13 (eurollm: the third architecture; private: epsilon <= 10) -- and the figures of
# the two regimes together, and the pre-registered findings' outcomes (findings.md,
# cluster_fl/report/findings.py). Runs only `cluster-fl table` / `plot`: seconds, no training.
#   launch/repro_results.sh [RESULTS_ROOT=results] [OUT=results/repro] [PREFIX=prereg]
# PREFIX names the experiments read, <PREFIX>-heavy, -mild, -eurollm, -private: `prereg`, the
# pre-registered study (configs/grids/repro-*.yaml); `repro`, the first study.
set -euo pipefail
ROOT=${1:-results}
OUT=${2:-$ROOT/repro}
PREFIX=${3:-prereg}
mkdir -p "$OUT"
found=()
main=()
for regime in heavy mild eurollm private; do
  runs="$ROOT/$PREFIX-$regime"
  [ -d "$runs" ] && compgen -G "$runs/*/final.parquet" >/dev/null || { echo "no runs in $runs yet"; continue; }
  found+=("$runs")
  case $regime in heavy|mild) main+=("$runs");; esac
  for fmt in md csv; do
    cluster-fl table "$runs" --format "$fmt" --out "$OUT/$regime.$fmt"
    # a regime still running may have no flat run (or no diagnostics) yet: say so, go on
    cluster-fl table "$runs" --against flat --format "$fmt" --out "$OUT/$regime-vs-flat.$fmt" \
      || echo "  ($regime: no paired table yet)"
    cluster-fl table "$runs" --norms --format "$fmt" --out "$OUT/$regime-norms.$fmt" \
      || echo "  ($regime: no norm table yet)"
    # finding d (PROTOCOL §1): mild, every method against alpha-split at calibrate's alpha (0.5)
    [ "$regime" != mild ] || cluster-fl table "$runs" --against "alpha-split α=0.5 per-layer" \
      --format "$fmt" --out "$OUT/mild-vs-alpha-split.$fmt" || echo "  (mild: no α-split table yet)"
  done
done
[ ${#found[@]} -gt 0 ] || { echo "no study runs under $ROOT" >&2; exit 1; }
# the pre-registered findings' outcomes (PROTOCOL §1, §13) from the tables above
python3 -m cluster_fl.report.findings "$OUT" --out "$OUT/findings.md"
[ ${#main[@]} -gt 0 ] || exit 0
rm -rf "$OUT/figures"
cluster-fl plot "${main[@]}" --out "$OUT/figures"
