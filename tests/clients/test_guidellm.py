"""guidellm (vLLM's benchmark client), unchanged, benchmarks the live server: `guidellm run` (0.8.1
has no `benchmark` command any more) from its own venv (tests/client_venv.sh guidellm, passed in
as BEAMLINE_GUIDELLM_PYTHON), a small synthetic load per request format, and its JSON report
must show every request completed, none errored, each with the output length it asked for.

guidellm streams with vLLM's `stream_options.continuous_usage_stats` and `ignore_eos` (its
fixed output lengths), and takes its synthetic prompts' lengths from the served model's own
tokenizer folder (no hub).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.clients.conftest import client_python, record_version
from tests.server_pool import PooledServer

pytestmark = [pytest.mark.clients, pytest.mark.default_model]

OUTPUT_TOKENS = 8
# (request format, load profile, requests): a constant rate that overlaps requests (they share
# engine steps) on guidellm's default format, one at a time on the other two.
LOADS = [
    ("/v1/chat/completions", "kind=constant,rate=4", 6),
    ("/v1/completions", "kind=synchronous", 3),
    ("/v1/responses", "kind=synchronous", 3),
]


def guidellm_version(python: str) -> str:
    probe = "from importlib.metadata import version; print(version('guidellm'))"
    return subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip()


# The bodies guidellm 0.8.1 sends (its successful requests' `request_args`), replayed when its
# requests fail: guidellm keeps neither the body nor the server's answer of a failed request.
TEXT = "1 0 m0 Finish medical want almost away until. Its culture song"
GUIDELLM_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}]}],
    },
    "/v1/completions": {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "prompt": TEXT,
    },
    "/v1/responses": {
        "stream": True,
        "max_output_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": TEXT}]}],
    },
}


def errored_summary(benchmark: dict[str, Any], served: PooledServer, request_format: str) -> str:
    """The errors guidellm saw, and the server's answer to the body guidellm sends."""
    lines = [
        f"{kind}: {r['info']['error']}"
        for kind in ("errored", "incomplete")
        for r in benchmark["requests"][kind]
    ]
    body = {"model": served.model, **GUIDELLM_BODIES[request_format]}
    answer = httpx.post(served.url + request_format, json=body, timeout=120)
    lines.append(
        f"the same body replayed: {json.dumps(body)}\n-> {answer.status_code} {answer.text[:2000]}"
    )
    return "\n".join(lines)


@pytest.mark.parametrize(
    ("request_format", "profile", "requests"), LOADS, ids=[x[0] for x in LOADS]
)
def test_guidellm_benchmark_completes_without_errors(
    request: pytest.FixtureRequest, tmp_path: Path, request_format: str, profile: str, requests: int
) -> None:
    python = client_python("guidellm")  # skips (fails under CI) before the server starts
    served: PooledServer = request.getfixturevalue("served")
    record_version("guidellm", guidellm_version(python))
    report = tmp_path / "benchmarks.json"
    cmd = [
        str(Path(python).parent / "guidellm"),
        "run",
        "--backend",
        f"kind=openai_http,target={served.url},model={served.model},"
        f"request_format={request_format}",
        "--profile",
        profile,
        "--constraint",
        f"kind=max_requests,count={requests}",
        "--tokenizer",
        f"kind=huggingface_auto,model={served.model_dir}",
        "--data",
        f"kind=synthetic_text,prompt_tokens=16,output_tokens={OUTPUT_TOKENS}",
        "--seed",
        "kind=static,value=7",
        "--output",
        f"kind=json,path={report}",
        "--disable-console-interactive",
    ]
    env = {"HF_HUB_OFFLINE": "1", "PATH": str(Path(python).parent), "HOME": str(tmp_path)}
    for attempt in range(2):  # guidellm's synchronous profile once stopped a request short of
        # its max_requests with none errored or incomplete (its own count: total 2 of 3); that
        # shortfall alone is run again, once
        start = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        took = time.monotonic() - start
        assert done.returncode == 0 and report.exists(), (
            f"guidellm exited {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )
        (benchmark,) = json.loads(report.read_text())["benchmarks"]
        totals = benchmark["metrics"]["request_totals"]
        if totals["total"] == requests or totals["errored"] or totals["incomplete"] or attempt:
            break
    print(f"guidellm {request_format} {profile}: {totals} in {took:.0f} s")
    if totals["errored"] or totals["incomplete"]:
        pytest.fail(errored_summary(benchmark, served, request_format), pytrace=False)
    assert totals["successful"] == requests, totals
    for r in benchmark["requests"]["successful"]:
        sent = json.loads(r["request_args"])["body"]
        assert sent["ignore_eos"] is True and sent["stream"] is True  # what guidellm sends
        if request_format != "/v1/responses":
            assert sent["stream_options"]["continuous_usage_stats"] is True
        # usage as guidellm read it: the fixed length it asked for, a prompt it could count
        assert r["output_metrics"]["text_tokens"] == OUTPUT_TOKENS, r["output_metrics"]
        assert r["input_metrics"]["text_tokens"] >= 16, r["input_metrics"]
        assert r["output"] and r["info"]["error"] is None
        assert r["info"]["timings"]["token_iterations"] >= 2  # streamed, not one final chunk
    output_tps = benchmark["metrics"]["output_tokens_per_second"]["successful"]["mean"]
    assert output_tps > 0
