"""Reader for the MLS layouts (synthetic corpus or real MLS), clients and their report.

Layouts understood, under a local root, detected per language folder:

* ours: ``<root>/<lang>/<split>/part-*.parquet`` (see :mod:`cluster_fl.data.corpus`);
* Hugging Face MLS: ``<root>/<language name or code>/[data/]<split>-000NN-of-000MM.parquet``
  (``facebook/multilingual_librispeech``), with columns ``audio{bytes,path}``, ``transcript``,
  ``speaker_id``, ``id`` and ``audio_duration`` instead of ours;
* OpenSLR MLS (SLR94): ``<root>/mls_<language>[_opus]/<split>/transcripts.txt`` (``<id>\t<text>``,
  ids ``<speaker>_<book>_<n>``), ``segments.txt`` (``<id>\t<url>\t<start>\t<end>``: durations
  without decoding) and ``audio/<speaker>/<book>/<id>.flac`` or ``.opus``. Such a split is one
  :class:`Shard` whose path is its ``transcripts.txt``; Opus needs a libsndfile that decodes it
  (:func:`check_opus`).

Audio may be a struct with encoded file bytes (FLAC/WAV, decoded with soundfile), a float list,
or raw int16 bytes with a ``sampling_rate`` column. A row whose audio does not decode is
reported with its utterance id (a :class:`CorpusWarning` and the caller's ``errors`` list) and
skipped -- never a traceback; a shard that is not readable Parquet at all (truncated, not
Parquet) is a one-line error naming it. Clients are speakers: one language per client, ids stable.
"""

from __future__ import annotations

import hashlib
import io
import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from cluster_fl.data.vocab import normalize_text
from cluster_fl.errors import UserError, short_reason

SAMPLE_RATE = 16000
LANGUAGE_NAMES = {"english": "en", "german": "de", "dutch": "nl", "french": "fr",
                  "spanish": "es", "italian": "it", "portuguese": "pt", "polish": "pl"}
_ALIASES = {"speaker": ("speaker", "speaker_id"), "utterance_id": ("utterance_id", "id", "file"),
            "transcript": ("transcript", "text", "sentence"),
            "duration": ("duration", "audio_duration")}


class CorpusWarning(UserWarning):
    """A corpus row that could not be used (names the utterance id)."""


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes: a shard's content key (cached features, the corpus manifest)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


@dataclass
class Utterance:
    """One utterance's metadata; ``audio`` is filled only when decoded."""

    utterance_id: str
    speaker: str
    language: str
    split: str
    transcript: str
    duration: float | None
    shard: str
    row: int
    audio: np.ndarray | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Shard:
    """One Parquet file holding utterances of one language and split."""

    path: str
    language: str
    split: str

    @property
    def layout(self) -> str:
        """``openslr`` (a split's ``transcripts.txt``) or ``parquet``."""
        return "openslr" if self.path.endswith(TRANSCRIPTS) else "parquet"


TRANSCRIPTS = "transcripts.txt"
AUDIO_SUFFIXES = (".flac", ".opus")


def _language_of(name: str) -> str | None:
    name = name.lower()
    if name in LANGUAGE_NAMES.values():
        return name
    return LANGUAGE_NAMES.get(name.removeprefix("mls_").removesuffix("_opus"))


def find_shards(root: str | Path, languages: Sequence[str] | None = None,
                splits: Sequence[str] | None = None) -> list[Shard]:
    """All shards under ``root`` for the given languages/splits, in a stable sorted order.

    A language folder holding ``<split>/transcripts.txt`` is read as OpenSLR, otherwise its
    Parquet files are the shards."""
    return [s for s in _all_shards(root) if (languages is None or s.language in languages)
            and (splits is None or s.split in splits)]


def _all_shards(root: str | Path) -> list[Shard]:
    root = Path(root).expanduser()
    if not root.is_dir():
        raise UserError(f"corpus folder {root} does not exist (build one with "
                        f"'cluster-fl make-corpus {root}' or see docs/mls.md for real MLS)")
    shards = []
    for lang_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        lang = _language_of(lang_dir.name)
        if lang is None:
            continue
        openslr = sorted(lang_dir.glob(f"*/{TRANSCRIPTS}"))
        if openslr:
            shards += [Shard(str(p), lang, p.parent.name) for p in openslr]
            continue
        for path in sorted(lang_dir.rglob("*.parquet")):
            if path.name.startswith("."):
                continue  # a tmp file of a writer in progress
            parent = path.parent.name
            split = parent if parent not in (lang_dir.name, "data") else \
                path.name.split("-")[0].split(".")[0]
            shards.append(Shard(str(path), lang, split))
    return shards


