"""The front-end cost benchmark's requests: prompts of the random model's own words, and the short
unmeasured warm-up requests before each mode."""

from __future__ import annotations

import random
from collections.abc import Sequence

from benchmarks.random_models import word_of
from benchmarks.workload import BenchRequest

FIRST_WORD_ID = 4 + 256  # random_models.word_tokenizer: 4 specials, 256 bytes, then words


def vocab_workload(
    num_requests: int,
    max_tokens: int,
    prompt_words: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    salt: str = "",
) -> list[BenchRequest]:
    """Prompts of words of the random model's own vocabulary (one token each): English words
    would all encode as <unk>, and prompts of <unk> share their prefixes in the prefix cache.
    Lengths depend on `seed` only, words on `salt` too, so every mode runs the same amount of
    work without hitting the cache blocks a previous mode left behind."""
    lengths = random.Random(seed)
    words = random.Random(f"{seed}-{salt}")
    requests = []
    for i in range(num_requests):
        n = lengths.randint(*prompt_words)
        ids = [words.randrange(FIRST_WORD_ID, vocab_size) for _ in range(n)]
        requests.append(BenchRequest(i, " ".join(word_of(t) for t in ids), max_tokens))
    return requests


def warm_up_requests(requests: Sequence[BenchRequest], concurrency: int) -> list[BenchRequest]:
    """A few short requests first, unmeasured: first-call costs stay out of the run."""
    return [BenchRequest(r.index, r.prompt, 4) for r in requests[: min(concurrency, 8)]]
