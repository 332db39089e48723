"""The systems the translation benchmark runs on one workload, each returning a `Run`: the best
hypothesis' ids of every request, in workload order, and the wall time of the whole level.

- beamline: a launched server, `concurrency` clients in a closed loop, each source sent as token
  ids to `/v1/completions` (beam search in the request, `return_token_ids` for the comparison);
- CTranslate2: `Translator.translate_batch` on the converted model, static batches of
  `concurrency` sources (a library batches what one caller hands it: its best case at a level);
- `generate()`: transformers' own beam search, static batches of `concurrency` padded sources.

Every system decodes exactly `max_tokens` tokens per request (EOS forbidden before, as `min_tokens`
/ `min_decoding_length` / `min_new_tokens` say), so they all do the same work.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec

import httpx

P = ParamSpec("P")


@dataclass(frozen=True)
class Decode:
    """What every request asks for."""

    beams: int
    max_tokens: int


@dataclass
class Run:
    outputs: list[list[int]]
    wall_s: float
    latencies_s: list[float] = field(default_factory=list)

    def tokens_per_s(self) -> float:
        return sum(len(o) for o in self.outputs) / self.wall_s


def batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


async def _beamline_level(
    base_url: str, model: str, sources: Sequence[list[int]], decode: Decode, concurrency: int
) -> Run:
    outputs: list[list[int]] = [[] for _ in sources]
    latencies = [0.0] * len(sources)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(sources)):
        queue.put_nowait(index)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            index = queue.get_nowait()
            body = {
                "model": model,
                "prompt": sources[index],
                "num_beams": decode.beams,
                "max_tokens": decode.max_tokens,
                "min_tokens": decode.max_tokens,
                "temperature": 0,
                "return_token_ids": True,
            }
            sent = time.perf_counter()
            response = await client.post(f"{base_url}/v1/completions", json=body)
            latencies[index] = time.perf_counter() - sent
            response.raise_for_status()
            outputs[index] = list(response.json()["choices"][0]["token_ids"])

    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return Run(outputs, wall, latencies)


def run_beamline(
    base_url: str, model: str, sources: Sequence[list[int]], decode: Decode, concurrency: int
) -> Run:
    return asyncio.run(_beamline_level(base_url, model, sources, decode, concurrency))


def convert_for_ctranslate2(model_dir: Path, quantization: str) -> Path:
    """The model converted by CTranslate2's own converter (once, beside the model)."""
    import ctranslate2

    out = model_dir.parent / f"{model_dir.name}-ct2-{quantization}"
    if not (out / "model.bin").exists():
        converter = ctranslate2.converters.TransformersConverter(str(model_dir))
        converter.convert(str(out), quantization=quantization, force=True)
    return out


@dataclass(frozen=True)
class CT2Setting:
    """One configuration of CTranslate2: weights' compute type and how its threads are split
    (`inter` translators of `intra` threads each; a batch is split over them)."""

    compute_type: str
    inter: int
    intra: int

    @property
    def label(self) -> str:
        return f"ct2-{self.compute_type}-{self.inter}x{self.intra}"


def keeps_torch_threads(run: Callable[P, Run]) -> Callable[P, Run]:
    """`run` with this process's torch intra-op threads as they were afterwards: `generate()`
    sets them, and CTranslate2's translators set OpenMP's, which torch reads (a test runs the
    systems in its own process)."""

    @functools.wraps(run)
    def kept(*args: P.args, **kwargs: P.kwargs) -> Run:
        import torch

        before = torch.get_num_threads()
        try:
            return run(*args, **kwargs)
        finally:
            torch.set_num_threads(before)

    return kept


@keeps_torch_threads
def run_ctranslate2(
    model_dir: Path,
    tokenizer: Any,
    sources: Sequence[list[int]],
    decode: Decode,
    concurrency: int,
    setting: CT2Setting,
) -> Run:
    import ctranslate2

    converted = convert_for_ctranslate2(model_dir, setting.compute_type)
    translator = ctranslate2.Translator(
        str(converted),
        device="cpu",
        compute_type=setting.compute_type,
        inter_threads=setting.inter,
        intra_threads=setting.intra,
    )
    vocab = tokenizer.convert_ids_to_tokens
    texts = [vocab(source) for source in sources]
    options = dict(
        beam_size=decode.beams,
        max_decoding_length=decode.max_tokens,
        min_decoding_length=decode.max_tokens,
        max_batch_size=max(1, -(-concurrency // setting.inter)),  # one part per translator
    )
    translator.translate_batch(texts[:1], **options)  # warm-up, not measured
    outputs: list[list[int]] = []
    latencies: list[float] = []
    start = time.perf_counter()
    for part in batches(texts, concurrency):
        sent = time.perf_counter()
        results = translator.translate_batch(list(part), **options)
        latencies += [time.perf_counter() - sent] * len(part)
        outputs += [tokenizer.convert_tokens_to_ids(r.hypotheses[0]) for r in results]
    return Run(outputs, time.perf_counter() - start, latencies)


@keeps_torch_threads
def run_generate(
    model_dir: Path, sources: Sequence[list[int]], decode: Decode, concurrency: int, threads: int
) -> Run:
    """transformers' `generate()` over static batches of `concurrency` sources, right-padded
    (an encoder's padding is masked; the decoder starts together)."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    torch.set_num_threads(threads)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id
    options = dict(
        num_beams=decode.beams,
        do_sample=False,
        max_new_tokens=decode.max_tokens,
        min_new_tokens=decode.max_tokens,
    )

    def generate(part: Sequence[list[int]]) -> list[list[int]]:
        longest = max(len(s) for s in part)
        ids = torch.tensor([s + [pad] * (longest - len(s)) for s in part])
        mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in part])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, **options)
        return [row[1:].tolist() for row in out]  # the decoder's start taken off

    generate(sources[:1])  # warm-up
    outputs: list[list[int]] = []
    latencies: list[float] = []
    start = time.perf_counter()
    for part in batches(sources, concurrency):
        sent = time.perf_counter()
        outputs += generate(part)
        latencies += [time.perf_counter() - sent] * len(part)
    return Run(outputs, time.perf_counter() - start, latencies)
