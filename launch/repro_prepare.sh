#!/usr/bin/env bash
# The pre-registered study's inputs (results/repro/PROTOCOL.md §5, §6, §13) built from nothing and
# checked against the digests and SHA-256s the protocol records, so that a new machine (or one
# whose cache was lost) starts the study from the same bytes: the corpus (its shards re-hashed,
# not only the manifest read), the step-budgeted starting models, the epsilon <= 10 corpus.
# What is already built is checked, not rebuilt; a mismatch stops with the two digests.
#   launch/repro_prepare.sh [main|eurollm|private|all]...   (default: main)
# main: corpus-v3 + the study's starting model (~1 min + ~24 min on an idle 2-core machine);
# eurollm: its EuroLLM-shaped starting model (~24 min); private: the 2,400-speaker corpus (~5 min).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CACHE=$HOME/.cache/cluster_fl   # where the study configs look (a symlink may put it elsewhere)
# PROTOCOL.md §5, §6, §13
CORPUS_V3=d9eec085ac10fbac1e41b6ac802ee96ead2d59a1e56146eea2dc363ce13c247e
CORPUS_PRIVATE=7629bb9d9f02e75e3324cf8036fa995b11a347653234748f81150e6c28718658
MODEL_MAIN=7a6706b22bb9ac8d5b78c1d4c22dcd4fa18d0ccb1c65011636607ae28c6e1f7b
MODEL_EUROLLM=955791fa6743c12f545be524b38857b13d942ed240f61930329c18a2e7c5f217

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

model() {  # model CONFIG WANT: the pretrain config's checkpoint, built if missing
  local config=$1 want=$2 out
  out=$("$PYTHON" -c "import os,sys,yaml; print(os.path.expanduser(yaml.safe_load(open(sys.argv[1]))['pretrain']['out']))" "$config")
  if [ ! -f "$out/model.pt" ]; then
    cluster-fl pretrain "$config"
  fi
  check "starting model $out" "$(sha256sum "$out/model.pt" | cut -d' ' -f1)" "$want"
}

[ $# -gt 0 ] || set -- main
for part in "$@"; do
  case $part in
    main) corpus "$CACHE/corpus-v3" $CORPUS_V3
          model configs/pretrain-repro.yaml $MODEL_MAIN ;;
    eurollm) corpus "$CACHE/corpus-v3" $CORPUS_V3
          model configs/pretrain-repro-eurollm.yaml $MODEL_EUROLLM ;;
    private) corpus "$CACHE/corpus-private" $CORPUS_PRIVATE --private-speakers 300 ;;
    all) "$0" main eurollm private ;;
    *) echo "usage: $0 [main|eurollm|private|all]..." >&2; exit 2 ;;
  esac
done
