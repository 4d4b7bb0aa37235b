"""Client data on its way to the device: kept there for the run, or streamed a block ahead.

``data.device_resident`` decides where a run's client features live while it trains:

* **resident** -- each client's features are packed (:class:`~cluster_fl.data.packed.
  PackedExamples`) and copied to the run's device the first time the client trains, then kept:
  a client's later rounds read them where they are, and every batch is padded there
  (``PackedExamples.batch``); no feature crosses from the host again;
* **streamed** -- a block's clients are packed in page-locked host memory and copied
  asynchronously, the next block's copy issued before the current block trains, so the copy
  overlaps its training (the host's packing of the next block does not: no thread is used);
* on a CPU both are the same no-op: the host is the device, a block's clients are packed when
  their turn comes and nothing is copied or pinned.

``auto`` (the default) keeps them resident on a GPU when the run's features -- estimated from
the utterances' durations before any is loaded, ``n_mels`` x frames x 2 bytes -- take at most
``RESIDENT_SHARE`` of the device's free memory once the model is on it; ``true`` insists
(refused with a clear error when they cannot fit), ``false`` streams.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import torch

from cluster_fl.data.packed import PackedExamples, pack_examples
from cluster_fl.errors import UserError

SETTINGS = ("auto", "true", "false")
# auto: features resident when they take at most this share of the free device memory (the rest
# is left to activations, the stacked optimiser state of a block and the allocator's slack)
RESIDENT_SHARE = 0.25
FRAMES_PER_SECOND = 100  # log-mel hop of 10 ms (cluster_fl.data.features.HOP at 16 kHz)
UNKNOWN_SECONDS = 30.0  # an utterance of unknown duration is counted as Whisper's whole window


def keep_resident(setting: str, device: torch.device, feature_bytes: int,
                  free_bytes: int) -> bool:
    """Whether a run's client features stay on ``device`` for the run (module docstring):
    ``free_bytes`` is the device's free memory with the model on it. False on a CPU (nothing to
    move); ``true`` that cannot fit and an unknown setting are a :class:`UserError`."""
    if setting not in SETTINGS:
        raise UserError(f"data.device_resident: got {setting!r}; allowed: {', '.join(SETTINGS)}")
    if device.type == "cpu" or setting == "false":
        return False
    if setting == "true":
        if feature_bytes > free_bytes:
            raise UserError(f"data.device_resident=true: the run's client features "
                            f"({feature_bytes / 2**30:.2f} GiB) exceed the free memory of "
                            f"{device} ({free_bytes / 2**30:.2f} GiB); use auto or false "
                            "(streamed from pinned host memory)")
        return True
    return feature_bytes <= RESIDENT_SHARE * free_bytes


def estimate_feature_bytes(clients: Sequence[Any], n_mels: int) -> int:
    """Bytes of every client's float16 features, from the utterances' durations (metadata only:
    no feature is loaded). ``clients`` are :class:`~cluster_fl.data.mls.Client` or the engine's
    ``ClientData`` over them (``utterances.client.utterances``), or over an indexed client
    (:class:`~cluster_fl.data.store.IndexedClient`, whose index gives its seconds)."""
    total = 0
    for c in clients:
        client = getattr(c.utterances, "client", c)
        if hasattr(client, "seconds"):  # an IndexedClient (data/store.py): its index's seconds
            total += math.ceil(client.seconds * FRAMES_PER_SECOND) * n_mels * 2
            continue
        utts = getattr(client, "utterances", c.utterances)
        for u in utts:
            seconds = getattr(u, "duration", None)
            seconds = UNKNOWN_SECONDS if seconds is None else float(seconds)
            total += math.ceil(seconds * FRAMES_PER_SECOND) * n_mels * 2
    return total


def free_device_bytes(device: torch.device) -> int:
    """Free memory of ``device`` now (a GPU's, as the driver reports it; 0 for a CPU)."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.mem_get_info(device)[0])


class ClientFeeder:
    """Hands the round engine each block's clients, their features packed on the run's device."""

    def __init__(self, device: torch.device | str, resident: bool):
        self.device = torch.device(device)
        self.resident = resident and self.device.type != "cpu"
        self._kept: dict[int, PackedExamples] = {}  # resident: client index -> its features

    @classmethod
    def for_run(cls, setting: str, device: torch.device, clients: Sequence[Any],
                n_mels: int) -> "ClientFeeder":
        """The feeder ``data.device_resident`` asks for on ``device`` (call it once the model is
        on the device: auto weighs the features against the memory left)."""
        if device.type == "cpu":  # checked all the same: a bad value is an error everywhere
            return cls(device, keep_resident(setting, device, 0, 0))
        return cls(device, keep_resident(setting, device, estimate_feature_bytes(clients, n_mels),
                                         free_device_bytes(device)))

    def describe(self) -> str:
        """For the run's first log line: where the features are (nothing to say on a CPU)."""
        if self.device.type == "cpu":
            return ""
        return (" (client features resident)" if self.resident else
                " (client features streamed a block ahead)")

    def load(self, client: Any) -> Sequence[object]:
        """One client's examples: packed on the run's device (or ``[]`` when it has none)."""
        kept = self._kept.get(client.index)
        if kept is not None:
            return kept
        examples = client.load()
        if not examples:
            return []
        packed = pack_examples(examples).to(self.device)  # pinned, asynchronous on a GPU
        if self.resident:
            self._kept[client.index] = packed
        return packed

    def blocks(self, clients: Sequence[Any], blocks: Sequence[Sequence[int]]
               ) -> Iterator[list[tuple[int, Sequence[object]]]]:
        """Each block's ``(client index, examples)``. On a GPU the next block's copy is issued
        before a block is handed out, so it travels while that block trains; on a CPU each block
        is packed when its turn comes (two blocks at once would only cost memory)."""
        def load(block: Sequence[int]) -> list[tuple[int, Sequence[object]]]:
            return [(i, self.load(clients[i])) for i in block]

        if self.device.type == "cpu":
            yield from (load(block) for block in blocks)
            return
        ahead = load(blocks[0]) if blocks else []
        for b in range(len(blocks)):
            current, ahead = ahead, (load(blocks[b + 1]) if b + 1 < len(blocks) else [])
            yield current
