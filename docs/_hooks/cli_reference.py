"""MkDocs hook: the command-line reference, generated from `kpipe`'s argparse parsers.

`docs/reference/cli.md` holds the marker `<!-- kpipe-cli-reference -->`; at build time it is
replaced by, for every subcommand (and sub-subcommand, e.g. `data-service dispatcher`), its
`--help` text and a table of its arguments read from the parser itself, so the page cannot
drift from the flags. `render()` is also what `tests/test_docs.py` checks.

Building the parsers imports each `kpipe/_cli/<name>.py`, none of which imports TensorFlow.
"""

import argparse
import html

MARKER = "<!-- kpipe-cli-reference -->"
_WIDTH = 96


def _fixed_width(parser):
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=_WIDTH, max_help_position=32)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _fixed_width(sub)


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _default(action):
    if action.default in (None, argparse.SUPPRESS) or isinstance(action, (argparse._HelpAction,)):
        return ""
    if action.option_strings and isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return ""
    return f"`{action.default!r}`"


def _cell(text):
    return html.escape(" ".join(str(text or "").split()), quote=False).replace("|", "\\|")


def _table(parser):
    rows = ["| argument | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        value = f" {action.metavar or action.dest.upper()}" if action.option_strings and action.nargs != 0 else ""
        name = ", ".join(f"`{o}{value}`" for o in action.option_strings) or f"`{action.metavar or action.dest}`"
        help_text = action.help if action.help != argparse.SUPPRESS else ""
        if "%(" in (help_text or ""):
            help_text = help_text % {"default": action.default, "prog": parser.prog}
        rows.append(f"| {name} | {_default(action)} | {_cell(help_text)} |")
    return "\n".join(rows)


def _section(parser, title, level):
    out = [f"{'#' * level} `{title}`", "", "```text", parser.format_help().rstrip(), "```", "", _table(parser), ""]
    for name, sub in _subparsers(parser).items():
        out.append(_section(sub, f"{title} {name}", level + 1))
    return "\n".join(out)


def render():
    """Returns the Markdown of every `kpipe` subcommand's help and arguments."""
    from kpipe import cli

    top = cli._build_parser(None)
    _fixed_width(top)
    parts = ["## `kpipe`", "", "```text", top.format_help().rstrip(), "```", ""]
    for name in cli._SUBCOMMANDS:
        parser = _subparsers(cli._build_parser(name))[name]
        _fixed_width(parser)
        parts.append(_section(parser, f"kpipe {name}", 2))
    return "\n".join(parts)


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        return markdown.replace(MARKER, render())
    return markdown
