"""Tokenizers behind one small interface: a character tokenizer for the tiny models, and an
adapter around a local Hugging Face tokenizer for the real ones.

Tiny models use characters because the spike showed BPE targets fail to train on CPU in the
time budget (WER 0.79 after 20 min vs 0.19 with characters). The vocabulary covers the letters
of the 8 MLS languages, digits, space and apostrophe, plus specials: pad (also the CTC blank),
bos, eos, unk and one prompt token per language.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, Sequence

LANGUAGES = ("en", "de", "nl", "fr", "es", "it", "pt", "pl")
_BASE = "abcdefghijklmnopqrstuvwxyz0123456789 '-"
# Letters with diacritics used by de, nl, fr, es, it, pt, pl (lower case; text is lower-cased).
_ACCENTED = "äöüßàâæçéèêëîïôœùûÿáíñóúìòãõąćęłńśźż"
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


class Tokenizer(Protocol):
    """What the speech-LLM needs from a tokenizer."""

    pad_id: int
    bos_id: int
    eos_id: int

    def __len__(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def prompt_ids(self, language: str | None) -> list[int]: ...
    def save(self, path: str | Path) -> None: ...


def fold_case_and_spaces(text: str) -> str:
    """Lower-case and collapse whitespace before tokenising (and after decoding). Transcripts
    arrive normalised already (``cluster_fl.data.vocab.normalize_text``, which WER scoring uses
    too); this only keeps arbitrary text within the tokenizer's symbols."""
    return " ".join(text.lower().split())


class CharTokenizer:
    """Character-level tokenizer; ids are stable for a given symbol list (saved with the model)."""

    def __init__(self, symbols: Sequence[str] | None = None,
                 languages: Sequence[str] = LANGUAGES):
        if symbols is None:
            symbols = list(SPECIALS) + [f"<{lang}>" for lang in languages] + list(
                dict.fromkeys(_BASE + _ACCENTED))
        self.symbols = list(symbols)
        self._index = {s: i for i, s in enumerate(self.symbols)}
        if len(self._index) != len(self.symbols):
            raise ValueError("tokenizer symbols must be unique")
        self.pad_id = self._index["<pad>"]
        self.bos_id = self._index["<bos>"]
        self.eos_id = self._index["<eos>"]
        self.unk_id = self._index["<unk>"]

    def __len__(self) -> int:
        return len(self.symbols)

    def encode(self, text: str) -> list[int]:
        """Ids of the normalized text's characters (unknown characters map to ``<unk>``)."""
        return [self._index.get(ch, self.unk_id) for ch in fold_case_and_spaces(text)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, skipping special tokens."""
        out = []
        for i in ids:
            s = self.symbols[int(i)] if 0 <= int(i) < len(self.symbols) else ""
            if not (s.startswith("<") and s.endswith(">") and len(s) > 1):
                out.append(s)
        return fold_case_and_spaces("".join(out))

    def prompt_ids(self, language: str | None) -> list[int]:
        """The text prompt after the audio: bos and, when known, the language token."""
        tag = self._index.get(f"<{language}>") if language else None
        return [self.bos_id] + ([tag] if tag is not None else [])

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` under directory ``path``."""
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "tokenizer.json").write_text(
            json.dumps({"kind": "char", "symbols": self.symbols}, ensure_ascii=False))

    @classmethod
    def load(cls, path: str | Path) -> "CharTokenizer":
        """Read a tokenizer written by :meth:`save`."""
        data = json.loads((Path(path) / "tokenizer.json").read_text())
        if data.get("kind") != "char":
            raise ValueError(f"{path}/tokenizer.json is not a character tokenizer")
        return cls(data["symbols"])


class HFTokenizer:
    """Adapter over a local Hugging Face tokenizer (real decoders); never downloads."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.inner = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.bos_id = self.inner.bos_token_id if self.inner.bos_token_id is not None else 0
        self.eos_id = self.inner.eos_token_id if self.inner.eos_token_id is not None else 0
        self.pad_id = self.inner.pad_token_id if self.inner.pad_token_id is not None else self.eos_id

    def __len__(self) -> int:
        return len(self.inner)

    def encode(self, text: str) -> list[int]:
        return list(self.inner.encode(" " + fold_case_and_spaces(text), add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return fold_case_and_spaces(self.inner.decode(list(ids), skip_special_tokens=True))

    def prompt_ids(self, language: str | None) -> list[int]:
        prompt = f"Transcribe ({language}):" if language else "Transcribe:"
        return [self.bos_id] + list(self.inner.encode(prompt, add_special_tokens=False))

    def save(self, path: str | Path) -> None:
        self.inner.save_pretrained(str(path))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load whichever tokenizer a checkpoint directory holds."""
    p = Path(path)
    if (p / "tokenizer.json").is_file():
        try:
            return CharTokenizer.load(p)
        except (ValueError, KeyError):
            pass
    return HFTokenizer(str(p))
