"""The synthetic multilingual corpus: speakers, rendering with eSpeak NG, MLS-layout Parquet.

:func:`make_corpus` (the command ``cluster-fl make-corpus OUT``) writes::

    OUT/corpus.json                       the parameters (a re-run with other ones is refused)
    OUT/speakers.json                     every speaker: language, split, voice
    OUT/<lang>/<split>/part-00000.parquet shards, split in {public, private, test}
    OUT/manifest.json                     counts and hours per language/split (written last)

Audio is stored the way the published MLS / Hugging Face Parquet files store it: a struct
column ``audio`` = {bytes: a FLAC file, path: str}; so :mod:`cluster_fl.data.mls` reads real MLS
shards and ours with one code path. FLAC keeps int16 PCM losslessly at about half the size.

Speakers: public (central pretraining; many utterances), private (federated clients, one
language each, 20-60 utterances) and test (held-out evaluation). Splits are speaker-disjoint,
and the voice variants are split three ways too, so private and test speakers use variants the
pretrained model never heard. Every shard is written once (tmp file + rename) and a re-run skips
finished shards, so a crash loses at most the shards in flight.

Reproducible to the byte: eSpeak seeds its random generator from the clock, and keeps state
across calls inside a process (an utterance depends on everything that process rendered before,
and no library call resets it). So every utterance seeds the generator from its id, and each
shard renders in a process of its own, forked from a clean server. A shard's bytes then depend
only on its speakers and texts, not on the clock, the worker count, the machine's load or a
resume.
Corpora made before this (``corpus.json`` without ``renderer``; the ``corpus-v2`` folders) let a
worker render many shards in turn, which made them a draw of the scheduling: still readable as
they are, but a new render of the same parameters differs.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from cluster_fl.data.espeak import TARGET_RATE_HZ, VoiceParams, list_variants
from cluster_fl.data.vocab import LANGUAGES, normalize_text, sample_sentences
from cluster_fl.errors import UserError

SPLITS = ("public", "private", "test")
VARIANT_SHARES = {"public": 0.7, "private": 0.15, "test": 0.15}
SHARD_SIZE = 1000
FORMAT = "cluster_fl-mls/1"
# Speakers per language and split of the default corpus. 80 public speakers (was 40 until
# 2026-12-03): twice the voices for pretraining cut the tiny model's WER on never-seen public
# speakers from 0.24-0.26 to 0.21 and on the test voices from 0.38 to 0.33 (results/LOG.md).
DEFAULT_SPEAKERS = {"public": 80, "private": 30, "test": 4}
# The default corpus's cache folder, versioned: a folder made with older defaults is refused by
# make_corpus (other parameters), so changing DEFAULT_SPEAKERS moves the default folder too.
DEFAULT_FOLDER = "corpus-v3"  # v3: one process per shard (byte-reproducible); v2: 80 public speakers
RENDERER = "process-per-shard"  # recorded in corpus.json; absent in corpora of the old renderer


def default_cache() -> Path:
    """Where ``cluster-fl demo`` caches corpus, checkpoints and results: ``$CLUSTER_FL_CACHE``,
    else ``~/.cache/cluster_fl``."""
    return Path(os.environ.get("CLUSTER_FL_CACHE", "~/.cache/cluster_fl")).expanduser()


def default_corpus() -> Path:
    """The folder the demo renders the default corpus into (and benchmarks read)."""
    return default_cache() / DEFAULT_FOLDER


@dataclass(frozen=True)
class SpeakerSpec:
    """One synthetic speaker: id, language, split, voice and number of utterances."""

    speaker: str
    language: str
    split: str
    voice: VoiceParams
    utterances: int


def split_variants(seed: int) -> dict[str, tuple[str, ...]]:
    """Partition the voice variants into disjoint public / private / test pools."""
    variants = list(list_variants())
    order = np.random.default_rng([seed, 11]).permutation(len(variants))
    shuffled = [variants[i] for i in order]
    n_private = max(1, round(VARIANT_SHARES["private"] * len(shuffled)))
    n_test = max(1, round(VARIANT_SHARES["test"] * len(shuffled)))
    return {"private": tuple(sorted(shuffled[:n_private])),
            "test": tuple(sorted(shuffled[n_private:n_private + n_test])),
            "public": tuple(sorted(shuffled[n_private + n_test:]))}


def plan_speakers(languages: Sequence[str], counts: dict[str, int],
                  utterances: dict[str, tuple[int, int]], seed: int) -> list[SpeakerSpec]:
    """Speakers per language and split: voice variant x pitch x range x rate x gap x volume.

    ``counts[split]`` speakers per language; ``utterances[split] = (lo, hi)`` inclusive range of
    utterances per speaker.
    """
    pools = split_variants(seed)
    specs = []
    for lang in languages:
        lang_index = LANGUAGES.index(lang) if lang in LANGUAGES else len(LANGUAGES)
        for split_index, split in enumerate(SPLITS):
            rng = np.random.default_rng([seed, lang_index, split_index, 3])
            pool = pools[split]
            offset = int(rng.integers(len(pool)))  # different languages start on other variants
            for i in range(counts[split]):
                voice = VoiceParams(
                    variant=pool[(offset + i) % len(pool)],
                    pitch=int(rng.integers(25, 76)),
                    pitch_range=int(rng.integers(30, 81)),
                    rate=int(rng.integers(140, 211)),
                    word_gap=int(rng.integers(0, 3)),
                    volume=int(rng.integers(70, 131)))
                lo, hi = utterances[split]
                specs.append(SpeakerSpec(speaker=f"{lang}-{split}-{i:04d}", language=lang,
                                         split=split, voice=voice,
                                         utterances=int(rng.integers(lo, hi + 1))))
    return specs


def _shard_tasks(specs: list[SpeakerSpec], seed: int, shard_size: int) -> list[dict[str, Any]]:
    """Group utterances (speaker order) into shards of at most ``shard_size`` per lang/split."""
    tasks = []
    for lang in dict.fromkeys(s.language for s in specs):
        for split in SPLITS:
            rows = []
            for s in (s for s in specs if s.language == lang and s.split == split):
                speaker_seed = [seed, *map(ord, s.speaker)]
                texts = sample_sentences(lang, s.utterances, int(np.random.default_rng(
                    speaker_seed).integers(2**31)))
                rows += [(s.speaker, f"{s.speaker}-{k:04d}", asdict(s.voice), t)
                         for k, t in enumerate(texts)]
            for part, start in enumerate(range(0, len(rows), shard_size)):
                tasks.append({"language": lang, "split": split,
                              "path": f"{lang}/{split}/part-{part:05d}.parquet",
                              "rows": rows[start:start + shard_size]})
    return tasks


def encode_flac(audio: np.ndarray, rate: int = TARGET_RATE_HZ) -> bytes:
    """float32 in [-1, 1] -> FLAC file bytes (16-bit PCM)."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, audio, rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


