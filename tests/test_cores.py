"""Cores of a host shared by GPU and CPU ranks (flodl/host/cores.py): pure logic."""

from __future__ import annotations

import pytest

from flodl.host.cores import core_plan, format_cores, parse_cores

pytestmark = pytest.mark.timeout(30)


def test_a_gpu_rank_keeps_cores_of_its_own_and_cpu_ranks_split_the_rest():
    plan = core_plan(["cuda:0", "cpu", "cpu", "cpu"], list(range(16)))
    assert plan == [[0, 1], [2, 3, 4, 5, 6], [7, 8, 9, 10, 11], [12, 13, 14, 15]]
    assert sorted(c for cores in plan for c in cores) == list(range(16))  # every core used, none twice


def test_a_small_host_gives_a_gpu_rank_one_core_before_a_cpu_rank_none():
    assert core_plan(["cuda:0", "cpu", "cpu"], [0, 1, 2]) == [[0], [1], [2]]
    assert core_plan(["cuda:0", "cuda:1", "cpu"], [0, 1, 2, 3, 4]) == [[0, 1], [2, 3], [4]]


def test_ranks_of_one_kind_or_too_few_cores_stay_unpinned():
    assert core_plan(["cpu", "cpu"], [0, 1]) is None
    assert core_plan(["cuda:0", "cuda:1"], list(range(8))) is None
    assert core_plan(["cuda:0", "cpu", "cpu"], [0, 1]) is None


def test_core_lists_read_and_write_as_taskset_does():
    assert format_cores([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and parse_cores("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    with pytest.raises(ValueError, match="core list"):
        parse_cores("3-1")


def test_a_rank_pins_itself_to_its_cores_and_a_bad_set_leaves_it_unpinned():
    """rank/building.py ``pin_cores``, in a process of its own (this one's affinity stays as it is)."""
    import json
    import os
    import subprocess
    import sys

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity on this platform")
    code = (
        "import json, os; from flodl.rank.building import pin_cores; "
        "got = pin_cores({!r}, 0); print(json.dumps([got, sorted(os.sched_getaffinity(0))]))"
    )
    first = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", code.format(str(first))], capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout) == [[first], [first]]
    out = subprocess.run([sys.executable, "-c", code.format("9999")], capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout)[0] == [] and "not pinned to cores 9999" in out.stderr
