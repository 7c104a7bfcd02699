#!/usr/bin/env bash
# Runs MPI programs across HOSTS "hosts", each a network namespace joined to
# the others by a veth pair on one bridge, Open MPI over TCP only:
#   run_multihost.sh HOSTS NP -- PROGRAM [ARGS...] [-- PROGRAM [ARGS...]]...
# Every program runs as one job of NP ranks spread round-robin over the hosts
# and must exit 0. The namespaces, veths and bridge are removed on any exit.
# Exits 77 (ctest: skipped) when namespaces cannot be created here.
# Programs find each host's link to the others, by name, in $CPD_NETNS_DEVICE.
set -euo pipefail
hosts=$1 np=$2
shift 2
[[ ${1:-} == -- ]] && shift

here=$(cd "$(dirname "$0")" && pwd)
tag="cpd$$"                       # unique per run: parallel runs do not collide
subnet="10.$((100 + $$ % 100)).$(($$ / 100 % 250)).0"
prefix=${subnet%.0}
bridge="${tag}br"
work=$(mktemp -d)

cleanup() {
  for i in $(seq 1 "$hosts"); do
    ip netns del "${tag}h$i" 2>/dev/null || true
    ip link del "${tag}v$i" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

if ! ip netns add "${tag}probe" 2>"$work/err"; then
  echo "SKIP: cannot create network namespaces here ($(cat "$work/err")); needs root and iproute2"
  exit 77
fi
ip netns del "${tag}probe"

# The bridge, with an address for mpiexec (it stays in this namespace).
ip link add "$bridge" type bridge
ip addr add "$prefix.254/24" dev "$bridge"
ip link set "$bridge" up
: > "$work/map"
: > "$work/hostfile"
for i in $(seq 1 "$hosts"); do
  ns="${tag}h$i"
  ip netns add "$ns"
  ip link add "${tag}v$i" type veth peer name eth0 netns "$ns"
  ip link set "${tag}v$i" master "$bridge" up
  ip -n "$ns" addr add "$prefix.$i/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  echo "$prefix.$i $ns" >> "$work/map"
  echo "$prefix.$i slots=$(( (np + hosts - 1) / hosts ))" >> "$work/hostfile"
done
echo "multihost: $hosts namespaces ($prefix.1..$prefix.$hosts) on bridge $bridge"

export CPD_NETNS_MAP="$work/map" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export CPD_NETNS_DEVICE=eth0       # every namespace's end of its veth pair
mpi=(mpiexec --hostfile "$work/hostfile" -n "$np" --map-by node
     --mca plm_rsh_agent "$here/netns_agent.sh" --mca plm_rsh_no_tree_spawn 1
     --mca btl tcp,self --mca btl_tcp_if_include "$prefix.0/24" --mca oob_tcp_if_include "$prefix.0/24"
     --mca pml ob1)
# Open MPI 4.1's daemons now and then crash writing the hardware topology to
# shared memory at an address they guess is free (rtc hwloc): the ranks read
# the topology themselves instead. The daemons stay attached to the launcher,
# so a daemon that fails is reported instead of waited for until the timeout.
mpi+=(--mca rtc_hwloc_vmhole none --mca orte_leave_session_attached 1)
mpi+=(-x CPD_NETNS_DEVICE)
for v in ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS; do [[ -n ${!v:-} ]] && mpi+=(-x "$v"); done

status=0
while (( $# )); do
  cmd=()
  while (( $# )) && [[ $1 != -- ]]; do cmd+=("$1"); shift; done
  (( $# )) && shift
  echo "multihost: ${cmd[*]}"
  if ! timeout 240 "${mpi[@]}" "${cmd[@]}"; then
    echo "multihost: FAILED: ${cmd[*]}"
    status=1
  fi
done
exit $status
