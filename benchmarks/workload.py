"""Benchmark workloads: the same list of (prompt, output length) pairs is sent to every system.

Prompt lengths are counted in words, not tokens, so one workload fits any tokenizer and any server.
Everything is derived from a seed, so two runs (and two systems in one run) see identical requests.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

BUNDLED_PROMPTS = Path(__file__).with_name("prompts.jsonl")
PASSAGES = Path(__file__).with_name("accuracy_text.txt")  # paragraphs of plain English prose

# Common English words: synthetic prompts read like (odd) text, which keeps tokenization realistic.
_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which "
    "but have an had they you were their one all we can her has there been if more when will would "
    "who so no time people year way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot right "
    "study book eye job word business issue side kind head house service friend father power hour "
    "game line end member law car city community name president team minute idea kid body "
    "information back parent face others level office door health person art war history party "
    "result change morning reason research girl guy moment air teacher force education river "
    "mountain light music garden window energy market picture science table paper village summer "
    "winter machine question answer small large early young important few public bad same able "
    "good new first last long great little own other old big high different local sure quick "
    "bright quiet strange careful simple open green dark warm cold clear make go know take see "
    "come think look want give use find tell ask seem feel try leave call keep build write read"
).split()


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. `max_tokens` is the exact output length when EOS is ignored."""

    index: int
    prompt: str
    max_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[BenchRequest, ...]
    seed: int
    output_tokens: tuple[int, int]
    prompt_words: tuple[int, int] | None = None
    shared_prefix_words: int = 0  # words of the system prompt every request starts with
    chat: bool = False  # prompts are user messages (POST /v1/chat/completions)

    def describe(self) -> dict:
        words = [len(r.prompt.split()) for r in self.requests]
        outs = [r.max_tokens for r in self.requests]
        return {
            "name": self.name,
            "num_requests": len(self.requests),
            "seed": self.seed,
            "prompt_words_range": list(self.prompt_words) if self.prompt_words else None,
            "shared_prefix_words": self.shared_prefix_words,
            "output_tokens_range": list(self.output_tokens),
            "prompt_words_total": sum(words),
            "output_tokens_total": sum(outs),
            "output_tokens_mean": sum(outs) / len(outs) if outs else 0.0,
            "chat": self.chat,
        }


def _output_lengths(rng: random.Random, n: int, output_tokens: tuple[int, int]) -> list[int]:
    lo, hi = output_tokens
    return [rng.randint(lo, hi) for _ in range(n)]


def synthetic_workload(
    num_requests: int = 48,
    prompt_words: tuple[int, int] = (8, 48),
    output_tokens: tuple[int, int] = (32, 128),
    seed: int = 0,
) -> Workload:
    """Seeded random prompts of `prompt_words` words, uniform output lengths (design notes §3)."""
    _check_range("prompt_words", prompt_words)
    _check_range("output_tokens", output_tokens)
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_requests):
        words = rng.choices(_WORDS, k=rng.randint(*prompt_words))
        words[0] = words[0].capitalize()
        prompts.append(" ".join(words))
    outs = _output_lengths(rng, num_requests, output_tokens)
    requests = tuple(BenchRequest(i, p, o) for i, (p, o) in enumerate(zip(prompts, outs)))
    return Workload("synthetic", requests, seed, output_tokens, prompt_words)


def with_shared_prefix(workload: Workload, words: int, seed: int = 0) -> Workload:
    """Every prompt preceded by the same seeded `words`-word "system prompt" (a blank line between),
    as when all clients of a service share one: the case prefix caching is for. Prompt word counts
    in `describe()` include it."""
    if words < 0:
        raise ValueError(f"shared prefix words must be >= 0, got {words}")
    if words == 0:
        return workload
    rng = random.Random(f"shared-prefix-{seed}")  # independent of the prompts' own random stream
    system = rng.choices(_WORDS, k=words)
    system[0] = system[0].capitalize()
    prefix = " ".join(system) + ".\n\n"
    requests = tuple(replace(r, prompt=prefix + r.prompt) for r in workload.requests)
    return replace(workload, requests=requests, shared_prefix_words=words)


def load_prompts(path: Path = BUNDLED_PROMPTS) -> list[str]:
    """Prompts from a JSON-lines file with one `{"prompt": "..."}` object per line."""
    prompts = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompts.append(str(json.loads(line)["prompt"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{path}:{lineno}: expected a JSON object with a 'prompt' field"
            ) from exc
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts


def prompts_workload(
    num_requests: int = 48,
    output_tokens: tuple[int, int] = (32, 128),
    seed: int = 0,
    path: Path = BUNDLED_PROMPTS,
) -> Workload:
    """The bundled (or a given) prompt set, shuffled with `seed`, cycled for more requests."""
    _check_range("output_tokens", output_tokens)
    rng = random.Random(seed)
    prompts = load_prompts(path)
    rng.shuffle(prompts)
    chosen = [prompts[i % len(prompts)] for i in range(num_requests)]
    outs = _output_lengths(rng, num_requests, output_tokens)
    requests = tuple(BenchRequest(i, p, o) for i, (p, o) in enumerate(zip(chosen, outs)))
    return Workload(path.stem, requests, seed, output_tokens)


GROUNDED_TASKS = (
    "Repeat the following text exactly, word for word.\n\n{passage}",
    'Rewrite the following text with every "{old}" replaced by "{new}". Change nothing '
    "else.\n\n{passage}",
    "Copy the following text, then continue it with one more paragraph.\n\n{passage}",
)
_SWAPS = (("the", "a"), ("and", "or"), ("of", "from"), ("is", "was"))


def grounded_workload(
    num_requests: int = 48,
    output_tokens: tuple[int, int] = (32, 128),
    seed: int = 0,
    path: Path = PASSAGES,
) -> Workload:
    """Input-grounded chat requests: each carries a passage (a paragraph of `path`) and asks to
    repeat it, edit it (replace a word) or copy and continue it, as summarisation and
    code-editing traffic quote their input. Most of each answer is in its prompt: the workload
    n-gram speculation is for."""
    _check_range("output_tokens", output_tokens)
    rng = random.Random(seed)
    paragraphs = [
        " ".join(p.split()) for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()
    ]
    prompts = []
    for i in range(num_requests):
        old, new = rng.choice(_SWAPS)
        task = GROUNDED_TASKS[i % len(GROUNDED_TASKS)]
        prompts.append(task.format(passage=rng.choice(paragraphs), old=old, new=new))
    outs = _output_lengths(rng, num_requests, output_tokens)
    requests = tuple(BenchRequest(i, p, o) for i, (p, o) in enumerate(zip(prompts, outs)))
    return Workload("grounded", requests, seed, output_tokens, chat=True)


def _check_range(name: str, value: tuple[int, int]) -> None:
    lo, hi = value
    if lo < 1 or hi < lo:
        raise ValueError(f"{name} must be 1 <= min <= max, got {lo},{hi}")
