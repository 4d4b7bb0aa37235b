#!/usr/bin/env bash
# The pre-registered study's inputs (results/repro/PROTOCOL.md §5, §6, §13), put in place and
# checked against the digests the protocol records, so that a new machine (or one whose cache was
# lost) starts the study from the same bytes: the corpus is rendered (the same bytes on every CPU)
# and its shards re-hashed, not only its manifest read; a starting model is COPIED from
# results/repro/starting-model/ and checked against its SHA256SUMS -- a step budget makes it
# independent of a machine's speed, not of its CPU's kernels (an AMD EPYC core without AMX
# rebuilt another model than the Intel AMX core that built the first one: results/LOG.md,
# 2026-12-06), so the bytes are committed. What is in place is checked, not rebuilt; a mismatch
# stops with both digests.
#   launch/repro_prepare.sh [main|starting-model|eurollm|private|rebuild|all]...  (default: main)
# main: corpus-v3 + the study's starting model (starting-model: that alone); eurollm: the EuroLLM-shaped one (pretrained,
# ~24 min on an idle 2-core machine, when none is committed yet: commit it before its grid);
# private: the 2,400-speaker corpus (~5 min); rebuild: pretrain the study's starting model from
# scratch into a new folder and compare it with the committed one (PROTOCOL §11; ~22 min).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CACHE=$HOME/.cache/cluster_fl   # where the study configs look (a symlink may put it elsewhere)
COMMITTED=results/repro/starting-model   # the starting models' bytes and SHA256SUMS
# PROTOCOL.md §5, §13
CORPUS_V3=d9eec085ac10fbac1e41b6ac802ee96ead2d59a1e56146eea2dc363ce13c247e
CORPUS_PRIVATE=7629bb9d9f02e75e3324cf8036fa995b11a347653234748f81150e6c28718658

corpus_digest() {  # the digest of the shards as they are on disk (manifest.json's rule)
  "$PYTHON" - "$1" <<'PY'
import hashlib, json, pathlib, sys
root = pathlib.Path(sys.argv[1])
shards = json.loads((root / "manifest.json").read_text())["shards"]
lines = "".join(f"{hashlib.sha256((root / s['path']).read_bytes()).hexdigest()}  {s['path']}\n"
                for s in shards)
print(hashlib.sha256(lines.encode()).hexdigest())
PY
}

check() {  # check NAME GOT WANT
  if [ "$2" != "$3" ]; then
    echo "repro_prepare: $1 differs from the protocol's: $2 (want $3)" >&2
    exit 1
  fi
  echo "repro_prepare: $1 ok (${3:0:16}...)"
}

corpus() {  # corpus DIR WANT [make-corpus options]
  local dir=$1 want=$2
  shift 2
  if [ ! -f "$dir/manifest.json" ]; then
    cluster-fl make-corpus "$dir" --quiet "$@"
  fi
  check "corpus $dir" "$(corpus_digest "$dir")" "$want"
}

out_of() {  # the pretrain config's checkpoint folder
  "$PYTHON" -c "import os,sys,yaml; print(os.path.expanduser(yaml.safe_load(open(sys.argv[1]))['pretrain']['out']))" "$1"
}

model() {  # model CONFIG: the committed starting model put in place and checked
  local config=$1 out name want
  out=$(out_of "$config")
  name=$(basename "$out")
  want=$(awk -v f="$name/model.pt" '$2 == f {print $1}' "$COMMITTED/SHA256SUMS")
  if [ ! -f "$out/model.pt" ]; then
    if [ -n "$want" ]; then
      mkdir -p "$out" && cp -r "$COMMITTED/$name/." "$out/"
    else
      cluster-fl pretrain "$config"
    fi
  fi
  local got
  got=$(sha256sum "$out/model.pt" | cut -d' ' -f1)
  if [ -z "$want" ]; then
    echo "repro_prepare: no committed starting model $name; built $out (SHA-256 $got)." >&2
    echo "  It becomes the study's when committed: cp -r $out/{model.pt,meta.json,tokenizer}" \
         "$COMMITTED/$name/ and add its line to $COMMITTED/SHA256SUMS" >&2
    exit 1
  fi
  check "starting model $out" "$got" "$want"
}

rebuild() {  # PROTOCOL §11: the recipe from scratch against the committed bytes
  local config=configs/pretrain-repro.yaml out name want got
  out=$(out_of "$config")-rebuild
  name=$(basename "${out%-rebuild}")
  want=$(awk -v f="$name/model.pt" '$2 == f {print $1}' "$COMMITTED/SHA256SUMS")
  [ -f "$out/model.pt" ] || cluster-fl pretrain "$config" "pretrain.out=$out"
  got=$(sha256sum "$out/model.pt" | cut -d' ' -f1)
  grep -m1 "model name" /proc/cpuinfo 2>/dev/null || true
  check "rebuilt starting model $out" "$got" "$want"
}

[ $# -gt 0 ] || set -- main
for part in "$@"; do
  case $part in
    main) corpus "$CACHE/corpus-v3" $CORPUS_V3
          model configs/pretrain-repro.yaml ;;
    starting-model) model configs/pretrain-repro.yaml ;;
    eurollm) corpus "$CACHE/corpus-v3" $CORPUS_V3
          model configs/pretrain-repro-eurollm.yaml ;;
    private) corpus "$CACHE/corpus-private" $CORPUS_PRIVATE --private-speakers 300 ;;
    rebuild) corpus "$CACHE/corpus-v3" $CORPUS_V3
          rebuild ;;
    all) "$0" main eurollm private ;;
    *) echo "usage: $0 [main|starting-model|eurollm|private|rebuild|all]..." >&2; exit 2 ;;
  esac
done
