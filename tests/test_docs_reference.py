"""The documentation's reference pages against the code (server/docgen): every generated block is
current, and every request field, configuration key, environment variable, CLI flag, metric and
route that exists in the code appears in the docs, each with what it does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from server.config import ENV_PREFIX, ServerConfig
from server.docgen import blocks, field_notes, metrics_table, request_fields, routes, settings

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def page(name: str) -> str:
    return (DOCS / "reference" / name).read_text()


def test_every_generated_block_is_current() -> None:
    stale = blocks.stale_pages(write=False)
    names = [str(p.relative_to(ROOT)) for p in stale]
    assert not stale, f"stale: {names}; run python -m server.docgen"


def test_every_block_has_one_place_in_the_docs() -> None:
    text = {p: p.read_text() for p in DOCS.rglob("*.md")}
    for block in blocks.blocks():
        holders = [p for p, t in text.items() if block.start in t]
        assert len(holders) == 1, (block.name, holders)
        assert text[holders[0]].count(block.start) == 1 == text[holders[0]].count(block.end)


def test_a_stale_block_is_found_and_rewritten(tmp_path: Path) -> None:
    rendered = {b.name: b.render() for b in blocks.blocks()}
    metrics = next(b for b in blocks.blocks() if b.name == "metrics")
    stale = f"intro\n{metrics.start}\n| old table |\n{metrics.end}\noutro\n"
    fresh = blocks.refresh(stale, rendered)
    assert fresh == f"intro\n{metrics.start}\n{rendered['metrics']}\n{metrics.end}\noutro\n"
    assert blocks.refresh(fresh, rendered) == fresh


def cells(text: str) -> set[str]:
    """Every `code span` that starts a table row: the names a reference table documents."""
    return set(re.findall(r"^\| `([^`]+)`", text, re.M))


@pytest.mark.parametrize("endpoint", sorted(request_fields.ENDPOINTS))
def test_every_request_field_is_documented_with_what_it_does(endpoint: str) -> None:
    model = request_fields.ENDPOINTS[endpoint]
    documented = cells(page("request-fields.md"))
    for name in request_fields.field_names(model):
        assert name in documented, f"{endpoint}: {name} is missing from request-fields.md"
        assert request_fields.note(name, endpoint), f"{endpoint}: {name} has no note"


def test_every_field_of_every_body_part_is_documented() -> None:
    text = page("request-fields.md")
    for part in request_fields.body_parts():
        section = text.split(f"### `{part.__name__}`", 1)
        assert len(section) == 2, f"{part.__name__} has no table"
        table = section[1].split("###", 1)[0]
        for name in request_fields.field_names(part):
            assert f"| `{name}` |" in table, (part.__name__, name)


def test_every_note_is_about_a_field_that_exists() -> None:
    for key in field_notes.NOTES:
        endpoint, _, name = key.rpartition(":")
        every = request_fields.ENDPOINTS
        models = [every[endpoint]] if endpoint else list(every.values())
        assert any(name in request_fields.field_names(m) for m in models), key


def test_every_config_key_env_var_and_flag_is_documented() -> None:
    text = page("configuration.md")
    flags = settings.flags_by_key(settings.cli_parser())
    for key, info in ServerConfig.model_fields.items():
        assert f"| `{key}` |" in text, key
        assert f"`{ENV_PREFIX}{key.upper()}`" in text, key
        assert info.description, f"{key} has no description"
        for flag in flags.get(key, []):
            assert f"`{flag}`" in text, flag


def test_every_cli_flag_of_every_command_is_documented() -> None:
    text = page("cli.md")
    parser = settings.cli_parser()
    assert settings.commands(parser), "no subcommands found"
    for path, sub in settings.commands(parser):
        assert f"### `{path}`" in text, path
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in text, f"{path} {option}"


def test_every_metric_is_documented() -> None:
    text = page("metrics.md")
    families = metrics_table.metric_families()
    assert len(families) >= 20
    for name, _kind, labels, _help in families:
        assert f"| `{name}` |" in text, name
        assert all(f"`{label}`" in text for label in labels), name


def test_every_route_is_documented_and_no_other() -> None:
    served = routes.app_routes()
    assert set(served) == set(routes.ROUTES), "routes.ROUTES must list exactly the app's routes"
    text = page("routes.md")
    for method, path in served:
        assert f"| {method} | `{path}` |" in text, (method, path)
    assert "not documented" not in text


def test_the_cli_parser_is_the_one_beamline_runs() -> None:
    parser = settings.cli_parser()
    assert parser.prog == "beamline"
    args = parser.parse_args(["serve", "--max-num-seqs", "3"])
    assert args.max_num_seqs == 3


def test_the_published_index_names_the_gpu_a_result_ran_on() -> None:
    """GPU figures differ by card (an H100's memory bandwidth is not an H200's): a result whose
    machine records a GPU shows it beside the host CPU; a CPU run shows the CPU alone."""
    from server.docgen.published import _host

    assert _host({"machine": {"cpu": "Xeon", "gpu": "NVIDIA H100"}}) == "Xeon, GPU: NVIDIA H100"
    assert _host({"machine": {"cpu": "Xeon", "gpu": None}}) == "Xeon"
    assert _host({}) == "not recorded"
