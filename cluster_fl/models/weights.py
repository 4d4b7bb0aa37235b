"""A local checkpoint's tensors by model parameter name, a range of rows at a time.

Sharded lanes (``model.shard_group_size`` > 1) build the real architectures as a skeleton on the
meta device and let each rank read only its shard of every frozen tensor
(:mod:`cluster_fl.distributed.parallelize`), so no rank ever holds the whole base on the host. This
module is the reading side:

* :class:`SafetensorsFile` reads a ``.safetensors`` file with plain positioned reads (the format
  is an 8-byte header length, a JSON header of dtype/shape/offsets, then raw row-major bytes):
  rows ``a:b`` of a tensor are one contiguous byte range, read into fresh memory. No ``mmap``: a
  mapped file's touched pages count in the process's resident set until it is unmapped, which
  would put the whole shard in memory twice;
* :class:`CheckpointWeights` maps a :class:`~cluster_fl.models.speech_llm.SpeechLLM` parameter
  name to the key of its checkpoint file(s): Whisper encoders saved as ``WhisperModel`` or
  ``WhisperForConditionalGeneration`` (``encoder.*`` / ``model.encoder.*``), Llama decoders as
  saved (``model.*``, ``lm_head.*``), Voxtral in the layouts of transformers 4 and 5; LoRA's
  ``base_layer`` is looked through. Weights the checkpoint does not hold (the new connector,
  LoRA) are :func:`new_weights`.

Only ``.safetensors`` checkpoints (one file or an index of shards) are read this way; a
``pytorch_model.bin`` is a pickle that must be loaded whole (``mmap`` keeps it out of anonymous
memory; the same caveat applies).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Iterator

import torch

from cluster_fl.errors import UserError

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class SafetensorsFile:
    """Random access to the tensors of one ``.safetensors`` file (header parsed once)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        header.pop("__metadata__", None)
        self.start = 8 + size
        self.header: dict[str, dict[str, Any]] = header

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.header[key]["shape"])

    def read(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of dimension 0 (the whole tensor by default)."""
        meta = self.header[key]
        dtype, shape = _DTYPES[meta["dtype"]], list(meta["shape"])
        begin, end = meta["data_offsets"]
        if shape:
            rows = shape[0]
            start, stop = max(0, start or 0), rows if stop is None else min(stop, rows)
            row_bytes = (end - begin) // max(rows, 1)
            begin, end = begin + start * row_bytes, begin + max(start, stop) * row_bytes
            shape[0] = max(0, stop - start)
        out = torch.empty(shape, dtype=dtype)
        if not out.numel():
            return out
        buffer = memoryview(out.view(-1).view(torch.uint8).numpy())  # read straight into it
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < end - begin:  # a read may return less than asked
                n = os.preadv(fd, [buffer[done:end - begin]], self.start + begin + done)
                if n <= 0:
                    raise UserError(f"{self.path}: truncated at tensor {key!r}")
                done += n
        finally:
            os.close(fd)
        return out


def _safetensors_files(folder: Path) -> dict[str, Path]:
    """key -> file for a checkpoint folder (``model.safetensors`` or an index of shards)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    single = folder / "model.safetensors"
    if single.is_file():
        return {key: single for key in SafetensorsFile(single).keys()}
    raise UserError(f"{folder}: no model.safetensors (or index) to load a shard from; sharded "
                    "lanes read safetensors checkpoints (save_pretrained writes them)")


def _rules(family: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """(model name prefix, which folder, checkpoint key prefixes to try) per family."""
    if family == "voxtral":
        return [("encoder.", "decoder", ("model.audio_tower.", "audio_tower.")),
                ("connector.projector.", "decoder",
                 ("model.multi_modal_projector.", "multi_modal_projector.")),
                ("decoder.model.", "decoder",
                 ("model.language_model.", "language_model.model.", "language_model.")),
                ("decoder.lm_head.", "decoder", ("lm_head.", "language_model.lm_head."))]
    return [("encoder.", "encoder", ("model.encoder.", "encoder.")),
            ("decoder.", "decoder", ("",))]


class SkeletonWeights:
    """Where a meta skeleton's tensors come from (``model.weights``), and how a skeleton is
    completed with them. The process boundary (:mod:`cluster_fl.distributed.parallelize`) places shards
    and calls back here through the model, so it never imports model code."""

    def read(self, name: str, start: int | None = None, stop: int | None = None
             ) -> torch.Tensor:
        raise NotImplementedError

    def materialise(self, model: torch.nn.Module, device: torch.device | str = "cpu") -> None:
        """Give every meta parameter of ``model`` its whole tensor (cast to the parameter's
        dtype) on ``device`` and rebuild the buffers. Tied parameters stay tied."""
        new: dict[int, torch.nn.Parameter] = {}
        named = {id(p): n for n, p in model.named_parameters()}
        for module in model.modules():
            for key, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in new:
                    value = self.read(named[id(p)]).to(device=device, dtype=p.dtype)
                    new[id(p)] = torch.nn.Parameter(value, requires_grad=p.requires_grad)
                module._parameters[key] = new[id(p)]
        self.rebuild_buffers(model, device)

    @staticmethod
    def rebuild_buffers(model: torch.nn.Module, device: torch.device | str = "cpu") -> None:
        """Recompute the buffers of ``model`` on ``device``: after a meta build (they are meta)
        or ``to_empty`` (they are garbage). Only the rotary tables exist in the registered
        architectures (non-persistent, computed from the config); any other buffer is an error
        rather than a silent garbage value."""
        for name, module in model.named_modules():
            if not module._buffers:
                continue
            if not ("inv_freq" in module._buffers and hasattr(module, "config")):
                raise UserError(f"{name}: cannot recompute buffers {sorted(module._buffers)} of "
                                f"{type(module).__name__} after a meta-device build")
            fresh = type(module)(module.config)
            for key, value in fresh._buffers.items():
                module._buffers[key] = value.to(device)


class CheckpointWeights(SkeletonWeights):
    """The local checkpoint(s) behind a real architecture, read by model parameter name."""

    def __init__(self, family: str, folders: dict[str, str]):
        self.family = family
        self.folders = {k: Path(v).expanduser() for k, v in folders.items()}
        self._files: dict[str, dict[str, Path]] = {}
        self._open: dict[Path, SafetensorsFile] = {}

    def _keys(self, which: str) -> dict[str, Path]:
        if which not in self._files:
            self._files[which] = _safetensors_files(self.folders[which])
        return self._files[which]

    def locate(self, name: str) -> tuple[str, Path] | None:
        """(checkpoint key, file) of model parameter ``name``; None for weights the checkpoint
        cannot hold (the new connector, LoRA, a CTC head)."""
        name = name.replace(".base_layer.", ".")
        if ".lora_" in name:
            return None
        for prefix, which, candidates in _rules(self.family):
            if name.startswith(prefix):
                keys = self._keys(which)
                rest = name[len(prefix):]
                for candidate in candidates:
                    if candidate + rest in keys:
                        return candidate + rest, keys[candidate + rest]
                raise UserError(f"{self.folders[which]}: no tensor for {name} (tried "
                                + ", ".join(c + rest for c in candidates) + ")")
        return None

    def read(self, name: str, start: int | None = None, stop: int | None = None
             ) -> torch.Tensor:
        """Rows ``start:stop`` of parameter ``name`` as stored (cast by the caller)."""
        found = self.locate(name)
        if found is None:
            raise KeyError(name)
        key, path = found
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        return self._open[path].read(key, start, stop)

    def shape(self, name: str) -> tuple[int, ...] | None:
        found = self.locate(name)
        if found is None:
            return None
        key, path = found
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        return self._open[path].shape(key)

    def check(self, model: torch.nn.Module) -> None:
        """Every frozen parameter of ``model`` has a tensor of its shape (one line otherwise),
        before anything is allocated."""
        for name, p in model.named_parameters():
            if p.requires_grad and self.locate(name) is None:
                continue
            shape = self.shape(name)
            if shape is None:
                folders = ", ".join(sorted(map(str, set(self.folders.values()))))
                raise UserError(f"{name}: not in the checkpoint ({folders})")
            if tuple(shape) != tuple(p.shape):
                raise UserError(f"{name}: the checkpoint holds shape {list(shape)}, the model "
                                f"built from its config.json {list(p.shape)}")


def meta_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The parameters still on the meta device (the skeleton's unmaterialised weights)."""
    for name, p in model.named_parameters():
        if p.is_meta:
            yield name, p


class RandomWeights(SkeletonWeights):
    """Stand-in weights for a skeleton that has no checkpoint here: each tensor drawn from a
    generator seeded by (``seed``, its name) -- N(0, 0.02) for matrices, ones for the weights of
    norms, zeros for biases -- so any rank reading any rows of it gets the same values. For
    shape-true smoke tests of presets whose checkpoints are not on this machine, and benches."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def check(self, model: torch.nn.Module) -> None:
        """Record the shapes of ``model``'s meta parameters (nothing to compare them with)."""
        for name, p in meta_parameters(model):
            self.shapes[name] = (tuple(p.shape), p.dtype)

    def locate(self, name: str) -> tuple[str, Path] | None:
        return None if ".lora_" in name else (name, Path("<random>"))

    def shape(self, name: str) -> tuple[int, ...] | None:
        name = name.replace(".base_layer.", ".")
        return self.shapes[name][0] if name in self.shapes else None

    def read(self, name: str, start: int | None = None, stop: int | None = None
             ) -> torch.Tensor:
        import zlib

        name = name.replace(".base_layer.", ".")  # LoRA's wrapper, as in the checkpoint
        shape, dtype = self.shapes[name]
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            full = torch.zeros(shape, dtype=dtype)
        elif len(shape) == 1:
            full = torch.ones(shape, dtype=dtype)
        else:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=g)
        return full[start:stop] if full.dim() else full
