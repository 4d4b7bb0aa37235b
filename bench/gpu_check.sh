#!/usr/bin/env bash
# GPU checks of issue 12, in one run on one CUDA GPU (<= 8 minutes). Prints its figures; paste
# them into results/LOG.md with the date and the GPU's name. Run from the repository root with
# the project installed (pip install -e '.[dev]' over your CUDA build of torch).
#   1. tests marked gpu: the tiny model trains 2 rounds on CUDA in bf16 under NCCL (torchrun,
#      1 rank) and makes the CPU run's clip decisions; two gloo ranks sharing the one GPU make a
#      1-process run's clip decisions and evaluation rows (issue 25; tests/gpu/);
#   2. a whisper-eurollm-9b-sized model (random init on the meta device, materialised on the
#      GPU) does one client step with activation checkpointing: peak memory vs `cluster-fl plan`;
#   3. client updates per second of the tiny model on the GPU (bf16 base), K = 1, 16, 64
#      clients per batched step (issue 13), with peak memory.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
status=0
echo "== $(date -u +%FT%TZ) $($PY -c 'import torch; print(torch.cuda.get_device_name(0), "torch", torch.__version__)')"

echo "== 1. gpu tests"
timeout 420 $PY -m pytest -q -m gpu tests/gpu -p no:cacheprovider || status=1

echo "== 2. one client step of whisper-eurollm-9b (bf16 base, LoRA r16, checkpointing) vs plan"
BIG=$(timeout 200 $PY bench/gpu_step.py big --arch whisper-eurollm-9b --batch 4 --seconds 15 | tail -1) || status=1
echo "measured: $BIG"
# the same workload: 4 utterances x 15 s, ~180 text tokens (the step's transcript), LoRA r16
PLAN=$(timeout 120 $PY -m cluster_fl plan configs/arch/whisper-eurollm-9b.yaml --gpus 1 --gpu-memory 141 \
  --seconds 15 --text-tokens 180 --json model.dtype=bfloat16 model.activation_checkpointing=true \
  model.lora_rank=16 fl.batch_size=4 2>/dev/null) || status=1
$PY - "$BIG" "$PLAN" <<'PYEOF' || status=1
import json, sys
big, plan = json.loads(sys.argv[1]), json.loads(sys.argv[2])
row = next(r for r in plan["rows"] if r["group_size"] == 1)["checkpointed"]
gib = 2 ** 30
tensors = (row["total_bytes"] - row["overhead_bytes"]) / gib
print(f"plan G=1: total {row['total_bytes'] / gib:.2f} GiB = tensors {tensors:.2f} + stated "
      f"overhead {row['overhead_bytes'] / gib:.2f} (CUDA context, NCCL, workspaces, slack)")
print(f"measured: allocated peak {big['peak_gib']:.2f} GiB, reserved peak {big['reserved_gib']:.2f} GiB")
print(f"ratio allocated / planned tensors: {big['peak_gib'] / tensors:.2f} (goal 0.8-1.2); "
      f"reserved / planned total: {big['reserved_gib'] / (row['total_bytes'] / gib):.2f}")
PYEOF

echo "== 3. tiny model, client updates/s on the GPU, K = 1 / 16 / 64 clients per step"
timeout 240 $PY bench/gpu_step.py speed --clients 64 --rounds 2 --ks 1,16,64 | tail -1 || status=1
exit $status