_counter = None  # shared progress counter in worker processes


def _init_worker(counter) -> None:  # noqa: ANN001 - multiprocessing Value
    global _counter
    _counter = counter


def _render_shard(out: str, task: dict[str, Any]) -> tuple[str, int, float]:
    """Render one shard and publish it atomically; returns (path, rows, seconds of audio)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cluster_fl.data.espeak import synthesize

    final = Path(out) / task["path"]
    cols: dict[str, list] = {k: [] for k in ("audio", "sampling_rate", "transcript", "speaker",
                                             "language", "utterance_id", "split", "duration")}
    for speaker, utt_id, voice, text in task["rows"]:
        audio = synthesize(text, task["language"], VoiceParams(**voice),
                           seed=zlib.crc32(utt_id.encode()))
        cols["audio"].append({"bytes": encode_flac(audio), "path": f"{utt_id}.flac"})
        cols["sampling_rate"].append(TARGET_RATE_HZ)
        cols["transcript"].append(normalize_text(text))
        cols["speaker"].append(speaker)
        cols["language"].append(task["language"])
        cols["utterance_id"].append(utt_id)
        cols["split"].append(task["split"])
        cols["duration"].append(len(audio) / TARGET_RATE_HZ)
        if _counter is not None:
            with _counter.get_lock():
                _counter.value += 1
    schema = pa.schema([
        ("audio", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        ("sampling_rate", pa.int32()), ("transcript", pa.string()), ("speaker", pa.string()),
        ("language", pa.string()), ("utterance_id", pa.string()), ("split", pa.string()),
        ("duration", pa.float32())])
    table = pa.table(cols, schema=schema)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, final)
    return task["path"], len(task["rows"]), float(sum(cols["duration"]))


def _shard_done(path: Path, rows: int) -> bool:
    import pyarrow.parquet as pq

    try:
        return path.exists() and pq.ParquetFile(path).metadata.num_rows == rows
    except Exception:  # a truncated/corrupt file from a foreign writer: render it again
        return False


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def build_manifest(out: Path, params: dict[str, Any]) -> dict[str, Any]:
    """Counts, speakers and hours per language/split, read back from the written shards, and
    each shard's SHA-256 with one ``digest`` over them all: two corpora with the same digest are
    the same bytes (renders are reproducible, module docstring), so a run's data can be named."""
    import hashlib

    import pyarrow.parquet as pq

    from cluster_fl.data.mls import file_sha256

    counts: dict[str, dict[str, dict[str, Any]]] = {}
    shards = []
    for path in sorted(out.glob("*/*/part-*.parquet")):
        t = pq.read_table(path, columns=["speaker", "duration"])
        lang, split = path.parent.parent.name, path.parent.name
        c = counts.setdefault(lang, {}).setdefault(split, {"utterances": 0, "hours": 0.0,
                                                           "speakers": set()})
        c["utterances"] += t.num_rows
        c["hours"] += float(np.sum(t.column("duration").to_numpy())) / 3600
        c["speakers"].update(t.column("speaker").to_pylist())
        shards.append({"path": str(path.relative_to(out)), "language": lang, "split": split,
                       "rows": t.num_rows, "sha256": file_sha256(path)})
    for per_split in counts.values():
        for c in per_split.values():
            c["speakers"], c["hours"] = len(c["speakers"]), round(c["hours"], 4)
    total_h = sum(c["hours"] for s in counts.values() for c in s.values())
    total_u = sum(c["utterances"] for s in counts.values() for c in s.values())
    digest = hashlib.sha256("".join(f"{s['sha256']}  {s['path']}\n" for s in shards).encode())
    return {"format": FORMAT, "sampling_rate": TARGET_RATE_HZ, "audio": "struct{bytes: flac}",
            "params": params, "counts": counts, "shards": shards, "digest": digest.hexdigest(),
            "total": {"utterances": total_u, "hours": round(total_h, 4)}}


