"""Counting host synchronisations without a GPU: every Tensor -> Python conversion, counted.

On a GPU each of these blocks the host until the device has computed the value: ``tolist``,
``item``, ``float()``, ``int()``, ``bool()`` (an ``if`` on a tensor), ``__index__``, the ops whose
output size depends on the values (``nonzero``, ``masked_select``, ``argwhere``, ``unique``,
one-argument ``where``, indexing with a boolean mask) and the comparisons that return a Python
bool (``torch.equal``, ``allclose``). On a CPU nothing waits, but the calls are the same, so
counting them here catches a sync that a change adds, in the default (CPU) test suite.

Host -> device copies are no-ops on a CPU; the one form that says where it goes is counted:
``torch.tensor(data, device=...)`` (and ``as_tensor`` of Python data) copies from pageable
memory, which makes the host wait for the device's stream. What it cannot see: a device -> host
copy (``.cpu()``, ``.to("cpu")``) and a blocking ``.to(device)`` of a host tensor
(tests/gpu/test_sync_free.py counts those under ``torch.cuda.set_sync_debug_mode``).

What it does not count: ``Tensor.numpy()``, through which the package reads the tensors it made
on the host itself (``models.speech_llm.host_list``: a batch's lengths, a step's token counts;
the host generator's permutations). On a CPU it cannot tell those from the device's tensors, so
a device value read through ``host_list`` would pass here unseen; on a GPU ``host_list`` reads a
device tensor with ``tolist``, which the GPU test counts.

Usage: ``reads = HostReads(monkeypatch)`` (counts until the test ends), or ``with HostReads()
as reads:`` anywhere; ``reads.n`` the count, ``reads.sites`` where each came from.
"""

from __future__ import annotations

import sys
import traceback
from collections import Counter
from typing import Any, Callable

import torch

# Tensor methods that hand a value to Python
CONVERSIONS = ("tolist", "item", "__float__", "__bool__", "__int__", "__index__")
# Tensor methods and torch functions whose result's size or type depends on the values
DATA_DEPENDENT = ("nonzero", "masked_select", "argwhere", "unique", "equal", "allclose")
_MISSING = object()


def _is_mask(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _caller() -> str:
    """The first frame outside torch and this file: where the read was asked for."""
    for frame in reversed(traceback.extract_stack(limit=80)[:-2]):
        f = frame.filename
        if "/torch/" not in f and not f.endswith("host_syncs.py"):
            return f"{f.rsplit('/', 2)[-2]}/{f.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"
    return "?"


class HostReads:
    """Counts host synchronisations (module docstring) while active."""

    def __init__(self, monkeypatch: Any = None):
        self.sites: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self._saved: list[tuple[Any, str, Any]] = []
        self._paused = 0
        if monkeypatch is not None:
            self._patch(lambda owner, name, fn: monkeypatch.setattr(owner, name, fn))

    @property
    def n(self) -> int:
        return sum(self.kinds.values())

    def reset(self) -> None:
        self.sites.clear()
        self.kinds.clear()

    def _count(self, kind: str) -> None:
        if self._paused:
            return
        self.kinds[kind] += 1
        self.sites[f"{kind} at {_caller()}"] += 1

    def _wrap(self, kind: str, orig: Callable, test: Callable[..., bool] | None = None
              ) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if test is None or test(*args, **kwargs):
                self._count(kind)
            self._paused += 1  # a conversion made inside another is not a second one
            try:
                return orig(*args, **kwargs)
            finally:
                self._paused -= 1
        return wrapped

    def _patch(self, setattr_: Callable[[Any, str, Any], None]) -> None:
        for name in CONVERSIONS + DATA_DEPENDENT:
            setattr_(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        for name in DATA_DEPENDENT:
            if hasattr(torch, name):
                setattr_(torch, name, self._wrap(name, getattr(torch, name)))
        setattr_(torch, "where", self._wrap("where(cond)", torch.where,
                                            lambda *a, **k: len(a) + len(k) == 1))
        setattr_(torch.Tensor, "__getitem__", self._wrap(
            "mask index", torch.Tensor.__getitem__, lambda t, index: _is_mask(index)))
        for name in ("tensor", "as_tensor"):
            setattr_(torch, name, self._wrap(
                f"{name}(device=)", getattr(torch, name),
                lambda data, *a, **k: (k.get("device") is not None
                                       and not isinstance(data, torch.Tensor))))

    def __enter__(self) -> "HostReads":
        def set_and_keep(owner: Any, name: str, fn: Any) -> None:
            self._saved.append((owner, name, vars(owner).get(name, _MISSING)))
            setattr(owner, name, fn)
        self._patch(set_and_keep)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, orig in reversed(self._saved):
            if orig is _MISSING:  # inherited (TensorBase): drop the override
                delattr(owner, name)
            else:
                setattr(owner, name, orig)
        self._saved.clear()

    def report(self) -> str:
        """One line per call site, most frequent first (for an assertion's message)."""
        return "\n".join(f"{n:4d} x {site}" for site, n in self.sites.most_common())


if __name__ == "__main__":  # pragma: no cover - a quick look: python tests/host_syncs.py
    with HostReads() as r:
        x = torch.arange(4.0)
        float(x.sum()), x[x > 1], x.tolist()
    print(r.n, r.report(), file=sys.stderr)
