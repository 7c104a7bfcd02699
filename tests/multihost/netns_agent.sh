#!/usr/bin/env bash
# Open MPI's launcher agent (--mca plm_rsh_agent) for hosts that are network
# namespaces on this machine: called as `netns_agent.sh HOST COMMAND...` like
# ssh, it runs COMMAND inside the namespace whose address is HOST. The map
# (lines "ADDRESS NAMESPACE") is in $CPD_NETNS_MAP. On real hosts the agent
# is plain ssh and this file is not used.
set -euo pipefail
host=$1
shift
ns=$(awk -v h="$host" '$1 == h { print $2 }' "${CPD_NETNS_MAP:?CPD_NETNS_MAP is not set}")
if [[ -z $ns ]]; then
  echo "netns_agent: no namespace for host $host in $CPD_NETNS_MAP" >&2
  exit 1
fi
# Each host its own temporary directory, as on separate machines: Open MPI
# names its session directories by host name, which the namespaces share, and
# daemons creating one directory at once fail.
tmp="$(dirname "$CPD_NETNS_MAP")/$ns.tmp"
mkdir -p "$tmp"
exec env TMPDIR="$tmp" ip netns exec "$ns" /bin/sh -c "$*"
