"""Channel recordings for the privacy audit (``audit.record_channels: true``).

Writes, per round, what each observer could see: every client's clipped upload (a curious
server without the secure sum), each rank's masked partial sum (a peer), and the noised release
(anyone). Recording stores private data on disk in the clear: it is for audits of simulations.
Format: see the audit package; files under ``<run>/channels/``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Mapping

import torch

from cluster_fl.engine.rundir import atomic_write_bytes


def _save(path: Path, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


class ChannelRecorder:
    """Accumulates one round's uploads on this rank and writes them at the round's end."""

    def __init__(self, folder: Path, rank: int):
        self.dir = Path(folder) / "channels"
        self.rank = rank
        self._uploads: dict[int, dict[str, Any]] = {}

    def upload(self, round_: int, client: Any, res: Any, upd: Any) -> None:
        u = self._uploads.setdefault(round_, {"client_ids": [], "speakers": [], "languages": [],
                                              "clipped": {}, "raw_norms": {}, "n_samples": []})
        u["client_ids"].append(client.client_id)
        u["speakers"].append(client.speaker)
        u["languages"].append(client.language)
        u["n_samples"].append(int(upd.n_samples))
        for name, t in res.update.items():
            u["clipped"].setdefault(name, []).append(t.detach().to(torch.float32).clone())
            u["raw_norms"].setdefault(name, []).append(float(res.group_norms.get(name, 0.0)))

    def partial(self, round_: int, rank: int, summer: Any) -> None:
        u = self._uploads.pop(round_, None)
        if u is not None:
            u["clipped"] = {k: torch.stack(v) for k, v in u["clipped"].items()}
            u["raw_norms"] = {k: torch.tensor(v) for k, v in u["raw_norms"].items()}
            u["n_samples"] = torch.tensor(u["n_samples"])
            _save(self.dir / f"uploads_r{round_:04d}_rank{rank}.pt", u)
        view = getattr(summer, "last_partial", None)  # set by reduce(record=True)
        if view is not None:
            _save(self.dir / f"partial_r{round_:04d}_rank{rank}.pt", view)

    def release(self, round_: int, mean: Mapping[str, torch.Tensor], denominator: float,
                noise_std: float) -> None:
        if self.rank == 0:
            _save(self.dir / f"release_r{round_:04d}.pt",
                  {"noised_mean": {k: v.to(torch.float32) for k, v in mean.items()},
                   "denominator": float(denominator), "noise_std": float(noise_std)})
