#!/usr/bin/env bash
# GPU checks, in one run on one CUDA GPU (<= 10 minutes). Prints its figures;
# paste them into results/LOG.md with the date and the GPU's name. Run from the repository root
# with the project installed (pip install -e '.[dev]' over your CUDA build of torch).
#   1. tests marked gpu: the tiny model trains 2 rounds on CUDA in bf16 under NCCL (torchrun,
#      1 rank) and makes the CPU run's clip decisions; a block of batched clients equals one
#      client at a time (fp32); two gloo ranks sharing the one GPU make a 1-process run's clip
#      decisions and evaluation rows; a round synchronises the host once per block's training
#      and once per block's tail, never inside a local step (tests/gpu/);
#   2. a whisper-eurollm-9b-sized model (random init on the meta device, materialised on the
#      GPU, bf16 base, LoRA r16) does client steps of 4 utterances x 15 s and more: step time,
#      peak memory, and MFU = model FLOPs (counted from the shapes on the meta device) / step
#      time / 989 TFLOP/s, with activation checkpointing at 4/8/16 utterances and without it at
#      4; the batch-4 checkpointed peak is held against `cluster-fl plan`;
#   3. the study's client workload (tiny model, batch 8, 4 local steps, 64 clients a round):
#      client updates per second for K = 1 eager, K = 64 eager and K = 64 compiled clients per
#      batched step, with peak memory and the host synchronisations per step of one round;
#   4. the study's heavy-regime cell (per-layer flat DP, 24 clients a round): updates/s, the
#      GPU-busy share of a round, and the whole study's GPU wall time at that rate;
#   5. the peer benchmark on the GPU: cluster_fl against pfl-research on the same work.
# STAGES picks stages (default all: 12345): stay under a 10-minute command by running two,
#   STAGES=123 bash bench/gpu_check.sh; STAGES=45 bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
STAGES=${STAGES:-12345}
status=0
stage() { [[ $STAGES == *$1* ]]; }
echo "== $(date -u +%FT%TZ) $($PY -c 'import torch; print(torch.cuda.get_device_name(0), "torch", torch.__version__)')"

if stage 1; then
echo "== 1. gpu tests"
timeout 280 $PY -m pytest -q -s -m gpu tests/gpu -p no:cacheprovider || status=1
fi

if stage 2; then
echo "== 2. client steps of whisper-eurollm-9b (bf16 base, LoRA r16): time, memory, MFU"
BIG=$(timeout 170 $PY bench/gpu_step.py big --arch whisper-eurollm-9b --batches 4,8,16 \
  --checkpointing on --seconds 15 | tee /dev/stderr | tail -1) || status=1
echo "measured: $BIG"
timeout 60 $PY bench/gpu_step.py big --arch whisper-eurollm-9b --batches 4 --checkpointing off \
  --seconds 15 | tail -1 || status=1
# the same workload: 4 utterances x 15 s, ~180 text tokens (the step's transcript), LoRA r16
PLAN=$(timeout 50 $PY -m cluster_fl plan configs/arch/whisper-eurollm-9b.yaml --gpus 1 --gpu-memory 141 \
  --seconds 15 --text-tokens 180 --json model.dtype=bfloat16 model.activation_checkpointing=true \
  model.lora_rank=16 fl.batch_size=4 2>/dev/null) || status=1
$PY - "$BIG" "$PLAN" <<'PYEOF' || status=1
import json, sys
big, plan = json.loads(sys.argv[1]), json.loads(sys.argv[2])
step = big["steps"]["batch=4 checkpointing=on"]
row = next(r for r in plan["rows"] if r["group_size"] == 1)["checkpointed"]
gib = 2 ** 30
tensors = (row["total_bytes"] - row["overhead_bytes"]) / gib
print(f"plan G=1: total {row['total_bytes'] / gib:.2f} GiB = tensors {tensors:.2f} + stated "
      f"overhead {row['overhead_bytes'] / gib:.2f} (CUDA context, NCCL, workspaces, slack)")
print(f"measured: allocated peak {step['peak_gib']:.2f} GiB, reserved peak {step['reserved_gib']:.2f} GiB")
print(f"ratio allocated / planned tensors: {step['peak_gib'] / tensors:.2f} (goal 0.8-1.2); "
      f"reserved / planned total: {step['reserved_gib'] / (row['total_bytes'] / gib):.2f}")
for key, s in big["steps"].items():
    if isinstance(s, dict):
        print(f"{key}: {s['step_s']:.3f} s, model {s['model_tflop']:.1f} TFLOP, MFU {s['mfu']:.1%}"
              f" (hardware {s['hardware_tflop']:.1f} TFLOP, {s['hfu']:.1%}), peak {s['peak_gib']:.1f} GiB,"
              f" {s['syncs_per_step']} host syncs a step")
PYEOF
fi

if stage 3; then
echo "== 3. the study's client workload: client updates/s, K = 1 eager / 64 eager / 64 compiled"
timeout 200 $PY bench/gpu_step.py speed --clients 64 --rounds 2 --variants 1,64,64c | tail -1 || status=1
fi

if stage 4; then
# the study's updates (results/repro/PROTOCOL.md): main 2 x 9 x 5 runs, LR sweep 54, EuroLLM 15,
# each 40 rounds x 24 clients; the eps <= 10 grid 9 runs x 30 rounds x 240 clients
STUDY_UPDATES=$(( (90 + 54 + 15) * 40 * 24 + 9 * 30 * 240 ))
echo "== 4. the study's heavy cell (24 clients a round, K = 24 compiled): updates/s, GPU-busy share,"
echo "     syncs, and the wall time of its $STUDY_UPDATES client updates at that rate, one run at a time"
timeout 120 $PY bench/gpu_step.py speed --clients 24 --rounds 3 --variants 24c --study \
  --estimate-updates $STUDY_UPDATES | tail -1 || status=1
fi

if stage 5; then
echo "== 5. peers on the GPU: cluster_fl K = 1 / 24 against pfl-research, DP"
# Flower's simulation needs Ray, whose wheel does not fit what this machine can be sent; on a
# cluster node: add flower to --frameworks
timeout 150 $PY -m bench.peers.run --device cuda --frameworks cluster_fl,pfl --privacy dp \
  --ks 1,24 --ranks 1 --rounds 2 --reps 1 --batch-size 8 --work /tmp/cluster_fl_peers_gpu \
  | head -12 || status=1
fi

exit $status
