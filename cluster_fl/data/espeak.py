"""eSpeak NG text-to-speech through ctypes, on the library bundled by PyPI's ``espeakng-loader``.

No root, no apt: the shared library and its data folder ship inside the wheel. We drive it in
``AUDIO_OUTPUT_SYNCHRONOUS`` mode with a synth callback that appends the int16 chunks, which takes
a few milliseconds per short sentence. eSpeak renders at 22050 Hz; :func:`synthesize` returns
16 kHz float32 in [-1, 1] (polyphase resampling, 320/441).

eSpeak keeps global state (one voice, one callback per process) and is not thread-safe: use one
:class:`Synthesizer` per process (``corpus.py`` renders in worker processes). Its output jitters
between calls: it seeds its random generator from the clock at start-up (``synthesize(seed=)``
sets it), and an utterance also depends on what the process rendered before, which no call
resets; so ``corpus.py`` seeds every utterance and renders each shard in a fresh process.

Voices are named ``LANG+VARIANT`` (``fr+m3``); the region form ``fr-fr+m3`` is refused by this
build, so only the bare language code is used.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from scipy.signal import resample_poly

from cluster_fl.errors import UserError

ESPEAK_RATE_HZ = 22050
TARGET_RATE_HZ = 16000
AUDIO_OUTPUT_SYNCHRONOUS = 2
POS_CHARACTER = 1
CHARS_UTF8 = 1
# espeak_PARAMETER enum values (speak_lib.h)
PARAM_RATE, PARAM_VOLUME, PARAM_PITCH, PARAM_RANGE, PARAM_WORDGAP = 1, 2, 3, 4, 7

# Variants excluded from speaker sampling: names eSpeak cannot take after '+' (spaces), and
# ones that replace the language of the voice (a variant file with its own ``language`` line
# would make e.g. fr+Storm speak English phonology).
_EXCLUDED_VARIANTS = frozenset({"Mr serious", "Storm"})

_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int,
                             ctypes.c_void_p)


@dataclass(frozen=True)
class VoiceParams:
    """One synthetic speaker's voice: a variant plus prosody settings (eSpeak units)."""

    variant: str
    """Name of a file in ``espeak-ng-data/voices/!v`` (e.g. ``m3``)."""
    pitch: int = 50
    """Base pitch, 0-100."""
    pitch_range: int = 50
    """Pitch range, 0-100 (0 = monotone)."""
    rate: int = 175
    """Speaking rate in words per minute, 80-450."""
    word_gap: int = 0
    """Extra pause between words, in units of 10 ms."""
    volume: int = 100
    """Amplitude, 0-200."""


def library_paths() -> tuple[str, str]:
    """(shared library path, data folder path) of the bundled eSpeak NG."""
    try:
        import espeakng_loader
    except ImportError as exc:  # pragma: no cover - dependency of the package
        raise UserError("the synthetic corpus needs the PyPI package 'espeakng-loader'") from exc
    return espeakng_loader.get_library_path(), espeakng_loader.get_data_path()


@lru_cache(maxsize=1)
def list_variants() -> tuple[str, ...]:
    """The usable voice variants, sorted (stable across machines with the same wheel)."""
    _, data = library_paths()
    folder = Path(data) / "voices" / "!v"
    names = [p.name for p in folder.iterdir() if p.is_file()]
    return tuple(sorted(n for n in names if n not in _EXCLUDED_VARIANTS and " " not in n))


