#!/usr/bin/env bash
# GPU checks of issue 12, in one run on one CUDA GPU (<= 8 minutes). Prints its figures; paste
# them into results/LOG.md with the date and the GPU's name. Run from the repository root with
# the project installed (pip install -e '.[dev]' over your CUDA build of torch).
#   1. tests marked gpu: the tiny model trains 2 rounds on CUDA in bf16 under NCCL (torchrun,
#      1 rank) and makes the CPU run's clip decisions;
#   2. a whisper-eurollm-9b-sized model (random init on the meta device, materialised on the
#      GPU) does one client step with activation checkpointing: peak memory vs `cluster-fl plan`;
#   3. client updates per second of the tiny model on the GPU (bf16 base).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
status=0
echo "== $(date -u +%FT%TZ) $($PY -c 'import torch; print(torch.cuda.get_device_name(0), "torch", torch.__version__)')"

echo "== 1. gpu tests"
timeout 300 $PY -m pytest -q -m gpu tests/gpu -p no:cacheprovider || status=1

echo "== 2. one client step of whisper-eurollm-9b (bf16 base, LoRA r16, checkpointing) vs plan"
BIG=$(timeout 200 $PY bench/gpu_step.py big --arch whisper-eurollm-9b --batch 4 --seconds 15 | tail -1) || status=1
echo "measured: $BIG"
PLAN=$(timeout 60 $PY -m cluster_fl plan configs/arch/whisper-eurollm-9b.yaml --gpus 1 --gpu-memory 141 \
  --seconds 15 --batch-size 4 --json model.dtype=bfloat16 model.activation_checkpointing=true model.lora_rank=16 2>&1 | tail -1) || status=1
echo "plan: $PLAN"
$PY - "$BIG" "$PLAN" <<'PYEOF' || status=1
import json, sys
big, plan = json.loads(sys.argv[1]), json.loads(sys.argv[2])
rows = plan.get("options") or plan.get("rows") or []
g1 = next((r for r in rows if r.get("group_size", r.get("G")) == 1), rows[0] if rows else {})
planned = g1.get("total_gib")
print(f"peak {big['peak_gib']:.2f} GiB measured, {planned} GiB planned (G=1): "
      f"ratio measured/plan {big['peak_gib'] / planned:.2f} (goal within 0.8-1.2)")
PYEOF

echo "== 3. tiny model, client updates/s on the GPU"
timeout 200 $PY bench/gpu_step.py speed --clients 24 --rounds 2 | tail -1 || status=1
exit $status
