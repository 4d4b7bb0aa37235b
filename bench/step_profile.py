"""Where a client step's time goes on one CPU core, against what the core can do.

    python bench/step_profile.py profile [key=value ...]   # one configuration, profiled
    python bench/step_profile.py profile --config RUN/config.yaml   # a run's own workload
    python bench/step_profile.py compare [--reps 3]        # today's default against the new
                                                           # defaults, side by side

The work is the study's client workload (bench/peers/common.py ``Work`` with batch 8 and 4 local
steps): the random-init tiny speech-LLM (LoRA r4 + connector), 24 clients a round of 16
utterances each, DP flat clipping with the secure sum, one torch thread per process. Speed does
not depend on the weights.

``profile`` prints, for one configuration (``key=value`` overrides of the work's config, e.g.
``model.dtype=float32 model.compile=false``):

* the core's measured matmul rate (GFLOP/s) at the model's shapes, fp32 and bf16, by this script;
* FLOPs of a client step (``torch.utils.flop_counter``: matmuls and convolutions, forward and
  backward) and the achieved GFLOP/s of the training compute;
* the time split of a round per client update: data loading (batches from the feature cache),
  host preparation of the step (``SpeechLLM.prepare``), training compute -- itself split by the
  profiler's self time into matrix work, elementwise, copies/casts, compiled (fused) kernels,
  the optimiser, and Python + dispatch (the rest) -- the per-client tail (clip, encode,
  secure-sum add) and the round's own work (reduce, noise, server step);
* the matrix work by kind, with the GFLOP/s each kind achieves: LoRA's rank-r products, the
  dense projections and MLPs, attention's batched products, the encoder's convolutions.

``compare`` runs each configuration in a fresh process (``--reps`` interleaved repetitions) and
prints client updates per second in steady state, the first round (compile included) and a
12-round run, as ratios to the first configuration: today's default before the CPU-throughput work (fp32,
eager, one client per step) against the new defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
# ``_child --tree DIR`` measures another source tree (the baseline commit): its cluster_fl and
# bench helpers are imported instead of this tree's
_TREE = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv else None
sys.path.insert(0, _TREE or str(ROOT))

from bench.peers.common import Work, cluster_config, prepare  # noqa: E402

WORK = Work(batch_size=8, local_steps=4, work_dir="/tmp/cluster_fl_step_profile")
BASELINE_COMMIT = "ef1e172"  # main before the CPU-throughput work: fp32, eager, random batches, PEFT hooks
# name -> (source tree: None = this one, a commit = a worktree of it; config overrides[;
# environment]). A variant runs with the allocator the CLI would give it (cluster_fl/malloc.py:
# jemalloc or tcmalloc when installed) unless its environment sets CLUSTER_FL_MALLOC=system; the
# baseline predates that and runs on glibc's, as it did.
SYSTEM_MALLOC = {"CLUSTER_FL_MALLOC": "system"}
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
VARIANTS = {"before (ef1e172 defaults)": (BASELINE_COMMIT, [], SYSTEM_MALLOC),
            "fp32, eager": (None, ["model.dtype=float32", "model.compile=false"]),
            "bf16, eager": (None, ["model.dtype=bfloat16", "model.compile=false"]),
            "bf16, compiled": (None, ["model.dtype=bfloat16", "model.compile=true"]),
            "bf16, compiled, K=8": (None, ["model.dtype=bfloat16", "model.compile=true",
                                           "fl.clients_per_step=8"]),
            "bf16, compiled, K=24": (None, ["model.dtype=bfloat16", "model.compile=true",
                                            "fl.clients_per_step=24"]),
            "defaults (auto)": (None, []),
            "defaults, system malloc": (None, [], SYSTEM_MALLOC),
            # the per-client tail before it was vectorised over a block (2026-12-04)
            "defaults, per-client tail (8a49e88)": ("8a49e88", []),
            "K=24, per-client tail (8a49e88)": ("8a49e88", ["fl.clients_per_step=24"]),
            "defaults, K=24": (None, ["fl.clients_per_step=24"]),
            # the round path before the cluster-day work (trackers, progress, on-demand client
            # features, key encryption, the budget): 2026-12-07
            "defaults, before 2026-12-07 (424c9e4)": ("424c9e4", []),
            # before the compiled lane, float specialisation and the row-major encoder input
            "defaults, before the compiled lane (d0c4d4e)": ("d0c4d4e", []),
            # what compiling costs and gains in fp32 per CPU kind (precision.resolve_compile):
            # this core's own kernels, and AVX2's -- ATen's dispatch, oneDNN's and inductor's
            # code limited to AVX2 on the same core, the CPU a user without fast bf16 has. A
            # cold compile: inductor's caches off, as a machine's first run
            **{f"fp32, {mode}{cold} ({kind})": (
                None, ["model.dtype=float32", f"model.compile={mode == 'compiled'}"],
                {**env, **({"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"} if cold else {})})
               for kind, env in (("native", {}), ("AVX2", AVX2))
               for mode, cold in (("eager", ""), ("compiled", ""), ("compiled", ", cold"))}}

MATRIX = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::mkldnn_convolution",
          "aten::convolution_backward", "aten::_convolution", "aten::mkldnn_linear",
          "aten::_scaled_dot_product_flash_attention_for_cpu")
COPIES = ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous",
          "aten::cat", "aten::constant_pad_nd", "aten::index_select", "aten::fill_",
          "aten::zero_", "aten::empty", "aten::empty_strided", "aten::zeros", "aten::stack",
          "aten::gather", "aten::index_add", "aten::index_add_", "aten::scatter_add_",
          "aten::embedding", "aten::embedding_dense_backward", "aten::_unsafe_view",
          "aten::view", "aten::reshape", "aten::transpose", "aten::t", "aten::permute",
          "aten::expand", "aten::as_strided", "aten::slice", "aten::select", "aten::unsqueeze",
          "aten::resolve_conj", "aten::alias")


def _config(overrides: list[str], config_file: Path | None = None):
    import cluster_fl.config as config

    # ``override`` was called ``replace`` before the config package (a --tree baseline has that)
    override = getattr(config, "override", None) or getattr(config, "replace")
    # a run's own config (a study cell's config.yaml) instead of the benchmark's work; its device
    # and threads are the benchmark's (one core)
    cfg = (config.load_config(config_file, ["run.device=cpu", "run.threads=1"]) if config_file
           else cluster_config(WORK, "dp"))
    if config_file is None:  # WORK.local_steps steps a client, in a --tree baseline too (its
        # cluster_config predates the fix that sets them: bench/peers/common.py local_epochs)
        epochs = -(-WORK.local_steps * WORK.batch_size // WORK.utterances)
        overrides = [f"fl.local_epochs={epochs}", *overrides]
    cfg = override(cfg, dict(config.parse_override(o) for o in overrides))
    try:  # a benchmark is a run's entrance: the model fixes data.n_mels (after the overrides,
        # which may change the model); a --tree baseline from before resolve_shapes resolves itself
        from cluster_fl.models.registry import resolve_shapes
    except ImportError:
        return cfg
    return resolve_shapes(cfg)


# --------------------------------------------------------------------------- core rates

def matmul_rates(d_enc: int, d_dec: int, ffn: int, rows_enc: int, rows_dec: int,
                 reps: int = 30) -> dict[str, dict[str, float]]:
    """GFLOP/s of this core's matmuls at the model's shapes, fp32 and bf16 (one thread)."""
    import torch

    shapes = [(rows_enc, d_enc, d_enc), (rows_enc, d_enc, ffn), (rows_enc, ffn, d_enc),
              (rows_dec, d_dec, d_dec), (rows_dec, d_dec, ffn), (rows_dec, ffn, d_dec),
              (3000, 128, 512), (3000, 192, 512)]
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        rates = []
        for m, k, n in shapes:
            a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
            for _ in range(3):
                a @ b
            t = time.perf_counter()
            for _ in range(reps):
                a @ b
            rates.append(2 * m * k * n * reps / (time.perf_counter() - t) / 1e9)
        out[name] = {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}
    return out


# --------------------------------------------------------------------------- one configuration

class Timers:
    """Wall time spent inside wrapped callables, by label; client updates and local steps."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}
        self.updates = 0
        self.steps = 0

    def add(self, label: str, dt: float) -> None:
        self.t[label] = self.t.get(label, 0.0) + dt

    def wrap(self, label: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(label, time.perf_counter() - t0)
        return timed

    def wrap_iter(self, label: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Iterator[Any]:
            it = fn(*args, **kwargs)
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    self.add(label, time.perf_counter() - t0)
                    return
                self.add(label, time.perf_counter() - t0)
                if hasattr(item, "steps"):  # a ClientUpdate (Poisson cohorts vary in size)
                    self.updates += 1
                    self.steps += item.steps
                yield item
        return timed


def build(overrides: list[str], config_file: Path | None = None) -> Any:
    import torch

    from cluster_fl.distributed import LocalComm
    from cluster_fl.engine import setup

    torch.set_num_threads(1)
    return setup.build_world(_config(overrides, config_file), LocalComm(), lambda m: None)


# the timers of a local step's parts (``instrument``, ``step_parts``)
STEP, FORWARD = "step: forward + backward", "step: forward"
ENCODER, DECODER = "forward: encoder (stem + layers)", "forward: decoder layers"


def instrument(world: Any) -> Timers:
    """Timers around data loading, host preparation, the per-client tail and the step."""
    timers = Timers()
    engine, runner = world.engine, world.engine.runner
    runner.make_batches = timers.wrap_iter("data", runner.make_batches)
    model = runner.model
    model.prepare = timers.wrap("prepare", model.prepare)
    engine.contribute = timers.wrap("tail", engine.contribute)
    runner.train_cohort = timers.wrap_iter("clients", runner.train_cohort)
    # a local step's parts, by wall time (no profiler: its per-op overhead inflates small ops)
    placement = world.placement
    placement.backward = timers.wrap(STEP, placement.backward)
    placement.row_losses = timers.wrap(FORWARD, placement.row_losses)
    model.encode = timers.wrap(ENCODER, model.encode)
    model._run_decoder = timers.wrap(DECODER, model._run_decoder)
    return timers


@contextmanager
def flops_counted() -> Iterator[Any]:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        yield counter


def categorise(prof: Any) -> dict[str, float]:
    """Self CPU seconds of the profiled region by category (op names, see MATRIX/COPIES)."""
    cats = {"matrix": 0.0, "copies/casts/views": 0.0, "compiled kernels": 0.0,
            "optimiser": 0.0, "elementwise/other ops": 0.0}
    for e in prof.key_averages():
        s = e.self_cpu_time_total / 1e6
        name = e.key
        if name in MATRIX:
            cats["matrix"] += s
        elif name in COPIES:
            cats["copies/casts/views"] += s
        elif "cpp_fused" in name or "CompiledFxGraph" in name or name.startswith("graph_"):
            cats["compiled kernels"] += s
        elif name.startswith(("aten::_foreach", "aten::_fused_adam", "Optimizer.", "aten::lerp",
                              "aten::addcdiv", "aten::addcmul")):
            cats["optimiser"] += s
        elif name.startswith("aten::"):
            cats["elementwise/other ops"] += s
    return cats


def _matmul_flops(name: str, shapes: list) -> tuple[int, int]:
    """(FLOPs, smallest dimension) of one matrix op from its input shapes; (0, 0) if unknown."""
    # the two matrix operands by position in the aten signature: mm(a, b), addmm(bias, a, b);
    # what follows them (beta, alpha, a compiled graph's ``out=`` buffer) is not an operand
    first = 1 if name in ("aten::addmm", "aten::baddbmm") else 0
    if len(shapes) < first + 2:
        return 0, 0
    a, b = shapes[first], shapes[first + 1]
    if not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))):
        return 0, 0
    if name in ("aten::mm", "aten::addmm") and len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1], min(a[0], a[1], b[1])
    if name in ("aten::bmm", "aten::baddbmm") and len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2], min(a[1], a[2], b[2])
    return 0, 0


