"""The features store: log-mel features per speaker, an index per shard, read one client at a time.

Layout, under ``<feature_cache or corpus/features>/<params hash>/`` (the hash covers n_mels, FFT,
hop, rate and :data:`FEATURE_VERSION`, so other parameters never read these files)::

    <shard path relative to the corpus, without suffix>/index.json
    <shard path relative to the corpus, without suffix>/<speaker>/<unit>.pt

A *shard* is what :func:`~cluster_fl.data.mls.find_shards` yields: a Parquet file, or an OpenSLR
split (its ``transcripts.txt``). ``index.json`` is the shard's metadata in brief -- per speaker
its utterance count, seconds and *units* -- built from the shard's metadata alone and rebuilt
when the shard's (or ``segments.txt``'s) size or modification time change. A unit is the audio a
speaker's part is computed from: the Parquet shard itself, or one OpenSLR book
(``audio/<speaker>/<book>/``). A part holds that speaker's features (float16) of that unit, its
transcripts and the rows that could not be used, with the unit's content key: the SHA-256 of the
audio bytes (the Parquet file, or the book's audio files in order) and of the unit's ids and
transcripts. A part is read only when both keys match the unit now; the audio hash is recomputed
only when its files' sizes or modification times moved (touched, same bytes: still read;
changed bytes: computed anew). Every file is written atomically (tmp + rename), so a killed
writer leaves nothing half-written, parallel writers of the same part agree, and a second
``cluster-fl features`` call finds every part and does no work.

A run reads the indexes (speakers, counts, seconds: :meth:`FeatureStore.clients`), never every
row's metadata, and a client's parts only while it trains (:meth:`FeatureStore.client`); a part
that is missing is computed then, from that speaker's rows alone. Nothing is kept in memory
between calls: host memory is bounded by the largest client, not the corpus.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from cluster_fl.data.features import HOP, N_FFT, SAMPLE_RATE, Example, log_mel
from cluster_fl.data.mls import (Client, Shard, Utterance, file_sha256, find_shards,
                                 openslr_audio, read_audio_file, read_shard, report_problem)
from cluster_fl.errors import UserError
from cluster_fl.progress import progress

# 3: one part per (speaker, unit) and an index per shard (2: one file per shard, keyed by the
# shard's content hash; 1: keyed by path). Older caches are not read and can be deleted.
FEATURE_VERSION = 3
INDEX = "index.json"
MANIFEST = "manifest.json"  # per speaker: its rows, ids and transcripts per unit
UNKNOWN_SECONDS = 30.0  # an utterance of unknown duration counts as Whisper's whole window
_ABSENT = object()  # an utterance the store has no row for (not even an unusable one)


def _text_key(utts: Sequence[Utterance]) -> str:
    h = hashlib.sha256()
    for u in utts:
        h.update(f"{u.utterance_id}\t{u.transcript}\n".encode())
    return h.hexdigest()


def _unit_of(shard: Shard, utterance_id: str) -> str:
    return utterance_id.split("_")[1] if shard.layout == "openslr" else "shard"


def _safe(name: str) -> str:
    return name.replace("/", "_").replace(os.sep, "_") or "_"


@dataclass
class IndexedClient:
    """A federated client known from the indexes alone: one speaker of one language and split."""

    index: int
    client_id: str
    speaker: str
    language: str
    split: str
    size: int  # utterances it trains on (after data.max_utterances_per_client)
    seconds: float  # audio of those utterances (an estimate when capped)
    shards: tuple[str, ...]  # shards holding its utterances
    cap: int = 0


class FeatureStore:
    """Features of a corpus by speaker (module docstring): clients, a client's examples, any
    utterances' examples, and the ``cluster-fl features`` work list."""

    def __init__(self, root: str | Path, cache_dir: str | Path | None = None,
                 n_mels: int = 80, progress: bool = True) -> None:
        self.root = Path(root).expanduser()
        self.n_mels = n_mels
        params = {"n_mels": n_mels, "n_fft": N_FFT, "hop": HOP, "sr": SAMPLE_RATE,
                  "version": FEATURE_VERSION}
        self.params_hash = hashlib.sha256(json.dumps(params, sort_keys=True).encode()
                                          ).hexdigest()[:12]
        base = Path(cache_dir).expanduser() if cache_dir else self.root / "features"
        self.cache_dir = base / self.params_hash
        self.computed_parts = 0  # parts (a speaker's features of one unit) computed here
        # unusable rows, each once: {utterance_id, shard, reason[, client]}
        self.errors: list[dict] = []
        self._reported: set[str] = set()
        self._loading: str | None = None  # the client whose parts are being read
        self._sha: dict[str, str] = {}  # (files, their stat) -> content hash, in this process
        self.progress = progress
        self._last_report = time.monotonic()

    @classmethod
    def from_config(cls, data_cfg: Any) -> "FeatureStore":
        """The store for a resolved ``DataConfig`` (corpus, feature_cache, n_mels). ``n_mels`` 0
        (the model's) must have been resolved at the run's entrance: the data layer does not
        know the model, and guessing is how 80-bin features once met a 128-bin encoder."""
        n_mels = getattr(data_cfg, "n_mels", 0)
        if not n_mels:
            raise ValueError("data.n_mels is 0 (the model's): resolve the config with "
                             "cluster_fl.models.registry.resolve_shapes before computing features")
        return cls(data_cfg.corpus, data_cfg.feature_cache, n_mels)

    # -- paths and keys -------------------------------------------------------------------------
    def shard_dir(self, shard: Shard) -> Path:
        rel = Path(shard.path).resolve().relative_to(self.root.resolve())
        return self.cache_dir / rel.with_suffix("")

    def _part_path(self, shard: Shard, speaker: str, unit: str) -> Path:
        return self.shard_dir(shard) / _safe(speaker) / f"{_safe(unit)}.pt"

    @staticmethod
    def _meta_files(shard: Shard) -> list[Path]:
        p = Path(shard.path)
        return [p, p.parent / "segments.txt"] if shard.layout == "openslr" else [p]

    @staticmethod
    def _stat(files: Iterable[Path]) -> list[list]:
        out = []
        for f in files:
            try:
                st = os.stat(f)
                out.append([f.name, st.st_size, st.st_mtime_ns])
            except OSError:
                out.append([f.name, None, None])
        return out

    @staticmethod
    def _unit_files(shard: Shard, ids: Sequence[str]) -> list[Path]:
        """The audio files a part is computed from: the Parquet shard, or each utterance's file
        of an OpenSLR book (``ids`` sorted)."""
        if shard.layout != "openslr":
            return [Path(shard.path)]
        return [openslr_audio(shard.path, i) for i in ids]

    def _content_key(self, files: Sequence[Path]) -> tuple[list[list], str]:
        """(stat of ``files``, SHA-256 of their bytes); hashed once per process per stat."""
        stat = self._stat(files)
        memo = json.dumps([[str(f) for f in files], stat])
        if memo not in self._sha:
            if len(files) == 1:
                self._sha[memo] = file_sha256(files[0]) if stat[0][1] is not None else ""
            else:
                h = hashlib.sha256()
                for f, (_, size, _) in zip(files, stat):
                    h.update(f.name.encode() + b"\0")
                    if size is not None:
                        h.update(bytes.fromhex(file_sha256(f)))
                self._sha[memo] = h.hexdigest()
        return stat, self._sha[memo]

    # -- the index --------------------------------------------------------------------------------
    def index(self, shard: Shard) -> dict:
        """The shard's index (module docstring): read, or built from its metadata and saved."""
        path = self.shard_dir(shard) / INDEX
        meta = self._stat(self._meta_files(shard))
        try:
            idx = json.loads(path.read_text())
            if idx.get("params_hash") == self.params_hash and idx.get("meta") == meta:
                return idx
        except (OSError, ValueError):
            pass  # missing or damaged: built again
        utts = read_shard(shard)
        speakers: dict[str, dict] = {}
        groups: dict[tuple[str, str], list[Utterance]] = {}
        for u in utts:
            groups.setdefault((u.speaker, _unit_of(shard, u.utterance_id)), []).append(u)
        manifests: dict[str, dict] = {}
        for (spk, unit), us in sorted(groups.items()):
            s = speakers.setdefault(spk, {"utterances": 0, "seconds": 0.0, "units": {}})
            s["utterances"] += len(us)
            s["seconds"] += sum(UNKNOWN_SECONDS if u.duration is None else float(u.duration)
                                for u in us)
            s["units"][unit] = {"text": _text_key(us), "n": len(us)}
            manifests.setdefault(spk, {})[unit] = {
                "rows": [u.row for u in us], "ids": [u.utterance_id for u in us],
                "texts": [u.transcript for u in us], "durations": [u.duration for u in us]}
        for spk, manifest in manifests.items():  # before the index: the index commits them
            self._save_bytes(self.shard_dir(shard) / _safe(spk) / MANIFEST,
                             json.dumps(manifest).encode())
        idx = {"version": FEATURE_VERSION, "params_hash": self.params_hash,
               "shard": str(Path(shard.path).resolve().relative_to(self.root.resolve())),
               "layout": shard.layout, "language": shard.language, "split": shard.split,
               "meta": meta, "speakers": speakers}
        self._save_bytes(path, json.dumps(idx, sort_keys=True).encode())
        return idx

    def clients(self, split: str, languages: Sequence[str], max_clients: int = 0,
                max_utterances_per_client: int = 0) -> list[IndexedClient]:
        """The split's speakers as clients, from the indexes alone: indices 0..n-1 in (language,
        speaker) order, ``max_clients`` language-balanced -- the same clients as
        :func:`~cluster_fl.data.mls.partition_clients` on the split's metadata."""
        from cluster_fl.data.mls import choose_speakers

        found: dict[tuple[str, str], list] = {}
        for shard in find_shards(self.root, list(languages), [split]):
            for spk, s in self.index(shard)["speakers"].items():
                entry = found.setdefault((shard.language, spk), [0, 0.0, []])
                entry[0] += s["utterances"]
                entry[1] += s["seconds"]
                entry[2].append(shard.path)
        out = []
        for i, key in enumerate(choose_speakers(sorted(found), max_clients)):
            n, seconds, shards = found[key]
            size = min(n, max_utterances_per_client) if max_utterances_per_client else n
            out.append(IndexedClient(i, f"{key[0]}/{key[1]}", key[1], key[0], split, size,
                                     seconds * size / max(n, 1), tuple(shards),
                                     max_utterances_per_client))
        return out

    # -- parts ------------------------------------------------------------------------------------
    def _part(self, shard: Shard, speaker: str, unit: str, entry: dict,
              compute: bool = True) -> dict | None:
        """A speaker's part of one unit: read when its keys hold, else computed (``compute``)."""
        path = self._part_path(shard, speaker, unit)
        blob = None
        if path.exists():
            try:
                blob = torch.load(path, weights_only=True)
                ids = blob["utterance_ids"] + [e["utterance_id"] for e in blob["skipped"]]
                if not (blob.get("params_hash") == self.params_hash and
                        blob.get("text") == entry["text"] and
                        self._same_audio(shard, sorted(ids), blob)):
                    blob = None  # other parameters, transcripts or audio: computed anew
            except Exception:  # a damaged part is computed again, never trusted
                blob = None
        if blob is not None:
            for e in blob["skipped"]:  # reported again: the run must know
                self._report(e, warn=True)
            return blob
        if not compute:
            return None
        return self._compute(shard, {speaker: {unit: entry}})[(speaker, unit)]

    def _same_audio(self, shard: Shard, ids: list[str], blob: dict) -> bool:
        """The part was computed from the unit's current bytes: the same stat, or the same hash
        (touched, same bytes)."""
        source = blob.get("source") or {}
        files = self._unit_files(shard, ids)
        stat = self._stat(files)
        if stat == source.get("stat"):
            return bool(source.get("sha256"))
        return self._content_key(files)[1] == source.get("sha256")

    def _compute(self, shard: Shard, todo: dict[str, dict[str, dict]]) -> dict:
        """Compute and save the parts ``todo`` ({speaker: {unit: index entry}}) of one shard,
        reading only their rows (their manifests say which); returns {(speaker, unit): part}."""
        wanted: dict[tuple[str, str], dict] = {}
        for speaker, units in todo.items():
            manifest = json.loads((self.shard_dir(shard) / _safe(speaker) / MANIFEST
                                   ).read_text())
            for unit in units:
                wanted[(speaker, unit)] = manifest[unit]
        skipped: list[dict] = []
        utts = self._decode(shard, wanted, skipped)
        for e in skipped:
            self._report(e, warn=False)  # the reader has warned
        decoded = {u.utterance_id: u for u in utts}
        lost_ids = {str(e["utterance_id"]): e for e in skipped}
        out = {}
        for (speaker, unit), m in wanted.items():
            good = [decoded[i] for i in m["ids"] if i in decoded]
            lost = [lost_ids[i] for i in m["ids"] if i in lost_ids]
            stat, sha = self._content_key(self._unit_files(shard, sorted(m["ids"])))
            blob = {"params_hash": self.params_hash, "text": todo[speaker][unit]["text"],
                    "source": {"stat": stat, "sha256": sha},
                    "utterance_ids": [u.utterance_id for u in good],
                    "transcripts": [u.transcript for u in good],
                    "features": [log_mel(u.audio, self.n_mels).to(torch.float16) for u in good],
                    "skipped": lost}
            buf = io.BytesIO()
            torch.save(blob, buf)
            self._save_bytes(self._part_path(shard, speaker, unit), buf.getbuffer())
            out[(speaker, unit)] = blob
            self.computed_parts += 1
        if self.progress and time.monotonic() - self._last_report > 5:
            print(f"features: {self.computed_parts} part(s) computed, last {shard.path}",
                  file=sys.stderr, flush=True)
            self._last_report = time.monotonic()
        return out

    @staticmethod
    def _decode(shard: Shard, wanted: dict[tuple[str, str], dict],
                skipped: list[dict]) -> list[Utterance]:
        """The wanted rows, decoded: a Parquet shard read once for all of them, an OpenSLR
        utterance from its own file (the manifest has its transcript)."""
        if shard.layout != "openslr":
            rows = sorted(r for m in wanted.values() for r in m["rows"])
            return read_shard(shard, decode=True, errors=skipped, rows=rows)
        out = []
        for (speaker, _), m in wanted.items():
            for row, uid, text in zip(m["rows"], m["ids"], m["texts"]):
                try:
                    audio = read_audio_file(openslr_audio(shard.path, uid))
                except ValueError as exc:
                    report_problem(skipped, uid, shard.path, str(exc))
                    continue
                out.append(Utterance(uid, speaker, shard.language, shard.split, text,
                                     len(audio) / SAMPLE_RATE, shard.path, row, audio))
        return out

    def _save_bytes(self, path: Path, data: bytes | memoryview) -> None:
        """Atomic write of one store file; a failure (full disk, read-only) names the file."""
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise UserError(f"data.feature_cache: cannot write {path}: "
                            f"{exc.strerror or exc}") from None

    def _report(self, entry: dict, warn: bool) -> None:
        uid = str(entry.get("utterance_id"))
        if uid in self._reported:
            return
        self._reported.add(uid)
        if warn:
            report_problem(self.errors, uid, str(entry.get("shard")), str(entry.get("reason")))
        else:
            self.errors.append(dict(entry))
        if self._loading is not None:  # a client's row: counted under that client
            self.errors[-1]["client"] = self._loading

    # -- examples ---------------------------------------------------------------------------------
    def _speaker_examples(self, shard: Shard, speaker: str, language: str) -> dict[str, Example]:
        """utterance id -> example for every usable row of ``speaker`` in ``shard``; ids of the
        unusable ones map to None."""
        entry = self.index(shard)["speakers"].get(speaker)
        out: dict[str, Any] = {}
        if entry is None:
            return out
        for unit, e in entry["units"].items():
            part = self._part(shard, speaker, unit, e)
            for uid, text, feats in zip(part["utterance_ids"], part["transcripts"],
                                        part["features"]):
                out[uid] = Example(feats, text, uid, speaker, language)
            for s in part["skipped"]:
                out[str(s["utterance_id"])] = None
        return out

    def shard_features(self, shard: Shard) -> dict[str, torch.Tensor]:
        """utterance id -> features for one whole shard (its missing parts computed in one read
        of the shard); not kept in memory."""
        idx = self.index(shard)
        parts, todo = {}, {}
        for spk, s in idx["speakers"].items():
            for unit, e in s["units"].items():
                part = self._part(shard, spk, unit, e, compute=False)
                if part is None:
                    todo.setdefault(spk, {})[unit] = e
                else:
                    parts[(spk, unit)] = part
        if todo:
            parts.update(self._compute(shard, todo))
        return {uid: f for _, p in sorted(parts.items())
                for uid, f in zip(p["utterance_ids"], p["features"])}

    def examples(self, utterances: Sequence[Utterance]) -> list[Example]:
        """Examples for ``utterances`` in their order; rows without features are skipped. Each
        speaker's parts are read once, one speaker at a time; only the asked examples are kept."""
        wanted: dict[tuple[str, str, str, str], set[str]] = {}
        for u in utterances:
            wanted.setdefault((u.shard, u.speaker, u.language, u.split), set()).add(
                u.utterance_id)
        found: dict[str, Any] = {}
        for (shard, speaker, language, split), ids in wanted.items():
            have = self._speaker_examples(Shard(shard, language, split), speaker, language)
            for uid in ids:
                found[uid] = have.get(uid, _ABSENT)
        out = []
        for u in utterances:
            ex = found[u.utterance_id]
            if ex is _ABSENT:
                self._report({"utterance_id": u.utterance_id, "shard": u.shard,
                              "reason": "no features in the store"}, warn=True)
            elif ex is not None:  # None: an unusable row, reported when its part was read
                out.append(Example(ex.features, u.transcript, ex.utterance_id, ex.speaker,
                                   ex.language))
        return out

    def split(self, split: str, languages: Sequence[str] | None = None,
              max_utterances: int = 0) -> list[Example]:
        """Examples of a whole split (e.g. ``public`` for pretraining, ``test`` for WER)."""
        from cluster_fl.data.mls import load_utterances

        return self.examples(load_utterances(self.root, languages, [split], max_utterances))

    def client(self, client: Client | IndexedClient) -> list[Example]:
        """Examples of one federated client: read from its parts now, held by nobody after.
        An indexed client's are its first ``cap`` utterances by id (unusable ones counted, as
        :func:`~cluster_fl.data.mls.partition_clients` counts them), usable ones kept."""
        if isinstance(client, Client):
            return self.examples(client.utterances)
        merged: dict[str, Any] = {}
        self._loading = client.client_id
        try:
            for path in client.shards:
                merged.update(self._speaker_examples(Shard(path, client.language, client.split),
                                                     client.speaker, client.language))
        finally:
            self._loading = None
        ids = sorted(merged)
        if client.cap:
            ids = ids[:client.cap]
        return [merged[i] for i in ids if merged[i] is not None]

    def release(self) -> None:
        """Nothing is held between calls (kept for callers that drop a shard after use)."""

    # -- the features job -------------------------------------------------------------------------
    def work(self, splits: Sequence[str], languages: Sequence[str],
             only: Mapping[str, set] | None = None) -> list[tuple[Shard, str]]:
        """The ``cluster-fl features`` work list: (shard, speaker or "" for a whole Parquet
        shard), in a stable order, so ``--part i/n`` takes every n-th item. ``only``: split ->
        the (language, speaker) keys to compute (a split not in it: every speaker)."""
        items: list[tuple[Shard, str]] = []
        for shard in find_shards(self.root, list(languages), list(splits)):
            keep = (only or {}).get(shard.split)
            if shard.layout == "openslr":
                items += [(shard, spk) for spk in sorted(self.index(shard)["speakers"])
                          if keep is None or (shard.language, spk) in keep]
            else:
                items.append((shard, ""))
        return items

    def build(self, shard: Shard, speaker: str = "", keep: set | None = None) -> int:
        """Compute what is missing of one work item (of a Parquet shard: of the speakers in
        ``keep``, all when None); returns the parts computed (0: all there)."""
        speakers = self.index(shard)["speakers"]
        todo: dict[str, dict] = {}
        names = [speaker] if speaker else [spk for spk in sorted(speakers)
                                           if keep is None or (shard.language, spk) in keep]
        for spk in names:
            for unit, e in speakers[spk]["units"].items():
                if self._part(shard, spk, unit, e, compute=False) is None:
                    todo.setdefault(spk, {})[unit] = e
        if not todo:
            return 0
        before = self.computed_parts
        self._compute(shard, todo)
        return self.computed_parts - before

    def missing(self, splits: Sequence[str], languages: Sequence[str],
                only: Mapping[str, set] | None = None) -> int:
        """Parts not in the store (existence only: a quick check for ``grid``; ``only`` as for
        :meth:`work`); -1 when the corpus is not readable here."""
        try:
            shards = find_shards(self.root, list(languages), list(splits))
        except UserError:
            return -1
        n = 0
        for shard in shards:
            idx_path = self.shard_dir(shard) / INDEX
            if not idx_path.exists():
                return max(n, 1)
            keep = (only or {}).get(shard.split)
            for spk, s in self.index(shard)["speakers"].items():
                if keep is None or (shard.language, spk) in keep:
                    n += sum(not self._part_path(shard, spk, u).exists() for u in s["units"])
        return n



