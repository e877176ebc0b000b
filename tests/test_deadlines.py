"""The run's deadlines, derived in one place from heartbeat_timeout_secs and snapshot_timeout_secs."""

from __future__ import annotations

import pytest

from flodl.config import DdpRunConfig
from flodl.config.deadlines import Deadlines

pytestmark = pytest.mark.timeout(30)


def test_the_default_config_gives_the_values_the_modules_used_to_compute():
    d = Deadlines.from_config(DdpRunConfig())  # heartbeat 30 s, snapshot 5 s
    assert (d.heartbeat_timeout_s, d.collective_s, d.snapshot_s) == (30.0, 30.0, 5.0)
    assert d.verdict_wait_s == 30.0  # a failed rank waits one heartbeat timeout for its Shutdown
    assert d.relay_round_s == 60.0  # 2 x heartbeat
    assert d.regroup_wait_s == 70.0  # 2 x heartbeat + 10
    assert d.group_gather_s == 130.0  # 2 x collective + 2 x heartbeat + 10
    assert d.snapshot_wait_s == 30.0  # max(collective, 2 x snapshot)


def test_every_deadline_follows_the_user_settings():
    d = Deadlines.from_config(DdpRunConfig().with_heartbeat_timeout_secs(4).with_snapshot_timeout_secs(20))
    assert (d.heartbeat_timeout_s, d.collective_s, d.snapshot_s) == (4.0, 4.0, 20.0)
    assert (d.verdict_wait_s, d.relay_round_s, d.regroup_wait_s, d.group_gather_s) == (4.0, 8.0, 18.0, 26.0)
    assert d.snapshot_wait_s == 40.0  # twice the controller's round timeout: its abort decides, not the rank


def test_a_rank_builds_them_from_what_it_is_told():
    early = Deadlines(heartbeat_timeout_s=3.0)  # before the welcome: the heartbeat only
    assert early.collective_s == 3.0 and early.group_gather_s == 2 * 3 + 2 * 3 + 10
    with pytest.raises(ValueError, match="snapshot_s"):
        _ = early.snapshot_wait_s
    told = Deadlines(heartbeat_timeout_s=3.0, collective_s=7.0, snapshot_s=1.0)
    assert told.group_gather_s == 2 * 7 + 2 * 3 + 10 and told.regroup_wait_s == 16.0 and told.snapshot_wait_s == 7.0


def test_a_heartbeat_must_be_positive():
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        Deadlines(heartbeat_timeout_s=0.0)


def test_describe_names_every_deadline_once():
    line = Deadlines.from_config(DdpRunConfig()).describe()
    assert line == (
        "heartbeat 30 s, collective 30 s, rank verdict wait 30 s, relay round 60 s, regroup wait 70 s, "
        "group gather 130 s, averaging round 5 s, rank snapshot wait 30 s"
    )
    assert "snapshot" not in Deadlines(heartbeat_timeout_s=30.0).describe()  # a worker does not know it


def test_the_heartbeat_timeout_has_one_name_in_the_code():
    """The option is ``heartbeat_timeout_secs`` (its TOML key and flag); everywhere inside, the
    deadlines, the progress limits, membership, the rank's environment and the wire, the quantity is
    ``heartbeat_timeout_s`` (it was also ``heartbeat_s``, and the worker stored its join timeout
    under it)."""
    import re
    from pathlib import Path

    import flodl

    names = set()
    for path in Path(flodl.__file__).parent.rglob("*.py"):
        names.update(re.findall(r"\b[a-z_]*heartbeat[a-z_]*_(?:s|secs|ms)\b", path.read_text()))
    assert names == {"heartbeat_timeout_s", "heartbeat_timeout_secs", "effective_heartbeat_timeout_secs", "with_heartbeat_timeout_secs"}
