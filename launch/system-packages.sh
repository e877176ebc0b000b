#!/usr/bin/env bash
# Install the system packages some tests need, where they are missing (Debian/Ubuntu, as root).
# Without them those tests skip, saying why; .ci/run runs this first so that CI fails on a failed
# install rather than silently skipping them:
#   chromium         headless browser for the dashboard tests (tests/test_dashboard.py, tests/test_monitor_run.py)
#   openssh-server   sshd inside the network-namespace hosts of tests/test_multihost.py
#   iproute2         `ip netns` / veth / bridge for those hosts (tests/test_multihost.py, tests/test_network.py)
#
#   bash launch/system-packages.sh          # installs what is missing; a no-op when all are there
set -euo pipefail
missing=()
command -v chromium >/dev/null || missing+=(chromium)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ip >/dev/null || missing+=(iproute2)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "system-packages: no apt-get here; install ${missing[*]} yourself (those tests skip without them)" >&2
    exit 0
fi
echo "system-packages: installing ${missing[*]}"
apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
