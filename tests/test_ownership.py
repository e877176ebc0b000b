"""Each part owns its state: no attribute is written from two files (the controller's and the rank's parts).

Read from the source (tools/ownership.py): a class's attributes are those its own
methods write through ``self``; no class of its family (a base, a mixin, a
subclass) in another file writes one of them, and no other file writes a field
of a part through a reference to it (``self.link.x = ...``, ``rank.x = ...``).
A part asks another through its methods; a record (a ``@dataclass``) is data its
holder fills.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.ownership import foreign_writes, read, shared_writes

ROOT = Path(__file__).resolve().parent.parent / "flodl"


@pytest.mark.parametrize("package", ["controller", "rank"])
def test_no_attribute_of_a_part_is_written_from_another_file(package):
    classes, writes = read([ROOT / package])
    assert {"controller": "Controller", "rank": "RankRunner"}[package] in {c.name for c in classes}  # the walk read the package
    assert shared_writes(classes) == []
    assert foreign_writes(classes, writes) == []


def test_the_rule_is_read_from_the_source(tmp_path):
    """The two ways state leaks across files, as the check sees them (each fails it)."""
    (tmp_path / "owner.py").write_text(
        "class Runner:\n    def __init__(self):\n        self.generation = 0\n        self.link = Link()\n"
        "class Link:\n    def __init__(self):\n        self.faults = None\n"
    )
    (tmp_path / "mixin.py").write_text(
        "from .owner import Runner, Link\n"
        "class Regrouping(Runner):\n    def regroup(self):\n        self.generation += 1\n"
        "class Other:\n    link: Link\n    def arm(self, runner: Runner):\n        runner.generation = 2\n        self.link.faults = 1\n"
    )
    classes, writes = read([tmp_path])
    assert [s.split(":")[0] for s in shared_writes(classes)] == ["generation"]
    assert [f.split(":")[0] for f in foreign_writes(classes, writes)] == ["runner.generation", "self.link.faults"]
