r"""A griffe extension: reads an ``Example:`` docstring section as ``Examples:``.

The codebase writes ``Example:`` (singular) in its Google-style docstrings.
griffe only turns ``Examples:`` into an examples section (doctest lines shown
as Python code); a singular one would become an admonition whose ``>>>`` lines
render as Markdown, with ``[0, 1]`` read as link references. mkdocstrings loads
this file through ``extensions:`` in mkdocs.yml.

Example:
    >>> rename_example_sections("Sum.\n\n  Example:\n    >>> 1").splitlines()[2]
    '  Examples:'
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SINGULAR = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.MULTILINE)


def rename_example_sections(docstring: str) -> str:
    """Renames every ``Example:`` section header of ``docstring`` to ``Examples:``.

    Args:
      docstring: the docstring text.

    Returns:
      The text with the headers renamed, indentation kept.

    Example:
      >>> rename_example_sections("Example:")
      'Examples:'
    """
    return _SINGULAR.sub(r"\g<indent>Examples:", docstring)


class ExampleSections(griffe.Extension):
    """Renames ``Example:`` section headers to ``Examples:`` in every docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrites the docstring of each loaded object.

        Args:
          obj: the object griffe just loaded.
          **kwargs: the other hook arguments (unused).

        Returns:
          None.
        """
        if obj.docstring is not None:
            obj.docstring.value = rename_example_sections(obj.docstring.value)