def _resolve_counts(speakers_per_language: int | None, utterances_per_speaker: int | None,
                    public_speakers: int | None, private_speakers: int | None,
                    test_speakers: int | None, public_utterances: int,
                    private_utterances: tuple[int, int], test_utterances: int
                    ) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    counts = dict(DEFAULT_SPEAKERS)
    if speakers_per_language is not None:
        # Spread N over the splits in the default proportion (80:30:4), at least one each.
        n = speakers_per_language
        if n < 3:
            raise UserError(f"--speakers-per-language must be >= 3 (one per split), got {n}")
        total = sum(counts.values())
        counts = {k: max(1, int(round(n * v / total))) for k, v in counts.items()}
        counts["public"] = max(1, n - counts["private"] - counts["test"])
    for split, value in (("public", public_speakers), ("private", private_speakers),
                         ("test", test_speakers)):
        if value is not None:
            counts[split] = value
    utts = {"public": (public_utterances,) * 2, "private": tuple(private_utterances),
            "test": (test_utterances,) * 2}
    if utterances_per_speaker is not None:
        utts = {k: (utterances_per_speaker,) * 2 for k in SPLITS}
    for split in SPLITS:
        lo, hi = utts[split]
        if counts[split] < 0 or lo < 1 or hi < lo:
            raise UserError(f"bad sizes for split {split}: {counts[split]} speakers, "
                            f"{lo}-{hi} utterances each")
    return counts, utts  # type: ignore[return-value]