def matrix_by_kind(events: Any, low_rank: int = 16) -> dict[str, dict[str, float]]:
    """The matrix ops of a profile (``(name, input shapes, self seconds)``), by kind: products
    with a dimension <= ``low_rank`` (LoRA's rank-r factors: tiny, inefficient calls), other
    2-D products (the dense projections and MLPs), batched products (attention's scores and
    values; stacked learners' weights), convolutions (the encoder's stem). Per kind: calls,
    seconds, GFLOP/s (FLOPs from the shapes; none for convolutions)."""
    out: dict[str, dict[str, float]] = {}
    for name, shapes, self_s in events:
        if name not in MATRIX:
            continue
        flops, smallest = _matmul_flops(name, shapes)
        if "convolution" in name:
            kind = "convolutions"
        elif flops and smallest <= low_rank:
            kind = f"low-rank products (a dim <= {low_rank}: LoRA)"
        elif name in ("aten::bmm", "aten::baddbmm"):
            kind = "batched products (attention)"
        else:
            kind = "dense products (projections, MLP)"
        k = out.setdefault(kind, {"calls": 0, "s": 0.0, "flops": 0.0})
        k["calls"] += 1
        k["s"] += self_s
        k["flops"] += flops
    for k in out.values():
        k["gflops"] = k["flops"] / k["s"] / 1e9 if k["s"] > 0 and k["flops"] else 0.0
    return out


