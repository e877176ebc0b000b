"""A shaped link does what it says: ``bench/netns.py``'s ``Shaper`` caps the bandwidth and adds the delay.

Two namespace hosts (``flodl-wlt1``, ``flodl-wlt2``, 10.84.0.11-12) on a bridge of their own
(``flodl-wltbr0``), no sshd; ``link_probe`` times TCP round trips and a bulk transfer between
them, before, during and after the shaping. ``bench/wan.py`` builds its links the same way.
Needs root and iproute2; skips, saying why, without them.
"""

from __future__ import annotations

import pytest

from bench.netns import Netem, NsHost, Shaper, link_probe, make_hosts, teardown_hosts, unusable_reason

pytestmark = pytest.mark.timeout(120)

BRIDGE = "flodl-wltbr0"
A, B = (NsHost(f"flodl-wlt{i}", f"10.84.0.1{i}", f"flodl-wltv{i}") for i in (1, 2))
RATE = 20.0  # Mbit/s: slow enough that this VM's relay and TCP reach it, fast enough to be quick
#: 2.5 s at RATE: the relay (a Python process on a loaded VM) may hold a few hundred KB back and release
#: them at once, which over a short transfer reads as more than the cap (22.9 Mbit/s over 2.25 MB, once)
BULK = 6 << 20


@pytest.fixture(scope="module")
def hosts():
    reason = unusable_reason(sshd=False)
    if reason:
        pytest.skip(f"namespace hosts unavailable: {reason}")
    teardown_hosts([A, B], BRIDGE)  # what a killed earlier session left
    try:
        make_hosts([A, B], BRIDGE, None)
        yield [A, B]
    finally:
        teardown_hosts([A, B], BRIDGE)


def test_a_rate_capped_link_carries_its_rate_and_delays_by_its_delay(hosts):
    """Egress 30 ms, ingress capped at 20 Mbit/s: A -> B crosses A's delay and B's cap, so the bulk rate reads
    the cap (TCP's payload: ~95% of what the wire carries) and a round trip two delays; both go with the Shaper."""
    clean = link_probe(A, B, 16 << 20)
    with Shaper(hosts, BRIDGE, egress=Netem(delay_ms=30), ingress=Netem(rate_mbit=RATE)) as shaper:
        shaped = link_probe(A, B, BULK)
    after = link_probe(A, B, 16 << 20)
    print(f"clean: {clean}; {shaper}: {shaped}; after: {after}")
    assert 0.8 * RATE <= shaped.mbit <= 1.1 * RATE, f"{shaper}: {shaped}"
    assert 60 <= shaped.rtt_ms < 120, f"{shaper}: {shaped}"  # 30 ms each way (the relay's hop adds well under a ms)
    for unshaped in (clean, after):  # the cap is the Shaper's, and gone once it is
        assert unshaped.mbit > 3 * RATE and unshaped.rtt_ms < 10, unshaped


def test_an_egress_cap_holds_what_a_host_sends(hosts):
    """The cap on a host's own sends (``tc tbf`` on its ``eth0``, or netem's rate), with no delay anywhere."""
    with Shaper(hosts, BRIDGE, egress=Netem(rate_mbit=RATE)) as shaper:
        shaped = link_probe(B, A, BULK)
    print(f"{shaper}: {shaped}")
    assert 0.8 * RATE <= shaped.mbit <= 1.1 * RATE and shaped.rtt_ms < 10, f"{shaper}: {shaped}"


def test_a_link_rate_reads_as_tc_would_take_it():
    assert Netem(delay_ms=50, rate_mbit=100).tc_args() == ["delay", "50ms", "rate", "100mbit"]
    assert Netem(rate_mbit=20).tc_args() == ["rate", "20mbit"] and str(Netem(rate_mbit=20)) == "rate 20mbit"
    assert Netem(rate_mbit=20).spec() == "0,0,0"  # the relay leaves the cap to the kernel's token bucket
    assert not Netem(rate_mbit=20).idle and Netem().idle
    tbf = Netem(rate_mbit=1000).tbf_args()
    assert tbf[:3] == ["tbf", "rate", "1000mbit"] and int(tbf[tbf.index("burst") + 1]) == 125_000  # a millisecond's bytes
    with pytest.raises(ValueError, match="rate_mbit"):
        Netem(rate_mbit=-1)
