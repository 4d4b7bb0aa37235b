"""The run's batches as ``engine.setup.make_batches`` made them before client features were packed
(commit a8c9796): each batch padded on the host by ``pad_examples``. The packed path
(cluster_fl/data/packed.py) must give these bit for bit (tests/data/test_packed.py,
tests/engine/test_feeder.py)."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch


def old_batches(items: Sequence[Any], batch_size: int, g: torch.Generator) -> Iterator[dict]:
    from cluster_fl.data.features import pad_examples
    from cluster_fl.engine.setup import LENGTH_BIN

    order = torch.randperm(len(items), generator=g).tolist()
    order.sort(key=lambda i: items[i].features.shape[-1] // LENGTH_BIN)
    chunks = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    for c in torch.randperm(len(chunks), generator=g).tolist():
        b = pad_examples([items[i] for i in chunks[c]])
        yield {"features": b["features"], "lengths": b["lengths"],
               "texts": b["transcripts"], "languages": b["languages"]}
