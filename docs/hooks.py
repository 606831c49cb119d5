"""mkdocs hooks for the documentation site (``hooks:`` in mkdocs.yml; not a page).

The docstrings use Sphinx roles (``:class:`X```); mkdocstrings renders the name as code and
leaves the role's prefix in the text. This drops the prefix, so the name reads as code.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|meth|func|attr|mod|exc|data|obj|const|py:\w+):(?=<code>|<a )")


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub("", html)