def config_missing(data_cfg: Any) -> int:
    """The store parts a run of ``data_cfg`` reads that its store lacks (:meth:`FeatureStore.
    missing` over :func:`config_splits` and :func:`config_speakers`); -1 when the corpus is not
    readable here. What ``grid`` asks before it plans the features job, and pre-flight reports."""
    store = FeatureStore.from_config(data_cfg)
    try:
        return store.missing(config_splits(data_cfg), data_cfg.languages,
                             config_speakers(store, data_cfg))
    except UserError:
        return -1


def config_splits(data_cfg: Any) -> list[str]:
    """The splits a run of ``data_cfg`` reads: its clients' and its evaluation's."""
    return list(dict.fromkeys([data_cfg.client_split, data_cfg.eval_split]))


def config_speakers(store: FeatureStore, data_cfg: Any) -> dict[str, set]:
    """split -> the (language, speaker) keys a run of ``data_cfg`` trains on, when
    ``data.max_clients`` picks some (the paper's 316 of MLS's ~6,000 training speakers: the
    store then holds those, not 44,000 hours of English); {} when every speaker is a client."""
    if not data_cfg.max_clients or data_cfg.client_split == data_cfg.eval_split:
        return {}
    clients = store.clients(data_cfg.client_split, data_cfg.languages, data_cfg.max_clients)
    return {data_cfg.client_split: {(c.language, c.speaker) for c in clients}}


