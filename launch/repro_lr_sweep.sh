#!/usr/bin/env bash
# The client-LR sweep's tables and picks (results/repro/PROTOCOL.md, "Client learning rate"):
# per regime and LR the WER table of the sweep's runs (tuning seeds), then, for each (regime,
# method), the LR with the lowest mean WER over the tuning seeds -- ties within 0.005 go to the
# smaller LR; picks.csv names each method as the table does and as the grid does (grid_method,
# what the study grids' entries are checked against). Runs only `cluster-fl table`: seconds.
#   launch/repro_lr_sweep.sh [RUNS=results/prereg-lr-sweep] [OUT=results/repro/lr-sweep]
set -euo pipefail
RUNS=${1:-results/prereg-lr-sweep}
OUT=${2:-results/repro/lr-sweep}
TIE=0.005
[ -d "$RUNS" ] || { echo "no sweep runs in $RUNS" >&2; exit 1; }
mkdir -p "$OUT"
for regime in heavy mild; do
  # a regime without runs yet (the sweep runs heavy first) is skipped, not an error
  for dir in "$RUNS"/*__"$regime"__*__lr-*__s*; do [ -e "$dir" ] && basename "$dir" || true; done \
    | sed -E 's/.*__(lr-[^_]+)__s[0-9]+$/\1/' | sort -u | while read -r lr; do
    cluster-fl table "$RUNS"/*__"$regime"__*__"$lr"__s* --format csv --out "$OUT/$regime-$lr.csv"
  done
done
python3 - "$OUT" "$TIE" "$RUNS" <<'PY'
import csv, pathlib, sys
from cluster_fl.report.results import find_runs
out, tie = pathlib.Path(sys.argv[1]), float(sys.argv[2])
# the grid's name for each (regime, table label): the study grids' entries are looked up by it
grid_name = {}
for run in find_runs([sys.argv[3]]):
    _, regime, name, *_ = run.folder.name.split("__")
    if grid_name.setdefault((regime, run.method), name) != name:
        sys.exit(f"{regime}: {run.method!r} is two grid entries ({name}, {grid_name[regime, run.method]})")
rows = []
for path in sorted(out.glob("*-lr-*.csv")):
    regime, lr = path.stem.split("-lr-", 1)
    for r in csv.DictReader(path.open()):
        rows.append((regime, r["method"], float(lr), float(r["wer_mean"]), r["n_seeds"]))
with (out / "picks.csv").open("w", newline="") as fh:
    w = csv.writer(fh)
    w.writerow(["regime", "method", "grid_method", "lr", "wer_mean", "n_seeds", "candidates"])
    for key in sorted({(g, m) for g, m, *_ in rows}):
        cands = sorted((lr, wer, n) for g, m, lr, wer, n in rows if (g, m) == key)
        best = min(wer for _, wer, _ in cands)
        lr, wer, n = next(c for c in cands if c[1] <= best + tie)  # the smallest LR within TIE
        w.writerow([*key, grid_name[key], lr, wer, n, " ".join(f"{c[0]:g}:{c[1]:.4f}" for c in cands)])
        print(f"{key[0]:6s} {grid_name[key]:30s} {key[1]:40s} lr {lr:g}  (WER {wer:.4f}; {len(cands)} LRs)")
print(f"wrote {out / 'picks.csv'}")
PY
