"""``cluster-fl pretrain CONFIG``: central training of a tiny speech-LLM on the PUBLIC speakers.

This is the stand-in for pretrained Whisper / TinyLlama weights: all weights train (no LoRA),
with an auxiliary CTC loss on the encoder (weight ``pretrain.ctc_weight``), AdamW, linear
warm-up then cosine decay over the budget. The first ``pretrain.ctc_warmstart`` of the budget
trains only the encoder on CTC: from random init the encoder is the slow part, and an
encoder-only step costs ~40-60% of a joint one.

**The budget is in steps** (``pretrain.steps``): the schedule, the warm-start and the data order
are functions of (``run.seed``, step), so a checkpoint rebuilt from scratch on this machine is
bitwise the same, and another machine gets the same recipe (within its float arithmetic), fast or
slow. ``pretrain.minutes`` is then only a cap per invocation: when it runs out before the step
budget, the unfinished checkpoint is saved and the command fails with a message; run it again to
resume (the resumed result equals one uninterrupted run). With ``pretrain.steps: 0`` the budget
is ``pretrain.minutes`` of wall clock, whose checkpoint depends on the machine's speed and load
(the default before the pre-registered study; a warning says so).
With ``pretrain.mode: separate`` the second phase trains only the decoder, as a character LM on
the public transcripts (no audio), and the connector keeps its random init: the stand-in for a
speech encoder and an LLM pretrained apart, which the federated stage then joins (the paper's
setting); held-out WER is then the encoder's greedy CTC WER.
A few public speakers per language are held out to report WER while training. The checkpoint
(+ tokenizer) is written atomically to ``pretrain.out``; federated runs start from it through
``model.checkpoint``. A finished checkpoint is reused unless ``--force``; an unfinished one is
resumed (weights, optimiser state and step count). Either only when its recorded recipe
(:func:`recipe`: what determines the weights) is the config's; another is refused by name.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from cluster_fl.config import Config
from cluster_fl.errors import UserError
from cluster_fl.eval.evaluate import evaluate
from cluster_fl.models.build import build_base
from cluster_fl.models.checkpoint import load_checkpoint, read_meta, save_checkpoint
from cluster_fl.models.registry import get_arch
from cluster_fl.models.speech_llm import SpeechLLM, collate
from cluster_fl.progress import format_duration, on_terminal


def _eta(step: int, steps: int, spent_s: float, start_step: int) -> str:
    """``  of 5600, ETA 4:10`` for a step budget (this call's mean step time; empty without one)."""
    if steps <= 0 or step <= start_step:
        return ""
    return (f"  of {steps}, ETA "
            f"{format_duration((steps - step) * spent_s / (step - start_step))}")


def _bar(steps: int, start_step: int) -> Any:
    """A tqdm bar over a step budget when stderr is a terminal, else None."""
    if steps <= 0 or not on_terminal():
        return None
    from tqdm import tqdm

    return tqdm(total=steps, initial=start_step, desc="pretrain", unit="step", leave=False,
                dynamic_ncols=True)


def split_heldout(examples: Sequence[Any], per_language: int, seed: int
                  ) -> tuple[list[Any], list[Any]]:
    """(train, held-out): ``per_language`` speakers of each language go to held-out (seeded)."""
    speakers: dict[str, set[str]] = {}
    for e in examples:
        speakers.setdefault(e.language, set()).add(e.speaker)
    rng = np.random.default_rng(seed)
    held: set[str] = set()
    for lang in sorted(speakers):
        names = sorted(speakers[lang])
        if len(names) <= per_language:
            raise UserError(f"pretrain: language {lang} has {len(names)} public speakers; "
                            f"cannot hold out {per_language}")
        held.update(rng.choice(names, size=per_language, replace=False).tolist())
    return ([e for e in examples if e.speaker not in held],
            [e for e in examples if e.speaker in held])


def epoch_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int
                  ) -> list[list[int]]:
    """Epoch ``epoch``'s batches: :func:`batch_order` from a generator of (seed, epoch) alone,
    so step s always trains on the same batch, whether the run was resumed or not."""
    return batch_order(lengths, batch_size, np.random.default_rng([seed, epoch]))


