"""Closed vocabularies for the synthetic corpus, the sentence sampler and text normalisation.

Each of the 8 MLS languages gets ~50 frequent words plus the number words zero..ten, all
lowercase and written the way eSpeak NG reads them. A spike found 50 words + numbers learnable by
a tiny speech-LLM on CPU while 200 words were not, so the lists stay small on purpose.

Words were chosen so that no two words of one language sound the same to eSpeak (``to``/``two``,
``sept``/``cette``, ``et``/``est`` are left out); ``tests/data`` checks this with eSpeak's own
phonemiser. Single-consonant words (Polish ``w``, ``z``) are left out because eSpeak reads them as
letter names when isolated.

:func:`normalize_text` is the one normalisation used both when transcripts are written and when
WER references/hypotheses are compared, so the two can never drift apart.
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np

LANGUAGES: tuple[str, ...] = ("en", "de", "nl", "fr", "es", "it", "pt", "pl")

NUMBERS: dict[str, tuple[str, ...]] = {
    "en": ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
           "ten"),
    "de": ("null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun",
           "zehn"),
    "nl": ("nul", "één", "twee", "drie", "vier", "vijf", "zes", "zeven", "acht", "negen",
           "tien"),
    "fr": ("zéro", "un", "deux", "trois", "quatre", "cinq", "six", "sept", "huit", "neuf",
           "dix"),
    "es": ("cero", "uno", "dos", "tres", "cuatro", "cinco", "seis", "siete", "ocho", "nueve",
           "diez"),
    "it": ("zero", "uno", "due", "tre", "quattro", "cinque", "sei", "sette", "otto", "nove",
           "dieci"),
    "pt": ("zero", "um", "dois", "três", "quatro", "cinco", "seis", "sete", "oito", "nove",
           "dez"),
    "pl": ("zero", "jeden", "dwa", "trzy", "cztery", "pięć", "sześć", "siedem", "osiem",
           "dziewięć", "dziesięć"),
}

# Frequent words; homophones of each other or of a number word are excluded (see module doc).
WORDS: dict[str, tuple[str, ...]] = {
    "en": tuple("""the a and of in is it you that he was on are with as they be at this have
        from or not but what all were we when your can said there use an so some her would
        make like him time has look more day go good water long little""".split()),
    "de": tuple("""der die das und in von mit sich auf für ist nicht ein eine als auch es an er
        so sie nach wird bei einer um am sind noch wie über einen zum haben nur oder aber vor
        bis mehr durch man sein wurde sehr heute gut haus wasser tag zeit jahr kind""".split()),
    "nl": tuple("""de het en van in is dat op te zijn niet met die voor hij ik je er maar om aan
        ook als bij of uit nog naar wel dan wat kan zo was heeft geen meer tot deze moet veel
        goed huis water dag tijd jaar kind man vrouw groot klein""".split()),
    "fr": tuple("""le la les de et en une du des il elle nous vous je tu on ne pas plus pour
        dans sur par qui que mais avec tout bien très aussi comme maison eau jour temps homme
        femme enfant petit grand bon chat chien livre ville monde rouge vert noir blanc soleil
        mer pain""".split()),
    "es": tuple("""el la los las de que y en un una por con no se para es lo como más pero sus
        le ya o este si porque esta entre cuando muy sin sobre también me hasta donde casa agua
        día tiempo hombre mujer niño grande pequeño bueno perro gato libro ciudad mundo rojo
        verde noche sol""".split()),
    "it": tuple("""il la di che e un una per in non con mi si lo le ma come ci io tu questo
        bene molto anche qui sono quando tutto casa acqua giorno tempo uomo donna bambino grande
        piccolo buono cane gatto libro città mondo rosso verde notte sole mare pane sempre mai
        oggi domani""".split()),
    "pt": tuple("""o a os as de que e do da em uma para com não por se na no mas como muito bem
        também quando eu ele ela nós você casa água dia tempo homem mulher menino grande
        pequeno bom cão gato livro cidade mundo vermelho verde noite sol mar pão sempre nunca
        hoje amanhã""".split()),
    "pl": tuple("""i na nie się do to że jest o jak ale co tak po od za tylko już jego ja ty on
        ona my wy dom woda dzień czas człowiek kobieta dziecko duży mały dobry pies kot książka
        miasto świat czerwony zielony noc słońce chleb zawsze nigdy dzisiaj jutro bardzo""".split()),
}

MIN_WORDS, MAX_WORDS = 3, 8
NUMBER_SHARE = 0.2
"""Probability that a sampled word is a number word (numbers are few but useful to learn)."""


def vocabulary(language: str) -> tuple[str, ...]:
    """All words of ``language`` (frequent words then number words), without duplicates."""
    if language not in WORDS:
        raise ValueError(f"no vocabulary for language {language!r}; have {', '.join(LANGUAGES)}")
    return tuple(dict.fromkeys(WORDS[language] + NUMBERS[language]))


_KEEP = re.compile(r"[^\w\s']", flags=re.UNICODE)
_SPACES = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """Lowercase, NFC, punctuation removed (apostrophes inside words kept), single spaces.

    Used for transcripts when writing the corpus and for WER references and hypotheses.
    """
    text = unicodedata.normalize("NFC", text).lower()
    text = _KEEP.sub(" ", text.replace("_", " "))
    # An apostrophe only belongs to a word when it sits between letters (MLS "don't", "l'eau").
    text = re.sub(r"(?<!\w)'|'(?!\w)", " ", text)
    return _SPACES.sub(" ", text).strip()


def sample_sentence(language: str, rng: np.random.Generator) -> str:
    """One sentence of 3-8 words from the closed vocabulary, drawn with ``rng``."""
    words, numbers = WORDS[language], NUMBERS[language]
    n = int(rng.integers(MIN_WORDS, MAX_WORDS + 1))
    out = []
    for _ in range(n):
        pool = numbers if rng.random() < NUMBER_SHARE else words
        out.append(pool[int(rng.integers(len(pool)))])
    return " ".join(out)


def sample_sentences(language: str, count: int, seed: int) -> list[str]:
    """``count`` sentences for ``language``, a pure function of (language, count, seed)."""
    rng = np.random.default_rng([seed, LANGUAGES.index(language) if language in LANGUAGES
                                 else 99, 7])
    return [sample_sentence(language, rng) for _ in range(count)]