def describe_corpus(root: str | Path) -> str:
    """What a corpus holds, for an error: its languages and, per language, its splits."""
    found: dict[str, set[str]] = {}
    for s in _all_shards(root):
        found.setdefault(s.language, set()).add(s.split)
    if not found:
        return (f"{root} holds no MLS language folder (<lang>/<split>/*.parquet, "
                "<language>/<split>-*.parquet or mls_<language>/<split>/transcripts.txt)")
    return "it has " + "; ".join(f"{lang}: {', '.join(sorted(sp))}"
                                 for lang, sp in sorted(found.items()))


def check_opus(path: str | Path) -> None:
    """A one-line error naming ``path`` when the installed libsndfile cannot decode Opus."""
    import soundfile as sf

    if "OPUS" not in sf.available_subtypes("OGG"):
        raise UserError(f"{path}: Opus audio, but the installed libsndfile "
                        f"({sf.__libsndfile_version__}) does not decode Opus; install "
                        "libsndfile >= 1.0.29 (pip install -U soundfile ships one) or use "
                        "the FLAC release of MLS")


def _column(table: Any, key: str) -> list | None:
    for name in _ALIASES.get(key, (key,)):
        if name in table.column_names:
            return table.column(name).to_pylist()
    return None


def decode_audio(value: Any, rate: int | None) -> np.ndarray:
    """One ``audio`` cell -> float32 mono at 16 kHz. Raises ValueError when undecodable."""
    if isinstance(value, dict):
        data = value.get("bytes")
        if data is None and value.get("array") is not None:
            audio, rate = np.asarray(value["array"], np.float32), value.get("sampling_rate", rate)
        elif data is None:
            raise ValueError("audio struct has no bytes")
        else:
            import soundfile as sf

            try:
                audio, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=False)
            except Exception as exc:  # soundfile raises its own LibsndfileError
                raise ValueError(f"undecodable audio bytes ({exc})") from None
    elif isinstance(value, (bytes, bytearray)):
        if len(value) % 2:
            raise ValueError("raw int16 audio has an odd number of bytes")
        audio = np.frombuffer(value, np.int16).astype(np.float32) / 32768.0
    elif isinstance(value, (list, np.ndarray)):
        audio = np.asarray(value, dtype=np.float32)
    else:
        raise ValueError(f"unsupported audio cell of type {type(value).__name__}")
    if audio.ndim == 2:
        audio = audio.mean(axis=1)
    if audio.size == 0 or not np.all(np.isfinite(audio)):
        raise ValueError("empty or non-finite audio")
    rate = int(rate or SAMPLE_RATE)
    if rate != SAMPLE_RATE:
        from math import gcd

        from scipy.signal import resample_poly

        g = gcd(rate, SAMPLE_RATE)
        audio = resample_poly(audio, SAMPLE_RATE // g, rate // g).astype(np.float32)
    return audio.astype(np.float32, copy=False)


def read_shard(shard: Shard, decode: bool = False, errors: list[dict] | None = None,
               rows: Iterable[int] | None = None) -> list[Utterance]:
    """Utterances of one shard (optionally only ``rows``); ``decode`` fills ``audio``."""
    if shard.layout == "openslr":
        return _read_openslr(shard, decode, errors, rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(shard.path)
        names = set(pf.schema_arrow.names)
        wanted = [n for n in names if n != "audio" or decode]
        table = pf.read(columns=wanted)
    except (pa.ArrowException, OSError) as exc:
        reason = short_reason(exc)
        raise UserError(f"{shard.path}: unreadable corpus shard ({reason}); re-download it or "
                        "rebuild the corpus") from None
    ids = _column(table, "utterance_id")
    speakers, texts = _column(table, "speaker"), _column(table, "transcript")
    if ids is None or speakers is None or texts is None:
        raise UserError(f"{shard.path}: not an MLS-layout shard (needs utterance id, speaker "
                        f"and transcript columns; has {sorted(names)})")
    durations = _column(table, "duration") or [None] * len(ids)
    rates = _column(table, "sampling_rate") or [None] * len(ids)
    audios = _column(table, "audio") if decode else None
    out = []
    for i in (range(len(ids)) if rows is None else rows):
        utt = Utterance(str(ids[i]), str(speakers[i]), shard.language, shard.split,
                        normalize_text(texts[i] or ""), durations[i], shard.path, i)
        if decode:
            try:
                utt.audio = decode_audio(audios[i], rates[i])
                utt.duration = len(utt.audio) / SAMPLE_RATE
            except ValueError as exc:
                report_problem(errors, utt.utterance_id, shard.path, str(exc))
                continue
        out.append(utt)
    return out


def _read_openslr(shard: Shard, decode: bool, errors: list[dict] | None,
                  rows: Iterable[int] | None) -> list[Utterance]:
    """Utterances of one OpenSLR split (``shard.path`` is its ``transcripts.txt``)."""
    split_dir = Path(shard.path).parent
    try:
        lines = Path(shard.path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{shard.path}: unreadable MLS transcripts ({short_reason(exc)})") from None
    durations = _segment_durations(split_dir / "segments.txt")
    entries = [line.split("\t", 1) for line in lines if line.strip()]
    out = []
    for i in (range(len(entries)) if rows is None else rows):
        if len(entries[i]) != 2 or entries[i][0].count("_") < 2:
            raise UserError(f"{shard.path}: line {i + 1} is not '<speaker>_<book>_<n>\\t<text>'")
        uid, text = entries[i][0].strip(), entries[i][1]
        utt = Utterance(uid, uid.split("_")[0], shard.language, shard.split,
                        normalize_text(text), durations.get(uid), shard.path, i)
        if decode:
            try:
                utt.audio = read_audio_file(openslr_audio(shard.path, uid))
                utt.duration = len(utt.audio) / SAMPLE_RATE
            except ValueError as exc:
                report_problem(errors, uid, shard.path, str(exc))
                continue
        out.append(utt)
    return out


def _segment_durations(path: Path) -> dict[str, float]:
    """utterance id -> seconds, from ``segments.txt`` (absent: durations unknown until decoded)."""
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split("\t")
        try:
            out[parts[0]] = round(float(parts[-1]) - float(parts[-2]), 3)
        except (ValueError, IndexError):
            continue  # a duration is an estimate for planning; the audio decides
    return out


def openslr_audio(transcripts: str | Path, utterance_id: str) -> Path:
    """The audio file of an OpenSLR utterance: ``audio/<speaker>/<book>/<id>.flac|.opus``
    (the FLAC path when neither exists: the caller reports it missing)."""
    speaker, book = utterance_id.split("_")[:2]
    base = Path(transcripts).parent / "audio" / speaker / book / utterance_id
    for suffix in AUDIO_SUFFIXES:
        if base.with_suffix(suffix).is_file():
            return base.with_suffix(suffix)
    return base.with_suffix(".flac")


def read_audio_file(path: Path) -> np.ndarray:
    """An audio file -> float32 mono at 16 kHz; ValueError when missing or undecodable, a
    :class:`UserError` (one line) when it is Opus and libsndfile cannot decode Opus."""
    if path.suffix == ".opus":
        check_opus(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"audio file {path} unreadable ({exc.strerror or exc})") from None
    return decode_audio({"bytes": data}, None)


def report_problem(errors: list[dict] | None, utterance_id: str, shard: str, reason: str) -> None:
    """Record an unusable row: a warning naming the utterance, and an entry in ``errors``."""
    warnings.warn(f"skipping utterance {utterance_id} ({shard}): {reason}", CorpusWarning,
                  stacklevel=3)
    if errors is not None:
        errors.append({"utterance_id": utterance_id, "shard": shard, "reason": reason})


def load_utterances(root: str | Path, languages: Sequence[str] | None = None,
                    splits: Sequence[str] | None = None, max_utterances: int = 0,
                    decode: bool = False, errors: list[dict] | None = None) -> list[Utterance]:
    """Utterances under ``root`` (sorted by language, split, shard, row).

    ``max_utterances`` caps the total (0 = all), taken per language in turn so every language
    keeps a share. Undecodable rows (with ``decode``) are skipped and reported.
    """
    shards = find_shards(root, languages, splits)
    if not shards:
        raise UserError(f"no shards in {root} for languages {','.join(languages or ['any'])} "
                        f"and splits {','.join(splits or ['any'])}: {describe_corpus(root)}")
    utts = [u for s in shards for u in read_shard(s, decode=decode, errors=errors)]
    if max_utterances and len(utts) > max_utterances:
        by_lang: dict[str, list[Utterance]] = {}
        for u in utts:
            by_lang.setdefault(u.language, []).append(u)
        picked: list[Utterance] = []
        queues = [iter(v) for v in by_lang.values()]
        while len(picked) < max_utterances and queues:
            for q in list(queues):
                nxt = next(q, None)
                if nxt is None:
                    queues.remove(q)
                elif len(picked) < max_utterances:
                    picked.append(nxt)
        keep = {id(u) for u in picked}
        utts = [u for u in utts if id(u) in keep]
    return utts


@dataclass
class Client:
    """A federated client: one speaker, one language."""

    index: int
    client_id: str
    speaker: str
    language: str
    utterances: list[Utterance]


def partition_clients(utterances: Iterable[Utterance], max_clients: int = 0,
                      max_utterances_per_client: int = 0) -> list[Client]:
    """Speaker -> client, one language per client, indices 0..n-1 in (language, speaker) order.

    ``max_clients`` keeps a language-balanced subset (round-robin over languages); a speaker
    heard in two languages becomes two clients. ``max_utterances_per_client`` keeps a client's
    first utterances by id.
    """
    groups: dict[tuple[str, str], list[Utterance]] = {}
    for u in utterances:
        groups.setdefault((u.language, u.speaker), []).append(u)
    clients = []
    for index, (lang, speaker) in enumerate(choose_speakers(sorted(groups), max_clients)):
        utts = sorted(groups[(lang, speaker)], key=lambda u: u.utterance_id)
        if max_utterances_per_client:
            utts = utts[:max_utterances_per_client]
        clients.append(Client(index, f"{lang}/{speaker}", speaker, lang, utts))
    return clients


def choose_speakers(keys: Sequence[tuple[str, str]], max_clients: int = 0
                    ) -> list[tuple[str, str]]:
    """(language, speaker) keys, sorted, of the clients: all, or ``max_clients`` of them taken
    round-robin over the languages (each language's first speakers in order)."""
    keys = sorted(keys)
    if not max_clients or len(keys) <= max_clients:
        return keys
    per_lang: dict[str, list[tuple[str, str]]] = {}
    for k in keys:
        per_lang.setdefault(k[0], []).append(k)
    chosen: list[tuple[str, str]] = []
    depth = 0
    while len(chosen) < max_clients:
        for lang in sorted(per_lang):
            if depth < len(per_lang[lang]) and len(chosen) < max_clients:
                chosen.append(per_lang[lang][depth])
        depth += 1
    return sorted(chosen)


def partition_report(clients: Sequence[Client]) -> dict[str, Any]:
    """Clients per language, utterances per client (min/median/max) and hours, as a dict."""
    def stats(values: list[int]) -> dict[str, float]:
        if not values:
            return {"min": 0, "median": 0, "max": 0}
        return {"min": min(values), "median": float(statistics.median(values)),
                "max": max(values)}

    def hours(cs: Iterable[Client]) -> float:
        return round(sum(u.duration or 0.0 for c in cs for u in c.utterances) / 3600, 4)

    langs = sorted({c.language for c in clients})
    per_language = {}
    for lang in langs:
        cs = [c for c in clients if c.language == lang]
        per_language[lang] = {"clients": len(cs),
                              "utterances": sum(len(c.utterances) for c in cs),
                              "utterances_per_client": stats([len(c.utterances) for c in cs]),
                              "hours": hours(cs)}
    return {"clients": len(clients), "utterances": sum(len(c.utterances) for c in clients),
            "utterances_per_client": stats([len(c.utterances) for c in clients]),
            "hours": hours(clients), "languages": per_language}


def format_partition_report(report: dict[str, Any]) -> str:
    """The report as a small text table."""
    lines = [f"{'lang':<5} {'clients':>7} {'utts':>7} {'min':>5} {'median':>7} {'max':>5} "
             f"{'hours':>7}"]
    rows = [(lang, r) for lang, r in report["languages"].items()] + [("all", report)]
    for lang, r in rows:
        s = r["utterances_per_client"]
        lines.append(f"{lang:<5} {r['clients']:>7} {r['utterances']:>7} {s['min']:>5} "
                     f"{s['median']:>7.1f} {s['max']:>5} {r['hours']:>7.3f}")
    return "\n".join(lines)


def count_clients(data_cfg: Any) -> int:
    """Number of federated clients a ``DataConfig`` yields (reads metadata only, no audio)."""
    utts = load_utterances(data_cfg.corpus, data_cfg.languages, [data_cfg.client_split])
    return len(partition_clients(utts, max_clients=data_cfg.max_clients))
