"""The reference manual: its code runs, its generated pages are current, its links stay inside.

Every ```python block of a page under ``docs/`` runs, the blocks of one page in order in one
namespace (a page such as the embedding guide is one program told in steps). The generated
pages (plugin catalogue, configuration keys) must equal what the tools write now.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
PAGES_WITH_CODE = [p for p in PAGES if BLOCK.search(p.read_text())]


def _load_tool(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[p.name for p in PAGES_WITH_CODE])
def test_page_code_runs(page: Path, capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {"__name__": f"__docs_{page.stem}__"}
    for i, code in enumerate(BLOCK.findall(page.read_text())):
        exec(compile(code, f"{page} (python block {i})", "exec"), namespace)
    capsys.readouterr()


def test_the_guide_has_code() -> None:
    assert DOCS / "guide.md" in PAGES_WITH_CODE


@pytest.mark.parametrize(
    ("tool", "page"),
    [("gen_plugin_catalogue", "plugins.md"), ("gen_config_keys", "config-keys.md")],
)
def test_generated_page_is_current(tool: str, page: str) -> None:
    module = _load_tool(tool)
    expected = module.render()  # type: ignore[attr-defined]
    committed = (DOCS / page).read_text()
    assert committed == expected, (
        f"docs/{page} is out of date: run `.venv/bin/python tools/{tool}.py` and commit it"
    )


def test_catalogue_lists_every_plugin_type() -> None:
    from llmsched import Router

    text = (DOCS / "plugins.md").read_text()
    for name in Router.plugin_types():
        assert f"`{name}`" in text, name


def test_tool_check_mode_fails_on_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "plugins.md"
    stale.write_text("stale\n")
    tool = ROOT / "tools" / "gen_plugin_catalogue.py"
    run = subprocess.run(
        [sys.executable, str(tool), "--check", "--out", str(stale)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 1
    assert "gen_plugin_catalogue.py" in run.stderr


def test_docs_point_only_inside_the_repository() -> None:
    for page in [*PAGES, ROOT / "README.md"]:
        text = page.read_text()
        assert "REFERENCE.md" not in text, page
        assert "../shared" not in text, page
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            assert (page.parent / target).exists(), f"{page.name}: broken link {target}"


def test_doctest_blocks_render_as_code() -> None:
    pytest.importorskip("markdown", reason="the docs extra builds the manual")
    module = _load_tool("mkdocs_doctest")
    blocks = module.DoctestBlocks(None)  # type: ignore[attr-defined]
    lines = [
        "Text.",
        ">>> x[0][1]",
        "2",
        "",
        "```python",
        ">>> left alone",
        "```",
        "    >>> indented",
        "    3",
    ]
    assert blocks.run(lines) == [
        "Text.",
        "",
        "```pycon",
        ">>> x[0][1]",
        "2",
        "```",
        "",
        "```python",
        ">>> left alone",
        "```",
        "",
        "    ```pycon",
        "    >>> indented",
        "    3",
        "    ```",
    ]
