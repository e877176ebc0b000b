"""The dashboard page: one self-contained HTML document (inline CSS, JS, SVG).

The document is ``dashboard.html`` beside this module (package data, read
once at import); this module fills it in. The same document serves both modes: live (served by
`dashboard.py`, it follows ``/events`` with EventSource) and archive
(written by `archive.py`, it reads an embedded
``<script type="application/json" id="flodl-data">`` block). It fetches
nothing external, so an archive opens offline. Charts are hand-written SVG.

DOM contract (tests and headless checks rely on it):
  * every chart is ``<div class="chart" id="chart-NAME">``; each drawn series
    is an SVG ``<path data-series="SERIES" data-points="COUNT">`` (COUNT is
    the number of data points, before any thinning for drawing);
  * per-rank series are named ``METRIC:RANK`` (``throughput:rank0``), RANK
    being the node path without its ``root/`` prefix;
  * events are ``<li data-class="CLASS" data-sev="SEV">`` in ``#events``,
    ranks are ``<tr data-path="PATH" data-alive="true|false">`` in ``#ranks``;
  * ``<body data-mode="live|archive" data-rendered="N" data-records="N">``,
    and ``data-errors="N"`` once a JS error was caught.
"""

from __future__ import annotations

from importlib import resources

THEMES = (None, "light", "dark", "auto")
THEME_LINE = "const ARCHIVE_THEME=null;"
DATA_MARKER = "<!--flodl-data-->"


def check_theme(theme: object) -> str | None:
    """``theme`` if it is a valid ``dashboard_theme``.

    Raises:
        ValueError: anything but None, "light", "dark" or "auto".
    """
    if theme not in THEMES or (theme is not None and not isinstance(theme, str)):
        raise ValueError(f"dashboard_theme must be None, 'light', 'dark' or 'auto', not {theme!r}")
    return theme


def embed_json(text: str) -> str:
    """Make a JSON text safe inside a ``<script>`` element.

    ``<`` only occurs inside JSON strings, where ``\\u003c`` means the same;
    escaping every one means no string can close the script (``</script>``)
    or open an HTML comment.
    """
    return text.replace("<", "\\u003c")


def render_page(*, theme: str | None = None, data_json: str | None = None) -> str:
    """The page, with the theme pinned and, for an archive, the data embedded.

    Raises:
        ValueError: ``theme`` is not a valid ``dashboard_theme``.
    """
    check_theme(theme)
    html = PAGE
    if theme is not None:
        html = html.replace(THEME_LINE, f'const ARCHIVE_THEME="{theme}";')
    block = ""
    if data_json is not None:
        block = f'<script type="application/json" id="flodl-data">{embed_json(data_json)}</script>'
    return html.replace(DATA_MARKER, block)


#: The page itself: HTML, CSS and the script, in dashboard.html next to this module.
PAGE = resources.files(__package__).joinpath("dashboard.html").read_text(encoding="utf-8")
