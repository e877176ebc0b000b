"""The command lines' parser: a bad flag costs one line and a hint, not the whole usage.

argparse answers any mistake with the full usage (45 lines for the controller's 60 flags) above
the one line that matters. ``BriefParser`` prints that line, a close match for a mistyped flag,
and where the options are listed; ``--help`` is unchanged (grouped by the caller).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import NoReturn

from ..errors import EXIT_CONFIG


class BriefParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line plus a short hint (exit 2)."""

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
