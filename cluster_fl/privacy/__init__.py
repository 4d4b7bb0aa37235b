"""Privacy core: clipping policies, Gaussian noise, the diagnostics release, accounting and the
run's privacy ledger. Every statistic a run releases is bounded, noised and accounted here.

Knows nothing of models or ranks: it sees trainable groups (``cluster_fl.groups.GroupSpec``) and
tensors keyed by group name. Per round the engine calls ``policy.thresholds()``, per client
``policy.clip(update)`` (and ``policy.statistic(result)`` when ``policy.adaptive``), adds noise from
a ``NoiseSource`` once to the summed update (std σ·C) and summed statistic
(std ``policy.statistic_noise_std``), then ``policy.update(noised_sum, denominator)`` and
``ledger.step(policy)``. The per-round diagnostics (clip rates, norms, loss) are a release of
their own: :mod:`~cluster_fl.privacy.diagnostics` bounds them, sets their noise and tells the
accountant its multiplier. Secure mode draws its noise and cohorts from ChaCha20 streams under
256-bit OS keys (:mod:`~cluster_fl.privacy.csprng`); research mode from seeded streams, and its
runs are recorded as simulations (``accounting.GUARANTEES``).
"""

from cluster_fl.privacy.accounting import (PrivacyLedger, RoundEvent, combined_noise_multiplier,
                                           compute_epsilon, effective_noise_multipliers,
                                           epsilon_of_events, is_adaptive, ledger_for,
                                           noise_multiplier_for_epsilon)
from cluster_fl.privacy.clipping import (POLICIES, ClipPolicy, ClipResult, PoolSpec, make_policy,
                                         register_policy)
from cluster_fl.privacy.noise import NoiseSource, ResearchNoise, SecureNoise, make_noise, noise_for

__all__ = [
    "POLICIES", "ClipPolicy", "ClipResult", "NoiseSource", "PoolSpec", "PrivacyLedger",
    "ResearchNoise", "RoundEvent", "SecureNoise", "combined_noise_multiplier", "compute_epsilon",
    "effective_noise_multipliers", "epsilon_of_events", "is_adaptive", "ledger_for",
    "make_noise", "make_policy", "noise_for", "noise_multiplier_for_epsilon", "register_policy",
]
