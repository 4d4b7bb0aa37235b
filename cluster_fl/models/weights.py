"""A local checkpoint's tensors by model parameter name, read straight into their destination.

Real architectures are built as a skeleton on the meta device (``build_base(meta=True)``) and each
rank reads only the tensors -- or, in a sharded lane, the rows -- it holds
(:mod:`cluster_fl.distributed.parallelize` places them), straight from the safetensors files into
memory allocated once on its device in the run's dtype. This module is the reading side:

* :class:`SafetensorsFile` reads a ``.safetensors`` file through ``safetensors.safe_open(...)
  .get_slice``: rows ``a:b`` of a tensor are a view of the mapped file, copied (and cast) into
  the destination and released at once. The file is opened per read: a mapped file's touched
  pages count in the process's resident set until it is unmapped, so a read holds at most one
  chunk of the file in memory (:data:`CHUNK_BYTES`), never a whole tensor twice;
* :class:`CheckpointWeights` maps a :class:`~cluster_fl.models.speech_llm.SpeechLLM` parameter
  name to the key of its checkpoint file(s): Whisper encoders saved as ``WhisperModel`` or
  ``WhisperForConditionalGeneration`` (``encoder.*`` / ``model.encoder.*``; the Whisper decoder's
  tensors are never read), Llama decoders as saved (``model.*``, ``lm_head.*``), Voxtral in the
  layouts of transformers 4 and 5; LoRA's ``base_layer`` is looked through. Weights the
  checkpoint does not hold (the new connector, LoRA) are drawn by ``init_new_weights``.

Only ``.safetensors`` checkpoints (one file or an index of shards) are read; a
``pytorch_model.bin`` is a pickle that must be loaded whole (``save_pretrained`` converts it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from cluster_fl.errors import UserError

# rows of a tensor are copied into their destination this many bytes at a time (in the file's
# dtype): the most of the file a read keeps mapped
CHUNK_BYTES = 64 * 1024 ** 2


_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
             "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class SafetensorsFile:
    """Random access to the tensors of one ``.safetensors`` file (``safe_open``/``get_slice``);
    the header is read once, the file mapped only for the duration of a read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.itemsize: dict[str, int] = {}
        try:
            with safe_open(str(self.path), framework="pt") as f:
                for key in f.keys():
                    view = f.get_slice(key)
                    self.shapes[key] = tuple(view.get_shape())
                    self.itemsize[key] = _ITEMSIZE.get(view.get_dtype(), 4)
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise UserError(f"{self.path}: unreadable safetensors file "
                            f"({type(exc).__name__}: {str(exc)[:120]})") from None

    def keys(self) -> list[str]:
        return list(self.shapes)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[key]

    def read(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of dimension 0 (the whole tensor by default), in fresh memory."""
        with safe_open(str(self.path), framework="pt") as f:
            if not self.shapes[key]:
                return f.get_tensor(key).clone()
            return f.get_slice(key)[start:stop].clone()

    def read_into(self, key: str, out: torch.Tensor, start: int = 0) -> None:
        """Rows ``start:start + len(out)`` into ``out`` (any device and dtype: ``copy_`` casts),
        :data:`CHUNK_BYTES` of the file at a time, unmapped after each."""
        if not self.shapes[key] or out.dim() == 0:
            out.copy_(self.read(key).reshape(out.shape))
            return
        rows = out.shape[0]
        step = max(1, CHUNK_BYTES // max(1, out[0].numel() * self.itemsize[key]))
        for a in range(0, rows, step):
            b = min(rows, a + step)
            with safe_open(str(self.path), framework="pt") as f:
                out[a:b].copy_(f.get_slice(key)[start + a:start + b])


def checkpoint_folder(path: str | Path) -> Path:
    """A local folder for ``path``: the folder itself, or -- for a Hugging Face repository name
    such as ``openai/whisper-large-v3`` -- its snapshot in the local HF cache (never
    downloads). The path unchanged when neither exists (the caller reports it)."""
    folder = Path(path).expanduser()
    if folder.is_dir() or folder.is_absolute() or str(path).count("/") != 1:
        return folder
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path), local_files_only=True))
    except Exception:  # not in the cache (LocalEntryNotFoundError), or not a repository name
        return folder


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

    def locate(self, name: str) -> Any:
        """Where parameter ``name`` is stored; None for weights no checkpoint holds."""
        raise NotImplementedError

    def read_into(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Rows ``start:start + len(out)`` of parameter ``name`` copied (and cast) into ``out``,
        which may live on any device."""
        stop = start + out.shape[0] if out.dim() else None
        out.copy_(self.read(name, start if out.dim() else None, stop).reshape(out.shape))

    def materialise(self, model: torch.nn.Module, device: torch.device | str = "cpu") -> None:
        """Give every meta parameter of ``model`` that the checkpoint holds its whole tensor,
        allocated once on ``device`` in the parameter's dtype and read straight into it (no host
        copy for a cast), and rebuild the buffers. Tied parameters stay tied. Weights no
        checkpoint holds (LoRA, a new connector) stay on the meta device for
        ``init_new_weights``."""
        new: dict[int, torch.nn.Parameter] = {}
        named = {id(p): n for n, p in model.named_parameters()}
        for module in model.modules():
            for key, p in list(module._parameters.items()):
                if p is None or not p.is_meta or self.locate(named[id(p)]) is None:
                    continue
                if id(p) not in new:
                    value = torch.empty(p.shape, dtype=p.dtype, device=device)
                    with torch.no_grad():
                        self.read_into(named[id(p)], value)
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
        self.folders = {k: checkpoint_folder(v) for k, v in folders.items()}
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
        return self._file(path).read(key, start, stop)

    def read_into(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Rows of parameter ``name`` straight from the file into ``out`` (chunked, cast by
        ``copy_``; see :meth:`SafetensorsFile.read_into`)."""
        found = self.locate(name)
        if found is None:
            raise KeyError(name)
        key, path = found
        self._file(path).read_into(key, out, start)

    def _file(self, path: Path) -> SafetensorsFile:
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        return self._open[path]

    def shape(self, name: str) -> tuple[int, ...] | None:
        found = self.locate(name)
        if found is None:
            return None
        key, path = found
        return self._file(path).shape(key)

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