def profile(overrides: list[str], rounds: int = 2, config_file: Path | None = None,
            top_ops: int = 0) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from cluster_fl.malloc import active_malloc

    world = build(overrides, config_file)
    engine, state = world.engine, world.initial_state
    spec = world.model.encoder.config
    timers = instrument(world)
    t0 = time.perf_counter()
    state = engine.run_round(1, state).state  # warm-up (compilation, allocator, caches)
    first = time.perf_counter() - t0
    timers.t.clear()
    timers.updates = timers.steps = 0
    walls = []
    for r in range(2, 2 + rounds):
        t0 = time.perf_counter()
        state = engine.run_round(r, state).state
        walls.append(time.perf_counter() - t0)
    updates, steps = max(1, timers.updates), max(1, timers.steps) / max(1, timers.updates)
    split = {k: v / updates for k, v in timers.t.items()}
    wall = sum(walls) / updates
    # training compute = the clients' time less their data loading and host preparation
    compute = split.get("clients", 0.0) - split.get("data", 0.0) - split.get("prepare", 0.0)
    # the profiled round before the FLOP count: under FlopCounterMode's dispatch mode dynamo
    # drops the compiled layers, and they stay eager after it (measured: a profiled round after
    # it shows no compiled region), so a round profiled after the count would profile eager code
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        engine.run_round(2 + rounds, state)
        prof_wall = time.perf_counter() - t0
    timers.updates = timers.steps = 0
    with flops_counted() as counter:
        engine.run_round(3 + rounds, state)
    flops_per_step = counter.get_total_flops() / max(1, timers.steps)  # that round's own steps
    cats = categorise(prof)
    kinds = matrix_by_kind((e.name, e.input_shapes, e.self_cpu_time_total / 1e6)
                           for e in prof.events())
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top_ops]
    cats_total = sum(cats.values())
    # the profiled round's client compute (profiling slows it): fractions of its wall time
    ops_share = {k: v / prof_wall for k, v in cats.items()}
    batch = world.cfg.fl.batch_size
    rates = matmul_rates(spec.d_model, world.model.decoder.config.hidden_size,
                         spec.encoder_ffn_dim, batch * 110, batch * 80)
    return {
        "config": ([f"--config {config_file}"] if config_file else []) + overrides,
        "steps_per_update": steps, "dtype": str(world.placement.dtype).replace("torch.", ""),
        "malloc": active_malloc(),
        "compiled": world.placement.compiled_layers > 0,
        "first_round_s": first, "round_s": statistics.median(walls),
        "updates_per_s": 1.0 / wall,
        "per_update_s": {"wall": wall, "data": split.get("data", 0.0),
                         "prepare": split.get("prepare", 0.0), "compute": compute,
                         "tail": split.get("tail", 0.0),
                         "round (reduce, noise, server)": wall - split.get("clients", 0.0)
                         - split.get("tail", 0.0)},
        "compute_split": {**{k: v for k, v in ops_share.items()},
                          "python + dispatch": max(0.0, 1.0 - cats_total / prof_wall)},
        "matrix_by_kind": {k: {**v, "share": v["s"] / prof_wall} for k, v in kinds.items()},
        "step_parts_s": step_parts(split, steps),
        "flops_per_step": flops_per_step, "step_s": compute / steps,
        "achieved_gflops": flops_per_step / max(compute / steps, 1e-9) / 1e9,
        "matmul_gflops": rates,
        "top_ops": [{"op": e.key, "calls": e.count, "self_s": e.self_cpu_time_total / 1e6,
                     "share": e.self_cpu_time_total / 1e6 / prof_wall} for e in top],
    }


