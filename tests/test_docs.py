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


PIP_EXTRAS = re.compile(r"pip install '?llmsched\[([\w,]+)\]")
REQUIRE = re.compile(r"require\(\s*\"(\w+)\",\s*((?:\"\w+\",\s*)+)feature=")
IMPORTS = re.compile(r"^\s*(?:from|import) ([\w.]+)", flags=re.M)


def _needed_packages(module: str) -> set[str]:
    """The import names a module's ``llmsched._extras.require`` calls (and its packages')
    ask for, read from the source without importing it; a third-party module is itself."""
    if module.split(".")[0] != "llmsched":
        return {module.split(".")[0]}
    needed: set[str] = set()
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        base = ROOT / "python" / Path(*parts[:i])
        for source in (base / "__init__.py", base.with_suffix(".py")):
            if source.exists():
                for _, names in REQUIRE.findall(source.read_text()):
                    needed |= set(re.findall(r"\"(\w+)\"", names))
    return needed


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES_WITH_CODE if PIP_EXTRAS.search(p.read_text())],
    ids=lambda p: p.name,
)
def test_a_page_installs_the_extras_its_code_imports(page: Path) -> None:
    """The embedding guide said `pip install 'llmsched[integrations]'`, and its first block
    failed there: the fake engines (llmsched.testing) need msgpack, from the test extra."""
    from llmsched._extras import EXTRAS

    text = page.read_text()
    extras = {e for found in PIP_EXTRAS.findall(text) for e in found.split(",")}
    installed = {"numpy", "yaml"} | {m for e in extras for m in EXTRAS[e]}
    for code in BLOCK.findall(text):
        for module in IMPORTS.findall(code):
            if module.split(".")[0] in sys.stdlib_module_names:
                continue
            missing = _needed_packages(module) - installed
            assert not missing, f"docs/{page.name}: {module} needs {missing}, not in {extras}"


def test_the_install_page_lists_every_extra() -> None:
    """docs/install.md's table of extras left out `kubernetes` and `cluster`."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = re.findall(r"^([\w-]+) = \[", section, flags=re.M)
    table = (DOCS / "install.md").read_text()
    assert extras and [e for e in extras if f"| `{e}` |" not in table] == []


def test_every_public_package_is_on_the_map() -> None:
    """`help(llmsched)` showed one line and a doctest; docs/index.md's table of modules left
    out `llmsched.cluster`. Every public subpackage, and every module behind an extra, is in
    both."""
    import llmsched

    source = ROOT / "python" / "llmsched"
    public = {p.name for p in source.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    public |= {p.stem for p in source.glob("*.py") if re.search(r"^require\(", p.read_text(), re.M)}
    table = (DOCS / "index.md").read_text()
    doc = llmsched.__doc__ or ""
    for name in sorted(n for n in public if not n.startswith("_")):
        assert f"| `llmsched.{name}` |" in table, name
        assert f"llmsched.{name}" in doc, name
