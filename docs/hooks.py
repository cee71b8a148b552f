"""MkDocs hooks: the Benchmarks page is made from ``BENCHMARKS.md`` at build time.

``BENCHMARKS.md`` at the root of the repository is the one record of the
benchmark runs; a committed copy under docs/ drifted from it. ``mkdocs build``
loads this file (``hooks:`` in mkdocs.yml) and adds ``benchmarks.md`` to the
site from it, with its links rewritten for the page's place under docs/.
"""

from __future__ import annotations

import pathlib
import posixpath
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = "BENCHMARKS.md"
PAGE = "benchmarks.md"
# Pictures the record shows from outside docs/ are copied into the site here.
COPIED_FILES_DIR = "benchmarks-files"
IMAGE_SUFFIXES = (".png", ".svg", ".jpg", ".jpeg", ".gif", ".webp")
NOTE = (
    "*This page is made from `BENCHMARKS.md` at the root of the repository when the site "
    "is built; the raw results are under `benchmarks/results/` there.*"
)
# ![alt](target "title") or [text](target "title"); the target has no spaces.
_LINK = re.compile(
    r"(?P<bang>!?)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)"
)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_HEADING = re.compile(r"^#{1,6} ")


def _blank_line_before_headings(text: str) -> str:
    # GitHub ends a table at a heading; Python-Markdown reads the heading into the table.
    lines, in_fence, previous = [], False, ""
    for line in text.split("\n"):
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and _HEADING.match(line) and previous.strip():
            lines.append("")
        lines.append(line)
        previous = line
    return "\n".join(lines)


def _rewrite_link(match: re.Match[str], copied: list[str]) -> str:
    # A link into docs/ becomes page-relative; a picture elsewhere is copied into the
    # site; any other repository file is named in code, since the site does not hold it.
    target = match["target"]
    if _SCHEME.match(target) or target.startswith("#"):
        return match[0]
    path, hash_, anchor = target.partition("#")
    path = posixpath.normpath(path)
    title = match["title"] or ""
    if path.startswith("docs/"):
        new_target = path.removeprefix("docs/") + hash_ + anchor
        return f"{match['bang']}[{match['text']}]({new_target}{title})"
    if match["bang"] and path.lower().endswith(IMAGE_SUFFIXES):
        copied.append(path)
        return f"![{match['text']}]({COPIED_FILES_DIR}/{path}{title})"
    if match["text"].strip("`") == path:
        return f"`{path}`"
    return f"{match['text']} (`{path}`)"


def benchmarks_page(text: str) -> tuple[str, list[str]]:
    """Makes the docs page from the text of ``BENCHMARKS.md``.

    Args:
      text: the contents of ``BENCHMARKS.md``.

    Returns:
      ``(markdown, copied)``: the page, with a note under its title, its links
      rewritten for docs/ and a blank line before every heading, and the repository paths of the pictures it shows from
      outside docs/ (the site must hold them under ``benchmarks-files/``).

    Example:
      >>> page, copied = benchmarks_page("# B\\n\\n[guide](docs/guides/performance.md#x)\\n")
      >>> page.splitlines()[-1], copied
      ('[guide](guides/performance.md#x)', [])
    """
    copied: list[str] = []
    body = _LINK.sub(lambda m: _rewrite_link(m, copied), _blank_line_before_headings(text))
    title, newline, rest = body.partition("\n")
    if title.startswith("# "):
        body = f"{title}\n\n{NOTE}\n{newline}{rest}"
    else:
        body = f"{NOTE}\n\n{body}"
    return body, copied


def on_files(files, config):
    """MkDocs hook: adds the Benchmarks page (and its pictures) to the site's files."""
    from mkdocs.structure.files import File  # only a docs build has mkdocs

    page, copied = benchmarks_page((ROOT / SOURCE).read_text(encoding="utf-8"))
    stale = files.get_file_from_path(PAGE)
    if stale is not None:  # an old committed copy, now ignored by git
        files.remove(stale)
    files.append(File.generated(config, PAGE, content=page))
    for path in dict.fromkeys(copied):
        files.append(
            File.generated(config, f"{COPIED_FILES_DIR}/{path}", abs_src_path=str(ROOT / path))
        )
    return files
