"""The numeric precision and compilation policy: what ``model.dtype: auto`` and
``model.compile: auto`` mean on a device.

bfloat16 is the frozen base's storage and autocast dtype where the hardware does bf16 matrix work
much faster than fp32: CUDA, and CPUs with AMX-BF16 or AVX512-BF16 (one core of this project's CI
machine multiplies the tiny model's matrices at ~100-190 GFLOP/s in fp32 and ~550-1,200 in bf16;
``bench/step_profile.py`` measures it). The trainable groups stay fp32 master weights whatever
the base dtype. The decision reads CPU flags, never a timing, so every rank of a run on the same
kind of machine resolves it alike (bitwise 1-vs-N rank equality depends on it).
"""

from __future__ import annotations

import os

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """True when this CPU has AMX-BF16 tiles or AVX512-BF16 (oneDNN runs bf16 GEMMs on them)."""
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_amx_tile_supported",
                                                     "_is_avx512_bf16_supported")]
    try:
        return any(bool(check()) for check in checks if check is not None)
    except RuntimeError:  # a build without the CPU capability probes
        return False


def resolve_dtype(spec: str, device_type: str, compiled: bool = True) -> torch.dtype:
    """``model.dtype`` on a device of ``device_type`` (``cpu`` or ``cuda``). On a CPU, ``auto`` is
    bf16 only for a compiled step: eagerly, autocast's casts around every small op cost more
    than the faster matmuls save (``bench/step_profile.py compare``: 0.97x of fp32)."""
    if spec != "auto":
        return DTYPES[spec]
    if device_type == "cuda":
        # planning for a GPU from a machine without one: assume bf16 (every GPU since Ampere)
        fast = not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
        return torch.bfloat16 if fast else torch.float16
    return torch.bfloat16 if compiled and cpu_has_fast_bf16() else torch.float32


# ``model.compile: auto`` on a CPU without fast bf16 (fp32 either way): compile when a lane's
# steps over the whole run reach this many. What compiling fp32 costs and gains differs by
# core (``bench/step_profile.py compare``, the fp32 variants; results/LOG.md, 2026-12-07): a
# cold compile costs ~40 s (~4 s from inductor's on-disk cache); the step gained nothing on an
# AVX-512 EPYC, native or limited to AVX2 (0.95-1.02x); 1.1-1.3x was reported on an AVX2-only
# core (not measured here). At the tiny model's ~90 ms step, 10,000 steps make a cold compile
# at most ~5% of a run that gains nothing, and repay it at least twice where the step gains
# 1.1x; a wider model's longer steps only lower both shares.
COMPILE_PAYS_AFTER_STEPS = 10_000


def resolve_compile(spec: bool | str, device_type: str, lane_steps: int | None = None) -> bool:
    """``model.compile`` on a device of ``device_type``. ``auto``: on CUDA, and on CPUs with fast
    bf16 (the compiled step is where bf16 pays: ~2x a step in fp32 eagerly, measured by
    ``bench/step_profile.py compare``); on other CPUs when the run is long enough to repay the
    compile: ``lane_steps`` (a lane's local steps over the run, ``engine.setup.run_lane_steps``)
    of at least :data:`COMPILE_PAYS_AFTER_STEPS`. The environment variable
    ``CLUSTER_FL_COMPILE`` (``0`` or ``1``) decides ``auto`` instead -- for a test suite whose
    hundreds of short runs would otherwise each compile, or a machine where compiling is
    unwanted."""
    if spec != "auto":
        return bool(spec)
    env = os.environ.get("CLUSTER_FL_COMPILE", "").strip()
    if env in ("0", "1"):
        return env == "1"
    if device_type == "cuda" or cpu_has_fast_bf16():
        return True
    return lane_steps is not None and lane_steps >= COMPILE_PAYS_AFTER_STEPS


def run_precision(dtype: str, compile: bool | str, device_type: str,
                  lane_steps: int | None = None) -> tuple[torch.dtype, bool]:
    """(the frozen base's dtype, whether the step is compiled) of a run: ``model.dtype`` and
    ``model.compile`` on its device (a sharded lane as an unsharded rank; ``lane_steps`` as
    :func:`resolve_compile` takes it). Derived once on a run's path
    (``engine.setup.build_world``) and handed to the model build -- a skeleton is allocated in
    it -- and to :func:`~cluster_fl.distributed.parallelize.parallelize`, so the two never
    disagree."""
    compiled = resolve_compile(compile, device_type, lane_steps)
    return resolve_dtype(dtype, device_type, compiled), compiled


def dtype_name(spec: str, device_type: str, compiled: bool = True) -> str:
    """The name (``float32``, ``bfloat16``, ``float16``) ``model.dtype`` resolves to."""
    resolved = resolve_dtype(spec, device_type, compiled)
    return next(name for name, dt in DTYPES.items() if dt == resolved)
