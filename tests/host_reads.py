"""A counter of device -> host reads, shared by the tests that bound them.

On a GPU every Tensor -> Python conversion waits for the device (a synchronisation that drains
the launch queue); on a CPU it is only a call. :class:`HostReads` counts the calls, so a CPU test
can bound how often code would synchronise on a GPU. Importable as ``host_reads`` from any test
(``tests/`` is on ``sys.path`` through ``tests/conftest.py`` in pytest's default import mode).
"""

from __future__ import annotations

import torch


class HostReads:
    """Counts Tensor -> host conversions (tolist, item, float, bool, int, index) while active:
    from construction until ``monkeypatch`` undoes its patches at the test's end."""

    NAMES = ("tolist", "item", "__float__", "__bool__", "__int__", "__index__")

    def __init__(self, monkeypatch):
        self.n = 0
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def wrapped(t, *a, _orig=orig, **k):
                self.n += 1
                return _orig(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, wrapped)
