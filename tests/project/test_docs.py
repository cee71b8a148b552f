"""Tests of the documentation site: the build, the API reference and every snippet.

* ``mkdocs build --strict`` must succeed (no broken links, no missing pages);
  the docs tools are part of the ``dev`` extra, so a missing mkdocs is a failure.
* Every name in ``nnx_mpmd.__all__`` has a ``::: ...`` entry in docs/api/.
* Every ```` ```python```` block of docs/**/*.md runs: each page's blocks run in
  order in one fresh module namespace of the test process (8 CPU devices, set by
  conftest.py). A block right after a ``<!-- no-test -->`` comment is skipped.
* The schedule table of docs/concepts.md matches the simulator, and every
  schedule picture exists.
* docs/hooks.py makes the Benchmarks page from BENCHMARKS.md at build time.
* What the pages say about the schedules (how many, which classes exist)
  matches the registry, and no page dates the past to the installed version.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pathlib
import re
import subprocess
import sys
import tomllib
import traceback
import types
import uuid

import pytest

import nnx_mpmd
from nnx_mpmd import errors

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
NO_TEST = "<!-- no-test -->"
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})\s*(?P<lang>[\w+-]*)[^\n]*$")
DIRECTIVE = re.compile(r"^:::\s+(?P<path>[\w.]+)\s*$", re.MULTILINE)
MKDOCS_TIMEOUT_S = 300


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


class SnippetFailed(Exception):
    """A python block of a docs page raised; the message names the page, block and line."""


def run_blocks(page: str, blocks: list[tuple[int, str]], folder: pathlib.Path = DOCS) -> dict:
    """Runs ``blocks`` in order in one fresh module namespace of this process.

    In process, not one interpreter per page: the page then pays no JAX start-up
    and shares the test run's compilation cache, 8 CPU devices and O0 (conftest.py).
    Tracebacks show the page's own lines (``folder/page``, its line numbers).

    Returns:
      The namespace the blocks ran in, for checks of what they made.

    Raises:
      SnippetFailed: a block raised; says which page, block and line, chained to the error.
    """
    module = types.ModuleType(f"docs_page_{uuid.uuid4().hex}")
    module.__file__ = str(folder / page)
    sys.modules[module.__name__] = module  # dataclasses and pickling look classes up here
    try:
        for index, (line, source) in enumerate(blocks, 1):
            # The fence is on line ``line``: padding puts each statement on its page line.
            code = compile("\n" * line + source, module.__file__, "exec")
            try:
                exec(code, module.__dict__)
            except (Exception, SystemExit) as error:
                raise SnippetFailed(
                    f"DOCS SNIPPET FAILED: {page}, block {index} (line {line})"
                ) from error
    finally:
        del sys.modules[module.__name__]
    return module.__dict__


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


def test_runner_names_page_and_block_on_failure():
    blocks = [(3, "x = 1\n"), (9, "y = 2\nassert x == 2, 'x is not 2'\n")]
    with pytest.raises(
        SnippetFailed, match=r"^DOCS SNIPPET FAILED: guide\.md, block 2 \(line 9\)$"
    ) as info:
        run_blocks("guide.md", blocks)
    assert isinstance(info.value.__cause__, AssertionError)
    assert str(info.value.__cause__) == "x is not 2"
    # The traceback points at the page's line: the fence is line 9, the assert line 11.
    frame = traceback.extract_tb(info.value.__cause__.__traceback__)[-1]
    assert (frame.filename, frame.lineno) == (str(DOCS / "guide.md"), 11)


def test_runner_shares_names_between_blocks_in_a_fresh_namespace_with_8_devices():
    run_blocks("page.md", [(1, "import jax\nn = jax.device_count()\n"), (5, "assert n == 8, n\n")])
    with pytest.raises(SnippetFailed, match=r"page\.md, block 1 \(line 1\)") as info:
        run_blocks("page.md", [(1, "n\n")])  # the previous page's names are gone
    assert isinstance(info.value.__cause__, NameError)


def test_runner_fails_on_a_block_that_exits():
    with pytest.raises(SnippetFailed, match=r"page\.md, block 1 \(line 2\)"):
        run_blocks("page.md", [(2, "raise SystemExit(3)\n")])


# --- the snippets of every page --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with_code(), ids=_page_name)
def test_page_snippets_run(page, tmp_path, monkeypatch):
    blocks = extract_python_blocks(page.read_text(encoding="utf-8"))
    monkeypatch.chdir(tmp_path)  # files a page writes (plan.json, checkpoints) land here
    try:
        run_blocks(_page_name(page), blocks)
        return
    except SnippetFailed as failure:
        cause = "".join(traceback.format_exception(failure.__cause__))
        message = f"a python block of docs/{_page_name(page)} failed:\n{cause}\n{failure}"
    pytest.fail(message, pytrace=False)  # outside the except: no chained tracebacks around it


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


def _docs_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("line", "page_line", "copied"),
    [
        ("[g](docs/guides/performance.md#cost)", "[g](guides/performance.md#cost)", []),
        ("![p](docs/img/a.png)", "![p](img/a.png)", []),
        ("[w](https://example.com/docs/a.md)", "[w](https://example.com/docs/a.md)", []),
        ("[s](#summary)", "[s](#summary)", []),
        ("[`benchmarks/x.py`](benchmarks/x.py)", "`benchmarks/x.py`", []),
        ("[the runner](./benchmarks/x.py#L3)", "the runner (`benchmarks/x.py`)", []),
        (
            '![fig](benchmarks/results/a.png "A")',
            '![fig](benchmarks-files/benchmarks/results/a.png "A")',
            ["benchmarks/results/a.png"],
        ),
    ],
)
def test_benchmarks_page_rewrites_links_for_docs(line, page_line, copied):
    page, pictures = _docs_hooks().benchmarks_page(f"# Benchmarks\n\n{line}\n")
    assert page.splitlines()[-1] == page_line
    assert pictures == copied


def test_benchmarks_page_separates_headings_from_tables():
    text = "# B\n\n| a |\n| --- |\n| 1 |\n## Next\n```\n# a comment\n```\n"
    page, _ = _docs_hooks().benchmarks_page(text)
    assert "| 1 |\n\n## Next\n```\n# a comment\n```" in page


def test_benchmarks_page_is_made_from_benchmarks_md():
    hooks = _docs_hooks()
    source = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    page, copied = hooks.benchmarks_page(source)
    assert page.startswith("# Benchmarks\n\n" + hooks.NOTE + "\n")
    headings = [line for line in source.splitlines() if line.startswith("## ")]
    assert headings and headings == [line for line in page.splitlines() if line.startswith("## ")]
    assert "](docs/" not in page, "a link into docs/ was left relative to the repository root"
    missing = [path for path in copied if not (ROOT / path).is_file()]
    assert not missing, f"BENCHMARKS.md shows pictures that do not exist: {missing}"


def test_benchmarks_page_is_built_not_committed():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert re.search(r"^hooks:\n  - docs/hooks\.py$", config, re.MULTILINE), (
        "mkdocs.yml must load docs/hooks.py, which makes the Benchmarks page"
    )
    assert "docs/benchmarks.md" in (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()


def test_docs_hooks_examples_run():
    result = doctest.testmod(_docs_hooks(), optionflags=doctest.ELLIPSIS)
    assert result.attempted and not result.failed


# --- the release records -----------------------------------------------------------


def test_version_is_the_newest_changelog_release():
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, re.MULTILINE)
    assert releases, "CHANGELOG.md has no release headers like '## [0.1.0] - 2026-11-21'"
    assert changelog.index("## [Unreleased]") < changelog.index(f"## [{releases[0]}]")
    versions = [tuple(map(int, r.split("."))) for r in releases]
    assert versions == sorted(versions, reverse=True), "CHANGELOG releases are not newest first"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    fallback = re.search(
        r'^    __version__ = "([^"]+)"$',
        (ROOT / "nnx_mpmd" / "__init__.py").read_text(encoding="utf-8"),
        re.MULTILINE,
    )
    assert project["version"] == fallback[1] == releases[0], (
        f"pyproject.toml says {project['version']}, the __version__ fallback in "
        f"nnx_mpmd/__init__.py {fallback[1]}, and the newest CHANGELOG release {releases[0]}; "
        "make them equal when cutting a release"
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
        timeout=MKDOCS_TIMEOUT_S,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-8000:]}"


# -- what the docs say about the schedules, against the registry ---------------------

_NUMBER_WORDS = {
    w: n
    for n, w in enumerate(
        [
            "zero",
            "one",
            "two",
            "three",
            "four",
            "five",
            "six",
            "seven",
            "eight",
            "nine",
            "ten",
            "eleven",
            "twelve",
        ]
    )
}
# A claim of how many schedules there are: "all nine schedules", "**Nine schedules** plus".
_SCHEDULE_COUNT = re.compile(
    r"(?:\ball (\w+) (?:registered |built-in )?schedules\b|\*\*(\w+) schedules\*\*)", re.IGNORECASE
)
# "`Name` ... has no class here": a JaxPP/Shardy name said to be missing.
_NO_CLASS = re.compile(r"`(\w+)`[^`\n]*?\bhas no (?:class|counterpart)\b")


def _user_pages() -> list[pathlib.Path]:
    # A docs/benchmarks.md left on disk (the site makes it from BENCHMARKS.md) is a record
    # of past runs (e.g. "all seven schedules" of `make bench`'s default list), not a
    # statement about this version.
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [p for p in pages if p.name != "benchmarks.md" and "api" not in p.parts]


def schedule_count_claims(text: str) -> list[tuple[int, str]]:
    """``(line, count word)`` of every statement of how many schedules there are."""
    claims = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in _SCHEDULE_COUNT.finditer(line):
            claims.append((number, (match[1] or match[2]).lower()))
    return claims


@pytest.mark.parametrize(
    "text, expected",
    [
        ("compares all nine schedules.", [(1, "nine")]),
        ("- **Seven schedules** plus your own", [(1, "seven")]),
        ("x\nall 9 registered schedules", [(2, "9")]),
        ("the makespans of two schedules compare", []),
    ],
)
def test_schedule_count_claims(text, expected):
    assert schedule_count_claims(text) == expected


def test_docs_state_the_registered_schedule_count():
    from nnx_mpmd.schedules import SCHEDULES

    wrong = []
    for page in _user_pages():
        for line, word in schedule_count_claims(page.read_text(encoding="utf-8")):
            count = int(word) if word.isdigit() else _NUMBER_WORDS.get(word)
            if count != len(SCHEDULES):
                wrong.append(f"{page.relative_to(ROOT)}:{line} says {word}")
    assert not wrong, f"the registry has {len(SCHEDULES)} schedules, but: {wrong}"


def test_readme_lists_every_registered_schedule_class():
    from nnx_mpmd.schedules import SCHEDULES

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    row = next((line for line in text.splitlines() if line.startswith("| `mp.jit`: ")), "")
    listed = set(re.findall(r"\w+", row))
    missing = [cls.__name__ for cls in SCHEDULES.values() if cls.__name__ not in listed]
    assert row and not missing, f"README's `mp.jit` schedule row misses {missing}"


def test_docs_name_no_existing_class_as_missing():
    wrong = []
    for page in _user_pages():
        for line, text in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for name in _NO_CLASS.findall(text):
                if hasattr(nnx_mpmd, name):
                    wrong.append(f"{page.relative_to(ROOT)}:{line}: `{name}` is mp.{name}")
    assert not wrong, f"the docs say these have no class, but they do: {wrong}"


def test_gen_pictures_draws_every_registered_schedule():
    from nnx_mpmd.schedules import SCHEDULES

    assert [name for name, _ in _gen_pictures().SCHEDULES] == list(SCHEDULES)


def test_docs_do_not_date_the_past_to_the_installed_version():
    # "In version 0.1.0 these functions lived in ..." read as if 0.1.0 were an old release.
    past = re.compile(
        rf"\b[Ii]n version {re.escape(nnx_mpmd.__version__)}\b[^.]*\b(?:lived|was|were|had)\b"
    )
    wrong = [
        f"{page.relative_to(ROOT)}:{line}"
        for page in _user_pages()
        for line, text in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if past.search(text)
    ]
    assert not wrong, f"{nnx_mpmd.__version__} is the installed version, not an old one: {wrong}"


def test_readme_quick_start_says_how_to_use_the_venv_and_the_test_loops():
    # After `make demo`, a plain `python examples/01_quickstart.py` has no jax and
    # `nnx-mpmd` is not on PATH: the quick start says how to reach .venv.
    quick_start = (ROOT / "README.md").read_text(encoding="utf-8").split("## Twenty lines")[0]
    assert "source .venv/bin/activate" in quick_start
    assert ".venv/bin/python examples/01_quickstart.py" in quick_start
    assert re.search(r"make test .*~35 min on 2 cores", quick_start)
    assert re.search(r"`make test-fast`.*about a minute", quick_start, re.DOTALL)
