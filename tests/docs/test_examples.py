"""Every Python block of docs/*.md runs and prints what the page says it prints.

A block in doctest form (``>>>``) is checked by doctest; any other ``python`` block is executed
and, when the next block is a ``text`` block, its standard output must equal that block. The
blocks of one page share one namespace, in order, like a reader running them.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def _blocks(page: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in _FENCE.finditer(page.read_text())]


PAGES = sorted(p for p in DOCS.rglob("*.md") if any(k == "python" for k, _ in _blocks(p)))
# The frameworks a page's examples import (the `integrations` extra; the test command has it).
_FRAMEWORKS = {"integrations.md": ("lightning", "transformers")}


def test_the_pages_with_examples_are_found() -> None:
    names = {p.name for p in PAGES}
    assert {"index.md", "getting-started.md", "examples.md", "monitoring.md"} <= names


def _run_doctest(code: str, namespace: dict[str, object], name: str) -> None:
    parser = doctest.DocTestParser()
    test = parser.get_doctest(code, namespace, name, name, 0)
    flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
    runner = doctest.DocTestRunner(optionflags=flags)
    out = io.StringIO()
    runner.run(test, out=out.write, clear_globs=False)
    assert runner.failures == 0, out.getvalue()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_examples(page: Path) -> None:
    for module in _FRAMEWORKS.get(page.name, ()):
        pytest.importorskip(module, reason='pip install "jacflow[integrations]"')
    blocks = _blocks(page)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for index, (kind, code) in enumerate(blocks):
        if kind != "python":
            continue
        name = f"{page.name} block {index}"
        if code.lstrip().startswith(">>>"):
            _run_doctest(code, namespace, name)
            continue
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            exec(compile(code, name, "exec"), namespace)
        following = blocks[index + 1] if index + 1 < len(blocks) else None
        if following is not None and following[0] == "text":
            printed = [line.rstrip() for line in stdout.getvalue().rstrip().splitlines()]
            expected = [line.rstrip() for line in following[1].rstrip().splitlines()]
            assert printed == expected, f"{name} printed:\n{stdout.getvalue()}"