def step_parts(split: dict[str, float], steps: float) -> dict[str, float]:
    """A local step's wall time by part (seconds a step), from the timers' per-update split."""
    per = {k: v / steps for k, v in split.items()}
    step = per.get("clients", 0.0) - per.get("data", 0.0) - per.get("prepare", 0.0)
    both, fwd, enc, dec = (per.get(k, 0.0) for k in (STEP, FORWARD, ENCODER, DECODER))
    return {ENCODER: enc, DECODER: dec,
            "forward: the rest (connector, embeddings, LM head, loss)": max(0.0, fwd - enc - dec),
            "backward": max(0.0, both - fwd),
            "optimiser and the rest of the step": max(0.0, step - both)}


def print_profile(p: dict[str, Any]) -> None:
    r = p["matmul_gflops"]
    print(f"configuration: {' '.join(p['config']) or '(defaults)'} -> base {p['dtype']}, "
          f"{'compiled' if p['compiled'] else 'eager'}, malloc {p['malloc']}")
    print(f"core matmul rate at the model's shapes (1 thread): fp32 median "
          f"{r['float32']['median']:.0f} GFLOP/s ({r['float32']['min']:.0f}-"
          f"{r['float32']['max']:.0f}), bf16 median {r['bfloat16']['median']:.0f} "
          f"({r['bfloat16']['min']:.0f}-{r['bfloat16']['max']:.0f})")
    print(f"client step: {p['flops_per_step'] / 1e9:.2f} GFLOP in {p['step_s'] * 1e3:.1f} ms = "
          f"{p['achieved_gflops']:.1f} GFLOP/s ({p['achieved_gflops'] / r['float32']['median']:.0%} "
          f"of the fp32 median, {p['achieved_gflops'] / r['bfloat16']['median']:.0%} of bf16's)")
    print(f"client updates/s {p['updates_per_s']:.2f} ({p['steps_per_update']:.1f} local steps "
          f"each); round {p['round_s']:.2f} s (first round, "
          f"compile included: {p['first_round_s']:.1f} s)")
    print("time per client update:")
    for k, v in p["per_update_s"].items():
        print(f"  {k:32s} {v * 1e3:8.1f} ms  {v / p['per_update_s']['wall']:6.1%}")
    print("a local step by wall time (timers, no profiler):")
    for k, v in p["step_parts_s"].items():
        print(f"  {k:56s} {v * 1e3:7.2f} ms  {v / p['step_s']:6.1%}")
    print("training compute, by the profiler's self time (share of a profiled round):")
    for k, v in p["compute_split"].items():
        print(f"  {k:32s} {v:6.1%}")
    print("matrix work by kind (share of the profiled round, calls, GFLOP/s):")
    for k, v in sorted(p["matrix_by_kind"].items(), key=lambda kv: -kv[1]["s"]):
        rate = f"{v['gflops']:8.1f}" if v["gflops"] else f"{'-':>8s}"
        print(f"  {k:44s} {v['share']:6.1%} {v['calls']:8d} {rate}")
    if p["top_ops"]:
        print("ops by self time (share of the profiled round, calls):")
        for o in p["top_ops"]:
            print(f"  {o['op'][:60]:60s} {o['share']:6.1%} {o['calls']:8d}")


