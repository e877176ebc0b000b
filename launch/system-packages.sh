#!/usr/bin/env bash
# Install the system packages some tests need, where they are missing (Debian/Ubuntu, as root).
# Without them those tests skip, saying why; .ci/run runs this first so that CI fails on a failed
# install rather than silently skipping them:
#   chromium         headless browser for the dashboard tests (tests/test_dashboard.py, tests/test_monitor_run.py)
#   openssh-server   sshd inside the network-namespace hosts of tests/test_multihost.py
#   iproute2         `ip netns` / veth / bridge for those hosts (tests/test_multihost.py, tests/test_network.py)
#   slurmctld slurmd slurm-client munge   a one-node Slurm that tests/test_slurm.py starts to run
#                    launch/slurm.sbatch; without recommends (8 packages, ~5 s, against 41 and ~20 s
#                    with the HDF5/IPMI/... plugins it recommends)
#
#   bash launch/system-packages.sh          # installs what is missing; a no-op when all are there
set -euo pipefail
missing=()
command -v chromium >/dev/null || missing+=(chromium)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ip >/dev/null || missing+=(iproute2)
lean=()
for bin in slurmctld slurmd munge; do
    [ -x "/usr/sbin/$bin" ] || [ -x "/usr/bin/$bin" ] || lean+=("$bin")
done
command -v sbatch >/dev/null || lean+=(slurm-client)
if [ $((${#missing[@]} + ${#lean[@]})) -eq 0 ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "system-packages: no apt-get here; install ${missing[*]} ${lean[*]} yourself (those tests skip without them)" >&2
    exit 0
fi
echo "system-packages: installing ${missing[*]} ${lean[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
if [ ${#missing[@]} -gt 0 ]; then apt-get install -y -qq "${missing[@]}" >/dev/null; fi
if [ ${#lean[@]} -gt 0 ]; then apt-get install -y -qq --no-install-recommends "${lean[@]}" >/dev/null; fi
