"""Tests of the documentation site: the build, the API reference and every snippet.

* ``mkdocs build --strict`` must succeed (no broken links, no missing pages);
  the docs tools are part of the ``dev`` extra, so a missing mkdocs is a failure.
* Every name in ``nnx_mpmd.__all__`` has a ``::: ...`` entry in docs/api/.
* Every ```` ```python```` block of docs/**/*.md runs: each page's blocks run in
  order in one fresh subprocess with 8 CPU devices. A block right after a
  ``<!-- no-test -->`` comment is skipped.
* The schedule table of docs/concepts.md matches the simulator, and every
  schedule picture exists.
* The results copied into docs/benchmarks.md match BENCHMARKS.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import nnx_mpmd
from nnx_mpmd import errors

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NO_TEST = "<!-- no-test -->"
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})\s*(?P<lang>[\w+-]*)[^\n]*$")
DIRECTIVE = re.compile(r"^:::\s+(?P<path>[\w.]+)\s*$", re.MULTILINE)
PAGE_TIMEOUT_S = 300


def extract_python_blocks(text: str) -> list[tuple[int, str]]:
    """Returns ``(line number, source)`` of each python block not marked no-test.

    A fence may be indented (inside an admonition); its body is dedented by the
    fence's indentation. ``python`` and ``py`` fences count; others do not.
    """
    lines = text.splitlines()
    blocks = []
    i = 0
    previous = ""
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        indent, ticks, lang = match["indent"], match["ticks"], match["lang"].lower()
        start = i + 1
        j = start
        while j < len(lines) and lines[j].strip() != ticks:
            j += 1
        if j == len(lines):
            raise ValueError(f"unclosed code fence opened at line {i + 1}")
        body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[start:j]]
        if lang in ("python", "py") and previous != NO_TEST:
            blocks.append((i + 1, "\n".join(body) + "\n"))
        previous = ticks
        i = j + 1
    return blocks


def _page_name(path: pathlib.Path) -> str:
    return path.relative_to(DOCS).as_posix()


def _pages_with_code() -> list[pathlib.Path]:
    return sorted(
        p for p in DOCS.rglob("*.md") if extract_python_blocks(p.read_text(encoding="utf-8"))
    )


# Runs the blocks of one page in one namespace; stops at the first failing block.
_RUNNER = r"""
import json, sys, traceback
page, blocks = json.loads(sys.stdin.read())
namespace = {"__name__": "__main__"}
for index, (line, source) in enumerate(blocks, 1):
    try:
        exec(compile(source, f"{page}:{line}", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"DOCS SNIPPET FAILED: {page}, block {index} (line {line})", file=sys.stderr)
        sys.exit(1)
"""


def run_blocks(
    page: str, blocks: list[tuple[int, str]], cwd: pathlib.Path
) -> subprocess.CompletedProcess:
    """Runs ``blocks`` in order in a fresh interpreter with 8 CPU devices."""
    env = dict(os.environ)
    # O0 as in conftest.py: the snippets are compiled for speed, not measured.
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    env["JAX_PLATFORMS"] = "cpu"
    env["MPLBACKEND"] = "Agg"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps([page, blocks]),
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=PAGE_TIMEOUT_S,
    )


# --- the snippet extractor -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("```python\nx = 1\n```\n", [(1, "x = 1\n")]),
        ("```py\nx = 1\n```\n", [(1, "x = 1\n")]),
        ("```bash\nls\n```\n", []),
        ("```\nplain\n```\n", []),
        ("<!-- no-test -->\n```python\nx = 1\n```\n", []),
        ("<!-- no-test -->\n\n```python\nx = 1\n```\n```python\ny = 2\n```\n", [(6, "y = 2\n")]),
        (
            "text\n\n    ```python\n    if True:\n        z = 3\n    ```\n",
            [(3, "if True:\n    z = 3\n")],
        ),
        ("````python\n```\n````\n", [(1, "```\n")]),
    ],
)
def test_extract_python_blocks(text, expected):
    assert extract_python_blocks(text) == expected


def test_extract_rejects_unclosed_fence():
    with pytest.raises(ValueError, match="unclosed code fence opened at line 2"):
        extract_python_blocks("intro\n```python\nx = 1\n")


def test_runner_names_page_and_block_on_failure(tmp_path):
    blocks = [(3, "x = 1\n"), (9, "assert x == 2, 'x is not 2'\n")]
    result = run_blocks("guide.md", blocks, tmp_path)
    assert result.returncode == 1
    assert "DOCS SNIPPET FAILED: guide.md, block 2 (line 9)" in result.stderr
    assert "x is not 2" in result.stderr


def test_runner_shares_names_between_blocks_and_has_8_devices(tmp_path):
    blocks = [(1, "import jax\nn = jax.device_count()\n"), (5, "print('devices', n)\n")]
    result = run_blocks("page.md", blocks, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "devices 8" in result.stdout


# --- the snippets of every page --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with_code(), ids=_page_name)
def test_page_snippets_run(page, tmp_path):
    blocks = extract_python_blocks(page.read_text(encoding="utf-8"))
    result = run_blocks(_page_name(page), blocks, tmp_path)
    if result.returncode != 0:
        pytest.fail(
            f"a python block of docs/{_page_name(page)} failed:\n{result.stderr[-6000:]}",
            pytrace=False,
        )


# --- the API reference -----------------------------------------------------------------


def _documented_objects() -> dict[str, list[object]]:
    """Maps each name documented in docs/api/ to the objects its directives resolve to."""
    found: dict[str, list[object]] = {}
    for page in sorted((DOCS / "api").glob("*.md")):
        for match in DIRECTIVE.finditer(page.read_text(encoding="utf-8")):
            path = match["path"]
            try:
                obj = importlib.import_module(path)
            except ImportError:
                module_name, _, attribute = path.rpartition(".")
                obj = getattr(importlib.import_module(module_name), attribute)
            found.setdefault(path.rpartition(".")[2], []).append(obj)
    return found


@pytest.mark.parametrize("name", sorted(nnx_mpmd.__all__))
def test_api_reference_documents_public_name(name):
    documented = _documented_objects()
    assert name in documented, f"nnx_mpmd.{name} has no '::: ...{name}' entry in docs/api/*.md"
    assert any(obj is getattr(nnx_mpmd, name) for obj in documented[name]), (
        f"the docs/api entries named {name} document another object than nnx_mpmd.{name}"
    )


@pytest.mark.parametrize(
    "name", [n for n in errors.__all__ if isinstance(getattr(errors, n), type)]
)
def test_troubleshooting_covers_error_class(name):
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    assert re.search(rf"^## `{name}`", text, re.MULTILINE), (
        f"docs/troubleshooting.md needs a '## `{name}`' section"
    )


# --- the schedule table and pictures ---------------------------------------------------


def _gen_pictures():
    spec = importlib.util.spec_from_file_location("gen_pictures", DOCS / "gen_pictures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_concepts_schedule_table_matches_simulator():
    text = (DOCS / "concepts.md").read_text(encoding="utf-8")
    match = re.search(
        r"<!-- schedule-table:start -->\n(.*?)\n<!-- schedule-table:end -->", text, re.DOTALL
    )
    assert match, "docs/concepts.md lost its schedule-table markers"
    assert match[1].strip() == _gen_pictures().markdown_table(), (
        "the schedule table in docs/concepts.md is stale; run python docs/gen_pictures.py "
        "and paste the table it prints"
    )


@pytest.mark.parametrize("name", [name for name, _ in _gen_pictures().SCHEDULES])
def test_schedule_picture_exists_and_is_shown(name):
    picture = DOCS / "img" / f"schedule-{name}.png"
    assert picture.is_file() and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", (
        f"{picture} is missing; run python docs/gen_pictures.py"
    )
    assert f"(img/schedule-{name}.png)" in (DOCS / "concepts.md").read_text(encoding="utf-8")


# --- the benchmark numbers ------------------------------------------------------------


def _marked_block(text: str, name: str) -> str | None:
    match = re.search(rf"<!-- {name}:start -->\n(.*?)\n<!-- {name}:end -->", text, re.DOTALL)
    return match[1].strip() if match else None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a\n<!-- t:start -->\n| x |\n<!-- t:end -->\nb", "| x |"),
        ("a\n<!-- t:start -->\n| x |\n", None),
        ("<!-- u:start -->\n| x |\n<!-- u:end -->", None),
    ],
)
def test_marked_block(text, expected):
    assert _marked_block(text, "t") == expected


def test_benchmarks_page_copies_benchmarks_md():
    block = _marked_block((DOCS / "benchmarks.md").read_text(encoding="utf-8"), "benchmarks")
    assert block, "docs/benchmarks.md lost its benchmarks:start / benchmarks:end markers"
    assert "| --- |" in block, "the copied benchmark section has no table"
    source = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert block in source, (
        "the results in docs/benchmarks.md differ from BENCHMARKS.md; paste the current "
        "section of BENCHMARKS.md between the benchmarks:start and benchmarks:end markers"
    )


# --- the site --------------------------------------------------------------------------


def test_mkdocs_build_strict(tmp_path):
    if (
        importlib.util.find_spec("mkdocs") is None
        or importlib.util.find_spec("mkdocstrings_handlers.python") is None
    ):
        pytest.fail(
            "mkdocs / mkdocstrings[python] are not installed, so the docs cannot be checked; "
            'install the dev extra: pip install -e ".[dev]" (it includes mkdocs-material and '
            "mkdocstrings[python])",
            pytrace=False,
        )
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=PAGE_TIMEOUT_S,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-8000:]}"