def batch_order(lengths: Sequence[int], batch_size: int, rng: np.random.Generator
                ) -> list[list[int]]:
    """One epoch of batches: shuffle, sort by length inside windows of 50 batches (less padding),
    then shuffle the batches."""
    perm = rng.permutation(len(lengths))
    window = 50 * batch_size
    batches = []
    for start in range(0, len(perm), window):
        chunk = sorted(perm[start:start + window].tolist(), key=lambda i: lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def _lr_factor(step: int, progress: float, warmup: int, final: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``final`` as ``progress`` goes
    0 -> 1."""
    if step < warmup:
        return (step + 1) / warmup
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def _phase_lr_factor(step: int, progress: float, warmup: int, warmstart: float,
                     joint_start: int | None, final: float = 0.1) -> float:
    """The learning-rate factor of a run whose first ``warmstart`` of the budget is CTC-only.

    CTC phase: warm-up then constant (it hands over to a second warm-up, so decaying it would
    only slow the encoder down). Joint phase: a fresh warm-up, since the decoder and connector
    take their first steps there, then cosine decay over the rest of the budget.
    """
    if warmstart <= 0.0:
        return _lr_factor(step, progress, warmup, final)
    if joint_start is None:
        return _lr_factor(step, 0.0, warmup, final)
    return _lr_factor(step - joint_start, (progress - warmstart) / (1.0 - warmstart), warmup,
                      final)


def train(model: SpeechLLM, examples: Sequence[Any], *, lr: float, batch_size: int,
          ctc_weight: float, steps: int = 0, minutes: float = 0.0, warmup_steps: int = 0,
          ctc_warmstart: float = 0.0, final_lr: float = 0.1, seed: int = 0, eval_every: int = 0,
          on_eval: Callable[[int, float, int | None], None] | None = None,
          optimizer: torch.optim.Optimizer | None = None, start_step: int = 0,
          start_elapsed: float = 0.0, joint_start: int | None = None, separate: bool = False,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train all weights of ``model`` on ``examples``; returns step, elapsed_s, losses,
    optimizer, joint_start and ``capped``.

    Budget: with ``steps`` > 0 the run trains ``steps`` steps; the LR schedule and the warm-start
    are fractions of that, and step s trains on :func:`epoch_batches` of (seed, s // batches per
    epoch), so the result depends on the seed, never on the machine's speed. ``minutes`` > 0 is
    then a cap on THIS call: when it runs out first the call returns early with ``capped`` True
    (resume with ``start_step`` to finish). With ``steps`` == 0 the budget is ``minutes`` of wall
    clock in all (``start_elapsed`` included) and the schedule follows the clock.
    The first ``ctc_warmstart`` of the budget trains only the encoder and its CTC head (the
    encoder is what the joint model learns slowest); the rest trains everything on
    cross-entropy + ``ctc_weight`` x CTC. ``joint_start`` is the step at which the joint phase
    began (None: not yet), for resuming. ``on_eval(step, elapsed, joint_start)`` runs every
    ``eval_every`` steps (its time counts in a wall-clock budget). ``separate``: the phase after
    the warm-start trains the decoder alone on the transcripts (a text LM).
    """
    if steps <= 0 and minutes <= 0:
        raise ValueError("train: give steps or minutes")
    if not 0.0 <= ctc_warmstart < 1.0:
        raise ValueError("train: ctc_warmstart must be in [0, 1)")
    if ctc_warmstart > 0.0 and model.ctc_head is None:
        raise ValueError("train: a CTC warm-start needs the model's CTC head")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer or torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    for group in opt.param_groups:
        group.setdefault("initial_lr", lr)
    lengths = [e.features.shape[-1] for e in examples]
    per_epoch = len(epoch_batches(lengths, batch_size, seed, 0))
    budget_s = minutes * 60.0
    started = time.monotonic()
    began = started - start_elapsed
    step, losses, capped = start_step, [], False
    bar = _bar(steps, start_step)  # a bar on a terminal; the step lines below go to any log
    epoch, order = -1, []
    while True:
        now = time.monotonic()
        elapsed = now - began
        if steps:
            progress = step / steps
            if progress < 1.0 and budget_s and now - started >= budget_s:
                capped = True  # the cap ran out before the step budget
                break
        else:
            progress = elapsed / budget_s
        if progress >= 1.0:
            break
        if joint_start is None and progress >= ctc_warmstart:
            joint_start = step
            if ctc_warmstart > 0.0:
                log(f"step {step:6d}  {elapsed / 60:5.1f} min  CTC warm-start done; training "
                    + ("the decoder alone on the transcripts" if separate
                       else "encoder, connector and decoder"))
        if step // per_epoch != epoch:
            epoch = step // per_epoch
            order = epoch_batches(lengths, batch_size, seed, epoch)
        idx = order[step % per_epoch]
        texts, langs = [examples[i].transcript for i in idx], [examples[i].language for i in idx]
        lm_only = separate and joint_start is not None
        batch = None if lm_only else collate([examples[i].features for i in idx], texts, langs)
        for group in opt.param_groups:
            group["lr"] = lr * _phase_lr_factor(step, progress, warmup_steps, ctc_warmstart,
                                                joint_start, final_lr)
        if joint_start is None:
            loss = model.ctc_loss(batch)
        elif lm_only:
            loss = model.text_loss(texts, langs)
        else:
            loss, _ = model.loss(batch, ctc_weight=ctc_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()  # parameters without a gradient (the decoder while CTC-only) are skipped
        losses.append(float(loss.detach()))
        step += 1
        if bar is not None:
            bar.update(1)
        if step % 50 == 0:
            phase = "ctc" if joint_start is None else "lm" if separate else "loss"
            log(f"step {step:6d}  {elapsed / 60:5.1f} min  {phase} {np.mean(losses[-50:]):.3f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}{_eta(step, steps, now - started, start_step)}")
        if eval_every and on_eval is not None and step % eval_every == 0:
            on_eval(step, time.monotonic() - began, joint_start)
            model.train()
    if bar is not None:
        bar.close()
    return {"step": step, "elapsed_s": time.monotonic() - began, "losses": losses,
            "optimizer": opt, "joint_start": joint_start, "capped": capped}


def _load_public(cfg: Config) -> list[Any]:
    from cluster_fl.data import FeatureStore  # the data package owns corpus reading and features

    store = FeatureStore.from_config(cfg.data)  # resolved at the entrance: the model's mel bins
    examples = store.split(cfg.data.public_split, languages=list(cfg.data.languages))
    if not examples:
        raise UserError(f"pretrain: no public utterances under {cfg.data.corpus}; "
                        "run `cluster-fl make-corpus` first")
    return examples


# pretrain keys that do not change the weights: where they go, how often and how much of the
# held-out set is decoded (evaluation never touches the weights or a random generator), and the
# minutes cap of a step budget (it can only stop a run, which then resumes to the same result)
_NOT_IN_RECIPE = ("out", "eval_every", "eval_utterances")


def recipe(cfg: Config) -> dict[str, Any]:
    """What determines a pretrained checkpoint's weights (recorded in its ``meta.json``): the
    architecture, the corpus (its folder name) and languages, the seed and the pretrain keys
    but those of ``_NOT_IN_RECIPE`` (and ``minutes`` under a step budget, where it is a cap)."""
    from dataclasses import asdict

    pc = {k: v for k, v in asdict(cfg.pretrain).items() if k not in _NOT_IN_RECIPE}
    if cfg.pretrain.steps:
        pc.pop("minutes")
    return {"arch": cfg.model.arch, "corpus": Path(cfg.data.corpus).expanduser().name,
            "languages": list(cfg.data.languages), "seed": cfg.run.seed, "pretrain": pc}


def _check_recipe(out: Path, cfg: Config) -> None:
    """Refuse to reuse or resume a checkpoint that another recipe wrote (or an older version,
    which recorded none), naming what differs."""
    found, wanted = read_meta(out).get("recipe"), recipe(cfg)
    if found == wanted:
        return
    if found is None:
        why = "it records no recipe (written before pretraining was budgeted in steps)"
    else:
        mine, theirs = wanted["pretrain"], found.get("pretrain", {})
        diffs = [(k, found.get(k), wanted[k]) for k in ("arch", "corpus", "languages", "seed")
                 if found.get(k) != wanted[k]]
        diffs += [(f"pretrain.{k}", theirs.get(k), mine.get(k))
                  for k in sorted(set(mine) | set(theirs)) if theirs.get(k) != mine.get(k)]
        why = "it was trained with other " + ", ".join(
            f"{k} ({there} there, {here} here)" for k, there, here in diffs)
    raise UserError(f"pretrain: {out} holds a checkpoint of another recipe: {why}; use another "
                    "pretrain.out, or --force to retrain it")


def pretrain(cfg: Config, examples: Sequence[Any] | None = None, force: bool = False,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """Pretrain ``cfg.model.arch`` on the public speakers and save to ``cfg.pretrain.out``.

    Returns ``{"out", "step", "elapsed_s", "wer", "history", "cached"}``. Raises a UserError when
    ``pretrain.minutes`` caps a step budget short (the unfinished checkpoint is saved; calling
    again resumes it).
    """
    pc = cfg.pretrain
    out = Path(pc.out).expanduser()
    if not get_arch(cfg.model.arch).tiny:
        raise UserError(f"pretrain trains tiny models; model.arch is {cfg.model.arch!r}")
    separate = pc.mode == "separate"
    if (out / "meta.json").is_file() and not force and read_meta(out).get("mode", "joint") != pc.mode:
        raise UserError(f"pretrain: {out} holds a pretrain.mode={read_meta(out).get('mode', 'joint')} "
                        f"checkpoint, this config asks for {pc.mode}; use another pretrain.out "
                        "or --force")
    if (out / "meta.json").is_file() and not force:
        _check_recipe(out, cfg)
    if (out / "meta.json").is_file() and read_meta(out).get("done") and not force:
        meta = read_meta(out)
        log(f"pretrained checkpoint found at {out} (WER {meta.get('wer')}); use --force to redo")
        return {"out": str(out), "step": meta.get("step"), "elapsed_s": meta.get("elapsed_s"),
                "wer": meta.get("wer"), "history": meta.get("history", []), "cached": True}
    torch.manual_seed(cfg.run.seed)
    examples = list(examples) if examples is not None else _load_public(cfg)
    train_set, heldout = split_heldout(examples, pc.heldout_speakers, cfg.run.seed)
    if pc.eval_utterances and len(heldout) > pc.eval_utterances:
        pick = np.random.default_rng(cfg.run.seed).choice(len(heldout), pc.eval_utterances,
                                                           replace=False)
        heldout = [heldout[i] for i in sorted(pick)]
    log(f"pretrain {cfg.model.arch}: {len(train_set)} train / {len(heldout)} held-out utterances")
    if pc.steps:
        log(f"budget: {pc.steps} steps from run.seed {cfg.run.seed} (the same checkpoint on any "
            "machine speed)" + (f"; at most {pc.minutes:g} min per call" if pc.minutes else ""))
    else:
        log(f"budget: {pc.minutes:g} min of wall clock -- the checkpoint depends on this "
            "machine's speed and load; set pretrain.steps for a reproducible one")

    start_step, start_elapsed, history, opt_state, joint_start = 0, 0.0, [], None, None
    if (out / "meta.json").is_file() and not force and (out / "train_state.pt").is_file():
        model = load_checkpoint(out)
        state = torch.load(out / "train_state.pt", weights_only=True)
        start_step, start_elapsed = state["step"], state["elapsed_s"]
        history, opt_state = state["history"], state["optimizer"]
        joint_start = state.get("joint_start", 0)
        if "torch_rng" in state:  # the generator as it was at that step (dropout, if any)
            torch.set_rng_state(state["torch_rng"])
        log(f"resuming from step {start_step} ({start_elapsed / 60:.1f} min)")
    else:
        model = build_base(cfg.model)
    for p in model.parameters():
        p.requires_grad_(True)
    model.encoder.embed_positions.weight.requires_grad_(False)  # fixed sinusoids
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=pc.lr,
                            weight_decay=0.01)
    if opt_state is not None:
        opt.load_state_dict(opt_state)

    def checkpoint(step: int, elapsed: float, done: bool, joint: int | None) -> float:
        """Evaluate (once the decoder trains) and write the checkpoint and training state."""
        if joint is None and not separate:  # CTC warm-start: decoding an untrained decoder
            wer = float("nan")                  # is wasted time
        elif history and history[-1]["step"] == step:  # evaluated at this step already
            wer = history[-1]["wer"]
        else:
            wer = cer = float("nan")
            if heldout:
                summary, _ = evaluate(model, heldout, batch_size=cfg.eval.batch_size,
                                      max_new_tokens=cfg.eval.max_new_tokens, bootstrap=0,
                                      ctc=separate, decode_cache=cfg.eval.decode_cache)
                wer, cer = summary["wer"], summary.get("cer", float("nan"))
            history.append({"step": step, "elapsed_s": round(elapsed, 1), "wer": wer})
            log(f"step {step:6d}  {elapsed / 60:5.1f} min  held-out "
                f"{'CTC (encoder) ' if separate else ''}WER {wer:.3f}  CER {cer:.3f}")
        save_checkpoint(model, model.tokenizer, out, extra={
            "done": done, "step": step, "elapsed_s": elapsed, "wer": wer, "history": history,
            "ctc_warmstart_steps": joint, "mode": pc.mode, "recipe": recipe(cfg),
            "wer_kind": "encoder CTC greedy" if separate else "speech-LLM greedy"})
        tmp = out / "train_state.pt.tmp"
        torch.save({"step": step, "elapsed_s": elapsed, "history": history,
                    "joint_start": joint, "optimizer": opt.state_dict(),
                    "torch_rng": torch.get_rng_state()}, tmp)
        os.replace(tmp, out / "train_state.pt")
        return wer

    result = train(model, train_set, lr=pc.lr, batch_size=pc.batch_size,
                   ctc_weight=pc.ctc_weight, steps=pc.steps, minutes=pc.minutes,
                   warmup_steps=pc.warmup_steps, ctc_warmstart=pc.ctc_warmstart,
                   final_lr=pc.final_lr,
                   seed=cfg.run.seed, eval_every=pc.eval_every,
                   on_eval=lambda s, e, j: checkpoint(s, e, False, j), optimizer=opt,
                   start_step=start_step, start_elapsed=start_elapsed, joint_start=joint_start,
                   separate=separate, log=log)
    if result["capped"]:
        checkpoint(result["step"], result["elapsed_s"], False, result["joint_start"])
        raise UserError(f"pretrain: the pretrain.minutes cap ({pc.minutes:g} min per call) ran out "
                        f"at step {result['step']} of the pretrain.steps budget {pc.steps}; the "
                        f"unfinished checkpoint in {out} is saved and is not a starting model. Run "
                        "the same command again to resume it (the result is that of one "
                        "uninterrupted run), or raise pretrain.minutes (0: no cap)")
    # A budget spent entirely on the CTC warm-start still gets its (poor) WER measured.
    joint = result["joint_start"] if result["joint_start"] is not None else result["step"]
    wer = checkpoint(result["step"], result["elapsed_s"], True, joint)
    return {"out": str(out), "step": result["step"], "elapsed_s": result["elapsed_s"],
            "wer": wer, "history": history, "cached": False}
