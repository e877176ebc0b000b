"""The command lines' parser: a bad flag costs one line and a hint, not the whole usage.

argparse answers any mistake with the full usage (45 lines for the controller's 60 flags) above
the one line that matters. ``BriefParser`` prints that line, a close match for a mistyped flag,
and where the options are listed; ``--help`` is unchanged (grouped by the caller).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Any, NoReturn

from ..errors import EXIT_CONFIG


class BriefParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line plus a short hint (exit 2).

    A flag is taken only as spelt in full (no prefix matching: ``--nproc-per-nod`` is an error,
    not ``--nproc-per-node``), in its kebab-case name or, as torchrun accepts, with underscores
    (``--nproc_per_node``): the same option, so a torchrun command line carries over."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        return super().parse_known_args(self._kebab(sys.argv[1:] if args is None else list(args)), namespace)

    def _kebab(self, args: list[str]) -> list[str]:
        """``--a_b[=v]`` as ``--a-b[=v]`` where that is one of this parser's flags (not after ``--``)."""
        flags = {s for action in self._actions for s in action.option_strings}
        out: list[str] = []
        for i, word in enumerate(args):
            if word == "--":
                return out + args[i:]
            name, eq, value = word.partition("=")
            if name.startswith("--") and "_" in name and name not in flags and name.replace("_", "-") in flags:
                word = name.replace("_", "-") + eq + value
            out.append(word)
        return out

    def error(self, message: str) -> NoReturn:
        lines = [f"{self.prog}: error: {message}"]
        if message.startswith("unrecognized arguments:"):
            flags = [s for action in self._actions for s in action.option_strings]
            for word in message.split(":", 1)[1].split():
                close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1)
                if close:
                    lines.append(f"  did you mean {close[0]}?")
        lines.append(f"  {self.prog} --help lists every option and its default")
        sys.stderr.write("\n".join(lines) + "\n")
        sys.exit(EXIT_CONFIG)
