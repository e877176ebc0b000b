"""The package layering docs/architecture.md states ("Module map"), held on every import in the source.

Read from the source (tools/import_cycles.py ``every_import``), imports inside
functions included: a late import is an arrow between two packages all the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.import_cycles import Import, every_import

ROOT = Path(__file__).resolve().parent.parent / "flodl"
PROCESSES = ("flodl.controller", "flodl.rank", "flodl.worker", "flodl.launcher")
BELOW_PROCESSES = ("plan", "wire", "config", "checkpoint", "host")

#: The entry points that install flodl.testing's probes when the environment asks for them
#: (flodl/probes.py): the module, and the function the import stands in ("" at module level).
#: A process's entry, nothing it imports: the rest of the product calls ``flodl.probes`` only.
INSTALLERS = {
    ("flodl.rank.__main__", ""),  # python -m flodl.rank
    ("flodl.rank.script_start", "main"),  # python -m flodl.rank.script_start (a script rank)
    ("flodl.worker", "main"),  # python -m flodl.worker (the ``spawn`` fault point)
}


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    found = every_import(ROOT)
    assert len(found) > 300  # the walk read the package (an empty list would pass every rule)
    return found


def _package(module: str) -> str:
    return [*module.split("."), ""][1]


def _where(i: Import) -> str:
    return f"{i.source}:{i.line}{' in ' + i.scope + '()' if i.scope else ''} imports {i.target}"


def test_the_product_imports_test_scaffolding_only_where_an_entry_point_installs_it(imports):
    found = [_where(i) for i in imports if i.target.startswith("flodl.testing") and _package(i.source) != "testing"]
    allowed = [_where(i) for i in imports if i.target.startswith("flodl.testing") and (i.source, i.scope) in INSTALLERS]
    assert sorted(found) == sorted(allowed)
    assert {(i.source, i.scope) for i in imports if i.target == "flodl.testing.probes"} == INSTALLERS  # each installs


def test_nothing_below_the_processes_imports_a_process(imports):
    """plan/, wire/, config/, checkpoint/ and host/ never import controller/, rank/, worker.py or launcher.py."""
    found = [_where(i) for i in imports if _package(i.source) in BELOW_PROCESSES and i.target.startswith(PROCESSES)]
    assert found == []


def test_plan_imports_only_config_the_message_types_and_the_error_taxonomy(imports):
    allowed = ("flodl.plan", "flodl.config", "flodl.wire.messages", "flodl.errors")
    # ``from ..wire import messages`` names the package too: its __init__ imports nothing
    found = [_where(i) for i in imports if _package(i.source) == "plan" and not (i.target.startswith(allowed) or i.target == "flodl.wire")]
    assert found == []


def test_the_product_never_imports_the_simulated_peers(imports):
    assert [_where(i) for i in imports if i.target == "flodl.testing.sim" and _package(i.source) != "testing"] == []