# --------------------------------------------------------------------------- side by side

def _child(overrides: list[str], rounds: int) -> dict[str, Any]:
    world = build(overrides)
    engine, state = world.engine, world.initial_state
    times = []
    for r in range(1, rounds + 2):
        t0 = time.perf_counter()
        state = engine.run_round(r, state).state
        times.append(time.perf_counter() - t0)
    try:
        from cluster_fl.malloc import active_malloc
        malloc = active_malloc()
    except ImportError:  # a tree before cluster_fl/malloc.py: its processes ran on glibc's
        malloc = "system"
    return {"first": times[0], "steady": statistics.median(times[1:]),
            "dtype": str(world.placement.dtype), "malloc": malloc,
            "compiled": getattr(world.placement, "compiled_layers", 0) > 0}


def source_tree(commit: str) -> Path:
    """A worktree of ``commit`` (made once, under /tmp), for measuring that code."""
    tree = Path(f"/tmp/cluster_fl-{commit}")
    if not (tree / "cluster_fl").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit],
                       check=True, capture_output=True)
    return tree


def variant_env(spec: tuple) -> dict[str, str]:
    """The environment a variant's process runs in: ours less any preload, its own settings,
    then the allocator the CLI would preload for them."""
    from cluster_fl.malloc import preload_malloc

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CLUSTER_FL_MALLOC")}
    env.update(spec[2] if len(spec) > 2 else {})
    preload_malloc(env)
    return env


