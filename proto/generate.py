"""Generate flodl's Python message types from the language-neutral schema.

``proto/schema.json`` is the single source of truth for the control
protocol. This script writes:

* ``flodl/wire/messages.py`` — one frozen dataclass per message plus the
  ``SCHEMA`` table the codec builds its validators from;
* the message catalogue between the markers in ``proto/README.md``.

Run ``python proto/generate.py`` after editing the schema; the test suite
fails (``tests/test_protocol.py``, ``test_generated_files_are_fresh``) while the generated files are stale.
``--check`` exits 1 instead of writing when something would change.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = ROOT / "proto" / "schema.json"
MESSAGES_PATH = ROOT / "flodl" / "wire" / "messages.py"
README_PATH = ROOT / "proto" / "README.md"
BEGIN, END = "<!-- BEGIN GENERATED CATALOGUE -->", "<!-- END GENERATED CATALOGUE -->"

_SCALARS = {"int": "int", "float": "float", "bool": "bool", "str": "str", "bytes": "bytes", "value": "Any"}


def python_type(wire_type: str) -> str:
    """Map a schema type (``list<opt<int>>``...) to a Python annotation."""
    if wire_type in _SCALARS:
        return _SCALARS[wire_type]
    inner = re.fullmatch(r"(opt|list)<(.+)>", wire_type)
    if inner:
        kind, arg = inner.groups()
        return f"{python_type(arg)} | None" if kind == "opt" else f"list[{python_type(arg)}]"
    mapped = re.fullmatch(r"map<str,(.+)>", wire_type)
    if mapped:
        return f"dict[str, {python_type(mapped.group(1))}]"
    raise ValueError(f"unknown schema type {wire_type!r}")


def load_schema() -> dict:
    """Read and sanity-check the schema (unique kinds and names, known types)."""
    schema = json.loads(SCHEMA_PATH.read_text())
    kinds, names = set(), set()
    for msg in schema["messages"]:
        if msg["kind"] in kinds or msg["name"] in names:
            raise ValueError(f"duplicate message kind/name: {msg['kind']} {msg['name']}")
        kinds.add(msg["kind"])
        names.add(msg["name"])
        for field in msg["fields"]:
            python_type(field["type"])
    return schema


def render_messages(schema: dict) -> str:
    """Return the text of ``flodl/wire/messages.py``."""
    out = [
        '"""Wire messages of the flodl control protocol.',
        "",
        "GENERATED from proto/schema.json by proto/generate.py: do not edit by hand.",
        "Each message is a slotted dataclass (treat it as immutable: not frozen only",
        "because frozen construction costs 4x on the controller's hot path);",
        "``SCHEMA`` maps a kind to its name,",
        "class and ``(field, wire type)`` pairs, from which ``codec.py`` builds its",
        "bounded validators. Field order is wire order.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from dataclasses import dataclass",
        "from typing import Any, ClassVar",
        "",
        f"PROTOCOL_VERSION = {schema['version']}",
        "",
    ]
    for msg in schema["messages"]:
        out += ["", "@dataclass(slots=True)", f"class {msg['name']}:"]
        out.append(f'    """{msg["doc"]} ({msg["from"]} -> {msg["to"]})"""')
        out.append("")
        out.append(f"    KIND: ClassVar[int] = {msg['kind']}")
        for field in msg["fields"]:
            out.append(f"    {field['name']}: {python_type(field['type'])}")
            out.append(f'    """{field["doc"]}"""')
        out.append("")
    out += ["", "SCHEMA: dict[int, tuple[str, type, tuple[tuple[str, str], ...]]] = {"]
    for msg in schema["messages"]:
        fields = ", ".join(f"({f['name']!r}, {f['type']!r})" for f in msg["fields"])
        out.append(f"    {msg['kind']}: ({msg['name']!r}, {msg['name']}, ({fields},)),")
    out.append("}")
    return "\n".join(out) + "\n"


def render_catalogue(schema: dict) -> str:
    """Return the Markdown message catalogue for proto/README.md."""
    lines = [BEGIN, "", "| kind | message | from → to | meaning |", "|---|---|---|---|"]
    for msg in schema["messages"]:
        lines.append(f"| {msg['kind']} | `{msg['name']}` | {msg['from']} → {msg['to']} | {msg['doc']} |")
    for msg in schema["messages"]:
        lines += ["", f"### {msg['kind']} `{msg['name']}`", "", msg["doc"], "", "| # | field | type | meaning |", "|---|---|---|---|"]
        for i, field in enumerate(msg["fields"]):
            lines.append(f"| {i} | `{field['name']}` | `{field['type']}` | {field['doc']} |")
    lines += ["", END]
    return "\n".join(lines)


def render_readme(schema: dict) -> str:
    """Return proto/README.md with its catalogue section regenerated."""
    text = README_PATH.read_text()
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + render_catalogue(schema) + text[stop:]


def outputs() -> dict[Path, str]:
    """Every generated file and its expected content."""
    schema = load_schema()
    return {MESSAGES_PATH: render_messages(schema), README_PATH: render_readme(schema)}


def main(argv: list[str]) -> int:
    stale = [p for p, text in outputs().items() if not p.exists() or p.read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"stale: {path.relative_to(ROOT)} (run python proto/generate.py)")
        return 1 if stale else 0
    for path, text in outputs().items():
        path.write_text(text)
    print(f"wrote {len(outputs())} files ({len(stale)} changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
