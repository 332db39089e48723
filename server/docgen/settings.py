"""The configuration and command-line pages: every `ServerConfig` key, and every flag of the real
`beamline` argument parser (server/cli.py builds it from `ServerConfig`, so new keys, flags and
groups appear here on the next `python -m server.docgen`)."""

from __future__ import annotations

import argparse
from typing import Any
from unittest import mock

from server import cli
from server.config import ENV_PREFIX, ServerConfig
from server.config_groups import CONFIG_GROUPS
from server.device_defaults import CUDA_DEFAULTS
from server.docgen.annotations import bounds, default_text, md_text, type_name


class _Captured(Exception):
    """Carries the parser `cli.main` built out of it, before anything is parsed."""


def cli_parser() -> argparse.ArgumentParser:
    """The parser `beamline` uses, taken from `cli.main` at the moment it would parse."""

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture):
        try:
            cli.main([])
        except _Captured as captured:
            parser = captured.args[0]
            assert isinstance(parser, argparse.ArgumentParser)
            return parser
    raise RuntimeError("server.cli.main returned without parsing its arguments")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """`{"serve": <its parser>, ...}` in the order they were added."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def commands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command and nested command: `[("beamline serve", <its parser>), ...]`."""
    found = []
    for sub in subcommands(parser).values():
        found.append((sub.prog, sub))
        found += commands(sub)
    return found


def flags_by_key(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Config key (an action's dest) -> its option strings on `beamline serve`."""
    found: dict[str, list[str]] = {}
    for action in subcommands(parser)["serve"]._actions:
        if action.option_strings:
            found.setdefault(action.dest, []).extend(action.option_strings)
    return found


def render_config_keys() -> str:
    flags = flags_by_key(cli_parser())
    lines = [
        "| key | type | default | environment variable | flag | what |",
        "|---|---|---|---|---|---|",
    ]
    for key in (k for keys in CONFIG_GROUPS.values() for k in keys):  # as --help groups them
        info = ServerConfig.model_fields[key]
        limits = bounds(info)
        kind = f"{type_name(info.annotation)}{f' ({limits})' if limits else ''}"
        flag = " ".join(f"`{f}`" for f in flags.get(key, [])) or "file or env only"
        what = md_text(info.description or "")
        lines.append(
            f"| `{key}` | {kind} | {default_text(info)} | `{ENV_PREFIX}{key.upper()}` | {flag} "
            f"| {what} |"
        )
    cuda = ", ".join(f"`{k}` {v}" for k, v in CUDA_DEFAULTS.items())
    lines += ["", f"On CUDA, keys left unset default to: {cuda}."]
    return "\n".join(lines)


def render_cli() -> str:
    parser = cli_parser()
    sections = [f"`{parser.prog}` {_usage_commands(parser)}"]
    for path, sub in commands(parser):
        head = f"### `{path}`\n\n{md_text(sub.description or '')}".rstrip()
        if subcommands(sub):
            head += f"\n\n`{path}` {_usage_commands(sub)}"
        sections.append(head)
        for group in sub._action_groups:
            actions = [
                a
                for a in group._group_actions
                if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
            ]
            if not actions:
                continue
            lines = [f"**{group.title}**", ""]
            if group.description:
                lines += [md_text(group.description), ""]
            lines += ["| argument | takes | what |", "|---|---|---|"]
            lines += [_action_row(sub, a) for a in actions]
            sections.append("\n".join(lines))
    return "\n\n".join(sections)


def _usage_commands(parser: argparse.ArgumentParser) -> str:
    names = ", ".join(f"`{n}`" for n in subcommands(parser))
    return f"takes a command: {names}."


def _action_row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    names = action.option_strings or [str(action.metavar or action.dest)]
    shown = " ".join(f"`{name}`" for name in names)
    if isinstance(action, argparse.BooleanOptionalAction):
        takes = "on / off"
    elif action.choices is not None:
        takes = " \\| ".join(f"`{c}`" for c in action.choices)
    elif action.nargs == 0:
        takes = "-"
    else:
        kind = getattr(action.type, "__name__", None) if action.type else "text"
        takes = f"{kind}{', repeatable' if isinstance(action, argparse._AppendAction) else ''}"
    formatter = parser._get_formatter()
    text = formatter._expand_help(action) if action.help else ""
    return f"| {shown} | {takes} | {md_text(text)} |"