def compare(reps: int, rounds: int, variants: dict[str, tuple]) -> dict[str, Any]:
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for rep in range(reps):  # interleaved: machine noise hits every variant alike
        for name, spec in variants.items():
            commit, over = spec[0], spec[1]
            tree = ["--tree", str(source_tree(commit))] if commit else []
            cmd = [sys.executable, __file__, "_child", "--rounds", str(rounds), *tree, *over]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                 env=variant_env(spec)).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
            print(f"rep {rep + 1}/{reps} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    table = {}
    for name, runs in results.items():
        steady = statistics.median(r["steady"] for r in runs)
        first = statistics.median(r["first"] for r in runs)
        table[name] = {"updates_per_s": WORK.clients / steady, "round_s": steady,
                       "first_round_s": first, "run12_s": first + 11 * steady,
                       "dtype": runs[0]["dtype"], "compiled": runs[0]["compiled"],
                       "malloc": runs[0]["malloc"]}
    base = next(iter(table.values()))
    print(f"{'configuration':28s} {'updates/s':>10s} {'x':>6s} {'first round s':>14s} "
          f"{'12-round run s':>15s} {'x':>6s}  malloc")
    for name, t in table.items():
        print(f"{name:28s} {t['updates_per_s']:10.2f} {t['updates_per_s'] / base['updates_per_s']:6.2f} "
              f"{t['first_round_s']:14.1f} {t['run12_s']:15.1f} {base['run12_s'] / t['run12_s']:6.2f}"
              f"  {t['malloc']}")
    print_break_even(table)
    return table


def print_break_even(table: dict[str, dict[str, Any]]) -> None:
    """For each ``fp32, eager (K)`` with a ``fp32, compiled[, cold] (K)`` beside it: the compile's
    cost (the first round's excess over a steady round, less the eager one's), the steady gain
    per local step, and the lane steps after which the compile has paid for itself."""
    steps = WORK.clients * WORK.local_steps  # a round's local steps (one rank: one lane)
    for name, eager in table.items():
        if not (name.startswith("fp32, eager (") and name.endswith(")")):
            continue
        kind = name[len("fp32, eager ("):-1]
        for label in ("compiled", "compiled, cold"):
            c = table.get(f"fp32, {label} ({kind})")
            if c is None:
                continue
            cost = (c["first_round_s"] - c["round_s"]) - (eager["first_round_s"] - eager["round_s"])
            gain = (eager["round_s"] - c["round_s"]) / steps
            after = f"{cost / gain:,.0f} steps" if gain > 0 else "never (no gain)"
            print(f"{kind}: {label}: compile {cost:.1f} s, step {eager['round_s'] / steps * 1e3:.1f}"
                  f" -> {c['round_s'] / steps * 1e3:.1f} ms ({eager['round_s'] / c['round_s']:.2f}x), "
                  f"repaid after {after}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["profile", "compare", "_child"])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--tree", help="measure this source tree (set by compare)")
    parser.add_argument("--only", help="compare: variant names separated by semicolons")
    parser.add_argument("--top", type=int, default=0,
                        help="profile: also list the N ops with the most self time")
    parser.add_argument("--config", type=Path,
                        help="profile: this run config (e.g. a study cell's config.yaml) instead "
                             "of the benchmark's work, on one core")
    args = parser.parse_intermixed_args()
    if args.mode == "profile":  # the allocator a cluster-fl process gets (cluster_fl/malloc.py)
        from cluster_fl.malloc import reexec_with_malloc

        reexec_with_malloc()
    if args.config is None:
        prepare(WORK)
    elif args.mode != "profile":
        parser.error("--config goes with profile")
    if args.mode == "_child":
        print(json.dumps(_child(args.overrides, args.rounds)))
        return
    if args.mode == "profile":
        result = profile(args.overrides, args.rounds, args.config, args.top)
        print_profile(result)
    else:
        chosen = ({k: v for k, v in VARIANTS.items() if k in args.only.split(";")}
                  if args.only else VARIANTS)
        result = compare(args.reps, args.rounds, chosen)
    print(json.dumps({"step_profile": result}, default=str))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
