"""A run's performance summary, printed when it ends (as torchtitan prints its throughput).

Client updates per second; the share of the rounds' wall time spent in the clients' local steps
(training, clipping, adding to the sum), the noise step, the secure sum and evaluation; and the
achieved FLOP/s of the local steps beside the device's peak where it is known.

FLOPs are estimated, not measured: 6·N per position (forward 2·N, backward 4·N -- torchtitan's
rule; a frozen base skips its weight gradients, so this overstates a LoRA step by up to a third)
with N the encoder's parameters for each encoder frame and the decoder's for each decoder
position (audio tokens, prompt and transcript). Padded rows count: the device did that work.

Every figure here is an exact timing of the clients' work: it goes to the screen and the
operator log, never to the run folder (DESIGN §13). What the run folder releases only noised is
not shown exactly on the screen either: in a private run the number of client updates is the
public expected count (the rounds' denominators, q·N), not the realised cohorts, whose sizes
the folder releases noised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:  # torch is imported when a run measures, not when `train` starts (its stop
    import torch  # handlers come first: tests/reliability/test_signals.py)

# dense bf16 peak of a device, FLOP/s (vendor data sheets); None: unknown (CPUs, other GPUs)
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
              "V100": 125e12}


def device_peak(device: "torch.device | str") -> tuple[str, float | None]:
    """(the device's name, its dense bf16 peak FLOP/s or None when not known)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return device.type, None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_FLOPS.items():
        if key in name:
            return name, peak
    return name, None


def _params(module: Any) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


@dataclass
class FlopCounter:
    """Estimated FLOPs of the training passes of a speech-LLM (module docstring), from the
    lengths the host knows before each pass: nothing is read from the device."""

    encoder_params: int
    decoder_params: int
    model: Any
    flops: float = 0.0

    @classmethod
    def of(cls, model: Any) -> "FlopCounter | None":
        """A counter for ``model``, or None when its parts cannot be told apart."""
        enc, dec = getattr(model, "encoder", None), getattr(model, "decoder", None)
        if enc is None or dec is None or not hasattr(model, "audio_token_counts"):
            return None
        return cls(_params(enc), _params(dec) + _params(getattr(model, "connector", None)), model)

    def count(self, lengths: Sequence[int], texts: Sequence[str]) -> None:
        """One training pass over rows of ``lengths`` mel frames and transcripts ``texts``."""
        audio = self.model.audio_token_counts(lengths)
        stack = getattr(getattr(self.model, "connector", None), "stack", 1)
        targets = self.model.target_counts(texts)
        enc_positions = sum(a * stack for a in audio)
        dec_positions = sum(audio) + sum(targets)
        self.flops += 6.0 * (self.encoder_params * enc_positions + self.decoder_params * dec_positions)


@dataclass
class Performance:
    """Timings of this attempt's rounds (operator facts) and evaluations, summed."""

    device: str = "cpu"
    peak: float | None = None
    counter: FlopCounter | None = None
    rounds: int = 0
    updates: float = 0.0
    wall_s: float = 0.0
    phases: dict[str, float] = field(default_factory=lambda: {"client steps": 0.0, "noise": 0.0,
                                                               "secure sum": 0.0})
    evaluation_s: float = 0.0
    private: bool = False  # count the public expected cohort, not the realised one

    @classmethod
    def of(cls, world: Any) -> "Performance":
        """A summary for ``world``'s device and model; its runner counts FLOPs from now on."""
        device = getattr(getattr(world, "placement", None), "device", "cpu")
        name, peak = device_peak(device)
        counter = FlopCounter.of(getattr(world, "model", None))
        runner = getattr(getattr(world, "engine", None), "runner", None)
        if runner is not None:
            runner.flop_counter = counter
        cfg = getattr(world, "cfg", None)
        private = getattr(getattr(cfg, "privacy", None), "mechanism", "none") != "none"
        return cls(device=name, peak=peak, counter=counter, private=private)

    def add_round(self, facts: Mapping[str, Any], row: Mapping[str, Any] | None = None) -> None:
        """One round's operator facts (``wall_s``, ``trained``, ``t_clients``, ``t_noise``,
        ``t_sum``) and its released row (the public ``denominator`` a private run counts)."""
        self.rounds += 1
        if self.private:
            self.updates += float((row or {}).get("denominator") or 0.0)
        else:
            self.updates += int(facts.get("trained", 0))
        self.wall_s += float(facts.get("wall_s", 0.0))
        for key, name in (("t_clients", "client steps"), ("t_noise", "noise"), ("t_sum", "secure sum")):
            self.phases[name] += float(facts.get(key, 0.0))

    def summary(self) -> list[str]:
        """The lines printed when the run ends (empty when no round ran in this attempt)."""
        if not self.rounds:
            return []
        total = self.wall_s + self.evaluation_s
        rate = self.updates / self.wall_s if self.wall_s > 0 else float("nan")
        shares = dict(self.phases, evaluation=self.evaluation_s)
        shares["other"] = max(0.0, total - sum(shares.values()))
        share_text = ", ".join(f"{name} {100 * t / total:.0f}%" for name, t in shares.items()
                               if total > 0)
        what = ("expected client updates (the public cohort size q·N)" if self.private
                else "client updates on this rank's lane")
        lines = [f"performance: {self.rounds} rounds, {self.updates:.0f} {what} in "
                 f"{self.wall_s:.1f} s: {rate:.3g} updates/s",
                 f"performance: time in {share_text}"]
        steps_s = self.phases["client steps"]
        if self.counter is not None and self.counter.flops and steps_s > 0:
            achieved = self.counter.flops / steps_s
            peak = (f" of the {self.device}'s {self.peak / 1e12:.0f} TFLOP/s bf16 peak "
                    f"({100 * achieved / self.peak:.1f}%)" if self.peak else
                    f" on {self.device} (peak not known)")
            lines.append(f"performance: ~{achieved / 1e12:.3g} TFLOP/s in client steps (estimated, "
                         f"6 x params x positions){peak}")
        return lines