def make_corpus(out: str | Path, languages: Sequence[str] = LANGUAGES,
                speakers_per_language: int | None = None,
                utterances_per_speaker: int | None = None, seed: int = 0, *,
                public_speakers: int | None = None, private_speakers: int | None = None,
                test_speakers: int | None = None, public_utterances: int = 50,
                private_utterances: tuple[int, int] = (20, 60), test_utterances: int = 25,
                shard_size: int = SHARD_SIZE, workers: int | None = None,
                progress: bool = True) -> dict[str, Any]:
    """Render (or finish rendering) the synthetic corpus under ``out``; returns the manifest.

    Defaults per language: 80 public speakers x 50 utterances, 30 private speakers x 20-60,
    4 test speakers x 25. ``speakers_per_language`` spreads N speakers over the three splits
    (80:30:4); ``utterances_per_speaker`` fixes every speaker's count. Idempotent: finished
    shards are skipped, and a folder holding a corpus with other parameters is refused.
    """
    languages = tuple(languages)
    unknown = [lang for lang in languages if lang not in LANGUAGES]
    if unknown or not languages:
        raise UserError(f"unknown language(s) {unknown}; allowed: {', '.join(LANGUAGES)}")
    counts, utts = _resolve_counts(speakers_per_language, utterances_per_speaker,
                                   public_speakers, private_speakers, test_speakers,
                                   public_utterances, private_utterances, test_utterances)
    out = Path(out).expanduser()
    params = {"languages": list(languages), "seed": seed, "speakers": counts,
              "utterances": {k: list(v) for k, v in utts.items()}, "shard_size": shard_size,
              "variants": list(list_variants()), "renderer": RENDERER}
    out.mkdir(parents=True, exist_ok=True)
    params_path, manifest_path = out / "corpus.json", out / "manifest.json"
    if params_path.exists():
        old = json.loads(params_path.read_text())
        if "renderer" not in old and {**old, "renderer": RENDERER} == params:
            if manifest_path.exists():  # a finished corpus of the old renderer: used as it is
                print(f"make-corpus: {out} was rendered before shards had a process each (not "
                      "reproducible to the byte; see cluster_fl/data/corpus.py); using it as it "
                      "is", file=sys.stderr)
                return json.loads(manifest_path.read_text())
            raise UserError(f"{out} holds an unfinished corpus of the old renderer; finishing it "
                            "would mix two renderers: delete it or use another folder")
        if old != params:
            differ = ", ".join(f"{key}: {old.get(key)!r} there, {params[key]!r} asked"
                               for key in params if old.get(key) != params[key])
            raise UserError(f"{out} holds a corpus made with other parameters ({differ}); "
                            "use another folder or delete it")
        if manifest_path.exists():
            return json.loads(manifest_path.read_text())
    else:
        _atomic_json(params_path, params)
    specs = plan_speakers(languages, counts, utts, seed)
    _atomic_json(out / "speakers.json", [{**asdict(s), "voice": asdict(s.voice)} for s in specs])
    tasks = _shard_tasks(specs, seed, shard_size)
    todo = [t for t in tasks if not _shard_done(out / t["path"], len(t["rows"]))]
    total = sum(len(t["rows"]) for t in todo)
    _render_all(out, todo, total, workers, progress)
    manifest = build_manifest(out, params)
    _atomic_json(manifest_path, manifest)
    return manifest


def _render_all(out: Path, todo: list[dict[str, Any]], total: int, workers: int | None,
                progress: bool) -> None:
    """Render shards with progress, each in a fresh process (eSpeak's state would otherwise carry
    from one shard into the next): forked from a server that imported the modules but never
    touched eSpeak, so a process costs milliseconds, not an interpreter start."""
    if not todo:
        return
    workers = max(1, workers or min(len(todo), os.cpu_count() or 1))
    start = time.monotonic()

    def report(done: int, final: bool = False) -> None:
        if progress:
            el = time.monotonic() - start
            eta = el / done * (total - done) if done else float("nan")
            print(f"make-corpus: {done}/{total} utterances, {el:.0f}s elapsed"
                  + ("" if final else f", ~{eta:.0f}s left"), file=sys.stderr, flush=True)

    ctx = mp.get_context("forkserver")  # no inherited eSpeak or torch state
    ctx.set_forkserver_preload(["cluster_fl.data.corpus", "pyarrow.parquet", "soundfile"])
    counter = ctx.Value("l", 0)
    # Big shards first so the tail of the run is short.
    todo = sorted(todo, key=lambda t: -len(t["rows"]))
    with ctx.Pool(workers, initializer=_init_worker, initargs=(counter,),
                  maxtasksperchild=1) as pool:
        pending = [pool.apply_async(_render_shard, (str(out), t)) for t in todo]
        last = start
        while not all(p.ready() for p in pending):
            time.sleep(0.2)
            if time.monotonic() - last > 5:
                report(counter.value)
                last = time.monotonic()
        for p in pending:
            p.get()  # re-raise a worker's error here
    report(counter.value, final=True)


def format_manifest(manifest: dict[str, Any]) -> str:
    """A small table: language x split -> speakers / utterances / hours."""
    lines = [f"{'lang':<5} {'split':<8} {'speakers':>8} {'utts':>7} {'hours':>7}"]
    for lang, per_split in sorted(manifest["counts"].items()):
        for split in SPLITS:
            if split in per_split:
                c = per_split[split]
                lines.append(f"{lang:<5} {split:<8} {c['speakers']:>8} {c['utterances']:>7} "
                             f"{c['hours']:>7.3f}")
    t = manifest["total"]
    lines.append(f"total: {t['utterances']} utterances, {t['hours']:.2f} hours")
    if "digest" in manifest:  # corpora of the old renderer have none
        lines.append(f"digest: {manifest['digest']}")
    return "\n".join(lines)