class Synthesizer:
    """Process-wide handle on the eSpeak NG library; renders text to 16 kHz float32 audio."""

    _instance: "Synthesizer | None" = None
    _pid: int | None = None

    def __init__(self) -> None:
        lib_path, data_path = library_paths()
        self._lib = ctypes.CDLL(lib_path)
        self._lib.espeak_Initialize.restype = ctypes.c_int
        self._lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p,
                                                ctypes.c_int]
        rate = self._lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, data_path.encode(), 0)
        if rate != ESPEAK_RATE_HZ:
            raise UserError(f"eSpeak NG failed to initialise (returned {rate}; data {data_path})")
        self._chunks: list[np.ndarray] = []
        # Keep a reference to the callback: ctypes would otherwise free it while C holds it.
        self._callback = _CALLBACK(self._on_audio)
        self._lib.espeak_SetSynthCallback(self._callback)
        self._lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self._lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        self._lib.espeak_ng_SetRandSeed.restype = None
        self._lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint,
                                           ctypes.c_int, ctypes.c_uint, ctypes.c_uint,
                                           ctypes.c_void_p, ctypes.c_void_p]
        self._voice: tuple[str, VoiceParams] | None = None

    @classmethod
    def get(cls) -> "Synthesizer":
        """The synthesizer of this process (created on first use, re-created after fork)."""
        if cls._instance is None or cls._pid != os.getpid():
            cls._instance, cls._pid = cls(), os.getpid()
        return cls._instance

    def _on_audio(self, wav, n, events) -> int:  # noqa: ANN001 - ctypes signature
        if n > 0 and wav:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0  # 0 = continue synthesis

    def set_voice(self, language: str, voice: VoiceParams) -> None:
        """Select ``language+variant`` and apply the prosody parameters."""
        if self._voice == (language, voice):
            return
        name = f"{language}+{voice.variant}".encode()
        if self._lib.espeak_SetVoiceByName(name) != 0:
            raise UserError(f"eSpeak NG refused voice {name.decode()!r}")
        for param, value in ((PARAM_RATE, voice.rate), (PARAM_PITCH, voice.pitch),
                             (PARAM_RANGE, voice.pitch_range), (PARAM_WORDGAP, voice.word_gap),
                             (PARAM_VOLUME, voice.volume)):
            self._lib.espeak_SetParameter(param, int(value), 0)
        self._voice = (language, voice)

    def render_22k(self, text: str, seed: int | None = None) -> np.ndarray:
        """Synthesize ``text`` with the current voice: int16 samples at 22050 Hz. ``seed`` sets
        eSpeak's random generator first (else it runs on from its clock-seeded state)."""
        self._chunks = []
        if seed is not None:
            self._lib.espeak_ng_SetRandSeed(seed)
        data = text.encode("utf-8") + b"\0"
        status = self._lib.espeak_Synth(data, len(data), 0, POS_CHARACTER, 0, CHARS_UTF8,
                                        None, None)
        if status != 0:
            raise UserError(f"eSpeak NG synthesis failed (status {status}) for {text!r}")
        self._lib.espeak_Synchronize()
        if not self._chunks:
            return np.zeros(0, dtype=np.int16)
        return np.concatenate(self._chunks).astype(np.int16, copy=False)


@lru_cache(maxsize=1)
def _resample_filter() -> np.ndarray:
    """scipy's default anti-aliasing filter for 320/441, built once (it costs more than the
    filtering itself when rebuilt every call)."""
    from scipy.signal import firwin

    return firwin(2 * 10 * 441 + 1, 1.0 / 441, window=("kaiser", 5.0)) * 320


def to_16k(samples: np.ndarray) -> np.ndarray:
    """int16 at 22050 Hz -> float32 in [-1, 1] at 16 kHz (polyphase, 22050·320/441 = 16000)."""
    x = samples.astype(np.float32) / 32768.0
    if x.size == 0:
        return x
    y = resample_poly(x, 320, 441, window=_resample_filter()).astype(np.float32)
    return np.clip(y, -1.0, 1.0)


def synthesize(text: str, language: str, voice: VoiceParams, seed: int | None = None
               ) -> np.ndarray:
    """Render ``text`` in ``language`` with ``voice``: float32 mono at 16 kHz.

    The same samples again only with a ``seed`` and in a process that has rendered the same
    utterances before it (module docstring); otherwise write the result once and reuse it.
    """
    synth = Synthesizer.get()
    synth.set_voice(language, voice)
    return to_16k(synth.render_22k(text, seed))


def phonemes(text: str, language: str) -> str:
    """eSpeak's phoneme string for ``text`` (used to check a vocabulary has no homophones)."""
    synth = Synthesizer.get()
    synth.set_voice(language, VoiceParams(variant="m1"))
    lib = synth._lib
    lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
    lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int,
                                          ctypes.c_int]
    buf = ctypes.c_char_p(text.encode("utf-8"))
    ptr = ctypes.pointer(buf)
    parts = []
    while buf.value:  # eSpeak advances the pointer clause by clause until it reaches NULL
        out = lib.espeak_TextToPhonemes(ptr, CHARS_UTF8, 0)
        if out is None:
            break
        parts.append(out.decode("utf-8", "replace"))
    return " ".join(parts).strip()
