"""Small corpora in the two real MLS layouts, written with soundfile (FLAC, or Opus).

* :func:`write_openslr`: ``<root>/mls_<language>/<split>/transcripts.txt``, ``segments.txt`` and
  ``audio/<speaker>/<book>/<speaker>_<book>_<n>.flac`` (OpenSLR SLR94);
* :func:`write_hf_parquet`: ``<root>/<language>/data/<split>-0000N-of-0000M.parquet`` with the
  Hugging Face columns (``audio{bytes,path}``, ``transcript``, ``speaker_id``, ``id``,
  ``audio_duration``), every split in two shards so that a speaker spans both.

Each speaker reads ``books`` books; the audio is a tone whose pitch and length follow the
utterance, so every utterance's features differ.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile as sf

WORDS = ("guten", "tag", "welt", "haus", "buch", "lesen", "stimme", "morgen")


def _utterances(speakers: dict[str, int], books: int) -> list[tuple[str, str, str, np.ndarray]]:
    """(speaker, book, utterance id, 16 kHz audio) for every utterance, in id order."""
    out = []
    for s, (speaker, n) in enumerate(sorted(speakers.items())):
        for i in range(n):
            book = str(100 + i % books)
            uid = f"{speaker}_{book}_{i:06d}"
            seconds = 0.4 + 0.1 * ((i * 7 + s) % 6)
            t = np.arange(int(16000 * seconds)) / 16000
            audio = (0.3 * np.sin(2 * np.pi * (180 + 40 * s + 13 * i) * t)).astype(np.float32)
            out.append((speaker, book, uid, audio))
    return sorted(out, key=lambda x: x[2])


def _text(uid: str) -> str:
    n = sum(map(ord, uid))
    return " ".join(WORDS[(n + k) % len(WORDS)] for k in range(2 + n % 3))


def write_openslr(root: Path, language: str, splits: dict[str, dict[str, int]],
                  books: int = 2, fmt: str = "FLAC") -> Path:
    """An OpenSLR-layout language folder under ``root``; ``splits``: split -> speaker -> n."""
    suffix = ".opus" if fmt == "OGG" else ".flac"
    for split, speakers in splits.items():
        folder = root / f"mls_{language}" / split
        lines, segments = [], []
        for speaker, book, uid, audio in _utterances(speakers, books):
            path = folder / "audio" / speaker / book / f"{uid}{suffix}"
            path.parent.mkdir(parents=True, exist_ok=True)
            if fmt == "OGG":
                sf.write(path, audio, 16000, format="OGG", subtype="OPUS")
            else:
                sf.write(path, audio, 16000, format="FLAC")
            lines.append(f"{uid}\t{_text(uid)}")
            segments.append(f"{uid}\thttp://www.archive.org/{book}.mp3\t1.5\t"
                            f"{1.5 + len(audio) / 16000:.2f}")
        (folder / "transcripts.txt").write_text("\n".join(lines) + "\n")
        (folder / "segments.txt").write_text("\n".join(segments) + "\n")
    return root


def write_hf_parquet(root: Path, language: str, splits: dict[str, dict[str, int]],
                     books: int = 2) -> Path:
    """A Hugging Face-layout language folder under ``root``, two shards per split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split, speakers in splits.items():
        utts = _utterances(speakers, books)
        halves = [utts[0::2], utts[1::2]]
        for k, rows in enumerate(halves):
            audio = []
            for _, _, uid, pcm in rows:
                buf = io.BytesIO()
                sf.write(buf, pcm, 16000, format="FLAC")
                audio.append({"bytes": buf.getvalue(), "path": f"{uid}.flac"})
            path = root / language / "data" / f"{split}-{k:05d}-of-{len(halves):05d}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table({
                "audio": audio, "original_path": ["x"] * len(rows),
                "transcript": [_text(r[2]) for r in rows],
                "speaker_id": [r[0] for r in rows], "id": [r[2] for r in rows],
                "audio_duration": [len(r[3]) / 16000 for r in rows]}), path)
    return root
