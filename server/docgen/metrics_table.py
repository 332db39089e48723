"""The metrics page: every series `GET /metrics` serves, read from a live `Metrics` registry."""

from __future__ import annotations

from decoding.params import STRATEGIES
from server.docgen.annotations import md_text
from server.metrics import FAILURE_REASONS, FINISHED_REASONS, UNKNOWN_STRATEGY, Metrics

_EXPOSED_SUFFIX = {"counter": "_total", "histogram": "", "gauge": "", "info": "_info"}


def metric_families() -> list[tuple[str, str, list[str], str]]:
    """(exposed name, type, labels, help) of every family, in registration order."""
    metrics = Metrics("model")
    metrics.set_cache_config(block_size=16, num_blocks=1, prefix_caching=True)  # its labels
    metrics.set_lora_state(max_lora=1, running=[], waiting=[])  # served with LoRA adapters only
    metrics.record_lora_request("adapter")
    found = []
    for family in metrics.registry.collect():
        labels = sorted({k for s in family.samples for k in s.labels} - {"le"})
        name = family.name + _EXPOSED_SUFFIX.get(family.type, "")
        found.append((name, family.type, labels, family.documentation))
    return found


def render_metrics() -> str:
    lines = ["| metric | type | labels | what |", "|---|---|---|---|"]
    for name, kind, labels, text in metric_families():
        shown = ", ".join(f"`{label}`" for label in labels) or "-"
        lines.append(f"| `{name}` | {kind} | {shown} | {md_text(text)} |")
    values = (
        ("strategy", (*STRATEGIES, UNKNOWN_STRATEGY)),
        ("finished_reason", FINISHED_REASONS),
        ("reason", FAILURE_REASONS),
    )
    lines += ["", "Label values (closed sets, every combination exported at 0 from the start):", ""]
    lines += [f"- `{label}`: {', '.join(f'`{v}`' for v in vals)}" for label, vals in values]
    return "\n".join(lines)
