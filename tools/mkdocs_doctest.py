"""A Markdown extension for the manual: doctest blocks in docstrings render as code.

Docstrings carry ``>>>`` examples (they run under ``pytest --doctest-modules``). Markdown would
join their lines into a paragraph and read ``x[0][1]`` as a reference link; this wraps each
block (a ``>>>`` line up to the next blank line) in a fenced ``pycon`` block first. Named in
``mkdocs.yml`` as ``tools.mkdocs_doctest``, so ``make docs`` runs ``python -m mkdocs`` from the
repository root.
"""

from __future__ import annotations

from typing import Any

from markdown import Markdown
from markdown.extensions import Extension
from markdown.preprocessors import Preprocessor


class DoctestBlocks(Preprocessor):
    """Fences every doctest block that is not already inside a fenced block."""

    def run(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        fence: str | None = None
        in_doctest = False
        indent = ""
        for line in lines:
            stripped = line.lstrip()
            if in_doctest:
                if stripped and line.startswith(indent):
                    out.append(line)
                    continue
                out.append(f"{indent}```")
                in_doctest = False
            if fence is None and stripped.startswith(("```", "~~~")):
                fence = stripped[:3]
            elif fence is not None and stripped.startswith(fence):
                fence = None
            elif fence is None and stripped.startswith(">>>"):
                indent = line[: len(line) - len(stripped)]
                if out and out[-1].strip():
                    out.append("")
                out += [f"{indent}```pycon", line]
                in_doctest = True
                continue
            out.append(line)
        if in_doctest:
            out.append(f"{indent}```")
        return out


class DoctestExtension(Extension):
    """Registers :class:`DoctestBlocks` ahead of the fenced-code preprocessor."""

    def extendMarkdown(self, md: Markdown) -> None:
        md.preprocessors.register(DoctestBlocks(md), "llmsched_doctest", 30)


def makeExtension(**kwargs: Any) -> DoctestExtension:
    """The entry point Markdown looks for."""
    return DoctestExtension(**kwargs)
