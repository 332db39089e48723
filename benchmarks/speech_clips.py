"""Speech for the Whisper benchmark and tests: English sentences spoken by espeak-ng (Debian's
package) at 150 words a minute (its default rate is hard for tiny.en), clips of several sentences,
and the word error rate as Whisper's results are reported (its English normalizer on both sides)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import jiwer
from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "A large language model serves many clients at once on a single machine.",
    "The weather today is sunny with a light breeze from the west.",
    "We will meet at the train station at nine in the morning.",
    "My brother bought a new car last week and drove it to the city.",
    "The children played in the garden until it was time for dinner.",
    "Please send me the report before the end of the day.",
    "The library opens at ten and closes at six on weekdays.",
    "He poured a cup of coffee and read the morning paper.",
    "The doctor told her to drink more water and rest.",
    "They walked along the river and talked about their plans.",
    "The meeting has been moved to Thursday afternoon.",
    "I left my keys on the kitchen table this morning.",
    "The train was late because of the heavy snow.",
    "She opened the window to let in some fresh air.",
]
NORMALIZE = EnglishTextNormalizer({})  # numbers as digits, punctuation and case dropped


class EspeakMissing(RuntimeError):
    """espeak-ng is not installed (apt-get install espeak-ng)."""


def espeak_wav(text: str, words_per_minute: int = 150, voice: str = "en-us") -> bytes:
    """`text` spoken by espeak-ng in `voice`, as a wav file."""
    if shutil.which("espeak-ng") is None:
        raise EspeakMissing("espeak-ng is missing (apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "speech.wav")
        command = ["espeak-ng", "-v", voice, "-s", str(words_per_minute), "-w", path, text]
        subprocess.run(command, check=True)
        with open(path, "rb") as f:
            return f.read()


def clip_texts(count: int) -> list[str]:
    """`count` texts of 1 to 7 consecutive sentences (5 to 30 seconds spoken), each starting three
    sentences after the last one's start."""
    texts = []
    for k in range(count):
        first, many = (3 * k) % len(SENTENCES), 1 + k % 7
        texts.append(" ".join(SENTENCES[(first + i) % len(SENTENCES)] for i in range(many)))
    return texts


def word_error_rate(hypotheses: list[str], references: list[str]) -> float:
    return float(
        jiwer.wer([NORMALIZE(r) for r in references], [NORMALIZE(h) or "-" for h in hypotheses])
    )
