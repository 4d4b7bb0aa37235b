"""The privacy audit (DESIGN §9): declared channels, calibrated attacks, gates fixed in advance.

``stats`` (bounds, gate, ε lower bound) · ``attacks`` (probes, linkability, zero support) ·
``canary`` (empirical ε vs accountant) · ``channels`` (declarations, loader) · ``battery`` (every
cell with controls) · ``sweep`` (α sweep) · ``report`` · ``synthetic`` (a run folder with
recorded channels, for tests). The command ``cluster-fl audit`` is ``cluster_fl.commands.audit``.
"""
