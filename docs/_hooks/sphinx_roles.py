"""MkDocs hook: render the Sphinx roles of the docstrings (``:class:`~a.b.C```) as links.

The docstrings use reStructuredText roles for cross-references, which Markdown shows as text
(``:class:`` followed by the code span). This hook turns each role into an optional autorefs
reference: a link when the target is documented on the site, plain code otherwise. A leading
``~`` shows only the last name, as Sphinx does.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):<code>(~?)([\w.]+)(\(\))?</code>")


def _replace(m: re.Match[str]) -> str:
    short, target, call = m.group(1), m.group(2), m.group(3) or ""
    title = target.rsplit(".", 1)[-1] if short else target
    return f'<autoref identifier="{target}" optional><code>{title}{call}</code></autoref>'


def on_page_content(html: str, **kwargs: Any) -> str:
    """Replace every role in the page's HTML by an optional reference."""
    return _ROLE.sub(_replace, html)
