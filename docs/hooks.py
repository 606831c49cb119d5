"""mkdocs hooks for the documentation site (``hooks:`` in mkdocs.yml; not a page).

* The docstrings use Sphinx roles (``:class:`X```); mkdocstrings renders the name as code and
  leaves the role's prefix in the text. :func:`on_page_content` drops the prefix.
* ``<!-- swarmavg-help -->`` in a page becomes what ``swarmavg --help`` and each subcommand's
  ``--help`` print, read from the installed command line, so the page cannot go stale.
"""

from __future__ import annotations

import contextlib
import io
import re
from typing import Any

_ROLE = re.compile(r":(?:class|meth|func|attr|mod|exc|data|obj|const|py:\w+):(?=<code>|<a )")
_HELP_MARKER = "<!-- swarmavg-help -->"
#: The commands whose help the page shows, in its order.
_COMMANDS = (
    (),
    ("demo",),
    ("demo", "averaging"),
    ("status",),
    ("doctor",),
    ("dht",),
    ("serve",),
    ("ping",),
    ("link-demo",),
)


def _help(argv: tuple[str, ...]) -> str:
    from swarmavg.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    return out.getvalue().rstrip()


def on_page_markdown(markdown: str, **_: Any) -> str:
    if _HELP_MARKER not in markdown:
        return markdown
    parts = []
    for argv in _COMMANDS:
        title = " ".join(("swarmavg", *argv))
        parts.append(f"## `{title}`\n\n```text\n{_help(argv)}\n```\n")
    return markdown.replace(_HELP_MARKER, "\n".join(parts))


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub("", html)
