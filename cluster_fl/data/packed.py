"""A client's features packed in one tensor, and its padded batches made where that tensor lives.

:class:`PackedExamples` holds a client's log-mel features concatenated along time, ``(n_mels,
Σ T_i)`` in their stored float16, with each utterance's length and offset on the host and its
padding value (its own minimum, the silence level after Whisper's clamp) beside them. Packed
once, the features move to a device as one tensor (``to``: through pinned host memory, without
making the host wait), to be kept there for the run or streamed a block ahead
(:mod:`cluster_fl.engine.feeder`). :meth:`PackedExamples.batch` pads a batch on the features'
device with two gathers and a select, from one index made on the host -- the lengths are known
there, so nothing is read back -- and gives the values
:func:`~cluster_fl.data.features.pad_examples` gives on the host, bit for bit
(tests/data/test_packed.py): the same float16 values widened to float32, each row padded with
its own minimum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, overload

import numpy as np
import torch

from cluster_fl.data.features import Example
from cluster_fl.transfer import to_device


@dataclass(frozen=True)
class _Labels:
    """What a packed client keeps of each example beside its features."""

    transcripts: tuple[str, ...]
    utterance_ids: tuple[str, ...]
    speakers: tuple[str, ...]
    languages: tuple[str, ...]


class PackedExamples(Sequence[Example]):
    """A client's examples as one feature tensor (module docstring). A sequence of its examples
    (``packed[i]``: features a view into the packed tensor); batches come from :meth:`batch`."""

    def __init__(self, features: torch.Tensor, pad: torch.Tensor, lengths: Sequence[int],
                 labels: _Labels):
        self.features = features  # (n_mels, Σ T_i) float16 (float32 if given), side by side
        self.pad = pad  # (N,) float32: each utterance's minimum, its padding value
        self.lengths = tuple(lengths)  # T_i, on the host
        self.offsets = tuple(int(o) for o in np.cumsum((0,) + self.lengths[:-1]))
        self.labels = labels

    def __len__(self) -> int:
        return len(self.lengths)

    @overload
    def __getitem__(self, i: int) -> Example: ...

    @overload
    def __getitem__(self, i: slice) -> list[Example]: ...

    def __getitem__(self, i: int | slice) -> Example | list[Example]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # negative indices; IndexError past the end
        lab, start = self.labels, self.offsets[i]
        return Example(self.features[:, start:start + self.lengths[i]], lab.transcripts[i],
                       lab.utterance_ids[i], lab.speakers[i], lab.languages[i])

    @property
    def device(self) -> torch.device:
        return self.features.device

    @property
    def nbytes(self) -> int:
        return self.features.numel() * self.features.element_size() + self.pad.numel() * 4

    def to(self, device: torch.device | str) -> "PackedExamples":
        """The same examples with their tensors on ``device``: from the host through pinned
        memory, so the copy is asynchronous (:func:`cluster_fl.transfer.to_device`)."""
        if self.features.device == torch.device(device):
            return self
        return PackedExamples(to_device(self.features, device), to_device(self.pad, device),
                              self.lengths, self.labels)

    def batch(self, indices: Sequence[int]) -> dict[str, Any]:
        """Utterances ``indices`` as one padded batch: features float32 ``(B, n_mels, T_max)`` on
        the features' device, lengths int64 ``(B,)`` on the host, texts and languages."""
        if not indices:
            raise ValueError("a batch needs at least one utterance")
        lengths = np.array([self.lengths[i] for i in indices], dtype=np.int64)
        starts = np.array([self.offsets[i] for i in indices], dtype=np.int64)
        b, t = len(indices), int(lengths.max())
        # every position of the padded batch reads a frame of its own utterance (the last one
        # beyond its end, to be replaced by its padding value); one host buffer, one copy
        frame = np.minimum(np.arange(t)[None, :], lengths[:, None] - 1) + starts[:, None]
        host = torch.from_numpy(np.concatenate([frame.reshape(-1), np.asarray(indices, dtype=np.int64),
                                                lengths]))
        index = to_device(host, self.features.device)  # one copy, no wait
        frames, rows, lens = index[:b * t], index[b * t:b * t + b], index[b * t + b:]
        n_mels = self.features.shape[0]
        feats = (self.features.index_select(1, frames).view(n_mels, b, t).transpose(0, 1)
                 .float())
        keep = torch.arange(t, device=feats.device)[None, :] < lens[:, None]
        feats = torch.where(keep[:, None, :], feats, self.pad.index_select(0, rows)[:, None, None])
        return {"features": feats.contiguous(), "lengths": torch.from_numpy(lengths),
                "texts": [self.labels.transcripts[i] for i in indices],
                "languages": [self.labels.languages[i] for i in indices]}


def pack_examples(examples: Sequence[Example]) -> PackedExamples:
    """Pack examples (a client's, in their order) on the host."""
    if not examples:
        raise ValueError("pack_examples needs at least one example")
    # float16 as cached; anything else (a test's float32) in float32, which holds it exactly as
    # the batch will (float16 and bfloat16 widen exactly)
    dtype = (torch.float16 if all(e.features.dtype == torch.float16 for e in examples)
             else torch.float32)
    features = torch.cat([e.features.to(dtype) for e in examples], dim=1)
    pad = torch.stack([e.features.float().min() for e in examples])
    labels = _Labels(tuple(e.transcript for e in examples),
                     tuple(e.utterance_id for e in examples), tuple(e.speaker for e in examples),
                     tuple(e.language for e in examples))
    return PackedExamples(features, pad, [int(e.features.shape[-1]) for e in examples], labels)
