"""Regenerate the option table in docs/options.md from the code.

The table is built from ``flodl.config.options.option_table()`` and
``flodl.config.AVAILABLE_FIELDS`` / ``AVAILABLE_MODES`` and written between
the two marker comments; everything outside the markers is hand-written and
left alone. ``tests/test_config.py`` fails when the committed file differs
from what this script would write, so docs never drift from the code.

Usage:  python docs/gen_options.py          # rewrite docs/options.md
        python docs/gen_options.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from flodl.config import AVAILABLE_FIELDS, AVAILABLE_MODES, ElCheMode  # noqa: E402
from flodl.config.options import option_table  # noqa: E402

DOC = ROOT / "docs" / "options.md"
BEGIN = "<!-- BEGIN GENERATED OPTIONS TABLE: edit flodl/config/run.py, then run python docs/gen_options.py -->"
END = "<!-- END GENERATED OPTIONS TABLE -->"
COLUMNS = ("Option", "CLI flag", "TOML key", "Type", "Default", "Meaning", "Status")


def status(name: str) -> str:
    """The Status column: available, or planned; a partly available mode names what works."""
    if name not in AVAILABLE_FIELDS:
        return "planned"
    if name == "mode" and set(AVAILABLE_MODES) != set(ElCheMode):
        return "available (" + ", ".join(sorted(m.value for m in AVAILABLE_MODES)) + " only)"
    return "available"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table() -> str:
    """The markdown table, one row per option, in the options' flat order."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in option_table():
        cells = (
            f"`{row['name']}`",
            f"`{row['flag']}`",
            f"`{row['toml_key']}`",
            row["type"],
            row["default"],
            row["help"],
            status(row["name"]),
        )
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def render_document(text: str) -> str:
    """``text`` with the block between the markers replaced by a fresh table."""
    head, sep1, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep1 and sep2):
        raise SystemExit(f"{DOC}: generated-table markers not found")
    return f"{head}{BEGIN}\n{render_table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    current = DOC.read_text(encoding="utf-8")
    fresh = render_document(current)
    if "--check" in argv:
        if fresh != current:
            print(f"{DOC} is out of date; run: python docs/gen_options.py", file=sys.stderr)
            return 1
        return 0
    if fresh != current:
        DOC.write_text(fresh, encoding="utf-8")
        print(f"rewrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
