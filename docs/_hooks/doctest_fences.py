"""Griffe extension: kpipe's docstring examples rendered as code blocks.

kpipe writes its examples as doctests under `Example:` (`--doctest-modules` runs them).
Markdown has no doctest blocks, so without this a line like `>>> [b.shape for b in ds]`
or its output `[(4, 2), (4, 2)]` would render as a paragraph (and `[...]` read as a link).
Each run of `>>>`/`...` lines with its output lines (up to a blank line) is wrapped in a
```` ```pycon ```` fence, keeping its indentation. Docstrings are otherwise unchanged.
"""

import griffe

_PROMPTS = (">>>", "...")


def fence_doctests(text):
    """Returns `text` with each doctest run (up to a blank line) inside a pycon fence."""
    out, in_block, indent, in_fence = [], False, "", False
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        if in_fence or stripped.startswith("```"):
            if in_block:
                out.append(indent + "```")
                in_block = False
            out.append(line)
            continue
        if not in_block and stripped.startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(indent + "```pycon")
            in_block = True
        elif in_block and not stripped:
            out.append(indent + "```")
            in_block = False
        out.append(line)
    if in_block:
        out.append(indent + "```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_object(self, *, obj, loader=None, **kwargs):
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