def build_features(data_cfg: Any, part: int = 0, parts: int = 1,
                   log: Any = None) -> dict[str, Any]:
    """``cluster-fl features``: compute what is missing of this part's share of the work list
    (every ``parts``-th item from ``part``) for the config's languages and splits. Returns
    counts: items, parts computed, parts already there (by difference), unusable rows."""
    store = FeatureStore.from_config(data_cfg)
    splits = config_splits(data_cfg)
    for split in splits:  # the asked split or language missing: say what the corpus has
        present = {s.language for s in find_shards(store.root, list(data_cfg.languages),
                                                   [split])}
        lacking = [lang for lang in data_cfg.languages if lang not in present]
        if lacking and not (present and data_cfg.allow_missing_languages):
            from cluster_fl.data.mls import describe_corpus

            raise UserError(f"data: the corpus at {store.root} has no {','.join(lacking)} in "
                            f"split {split!r}; {describe_corpus(store.root)}")
    only = config_speakers(store, data_cfg)
    work = store.work(splits, data_cfg.languages, only)
    mine = work[part::parts]
    computed = 0
    # a bar on a terminal, a plain line every 30 s in a job log (cluster_fl.progress)
    for shard, speaker in progress(mine, desc="features", unit="item", enabled=log is not None):
        computed += store.build(shard, speaker, only.get(shard.split))
    return {"store": str(store.cache_dir), "splits": splits, "items": len(mine),
            "of": len(work), "computed": computed, "unusable": len(store.errors),
            "missing": store.missing(splits, data_cfg.languages, only) if parts == 1 else None}
