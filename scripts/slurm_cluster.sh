#!/usr/bin/env bash
# A two-node SLURM cluster on this one machine, for the tests that sbatch real jobs
# (tests/integration/test_slurm_jobs.py) and for trying `qwentitan-launch slurm` by hand.
#
#   scripts/slurm_cluster.sh install   Debian's slurm-wlm and munge (apt-get, as root)
#   scripts/slurm_cluster.sh up        start munged, slurmctld and slurmd n1, n2; wait until idle
#   scripts/slurm_cluster.sh down      stop them and remove what `up` wrote
#
# Root, no systemd, no cgroups: the daemons are started by hand. Nodes n1 and n2 are two slurmd
# on 127.0.0.1 (ports 17001-17002), one CPU each, in partition `debug`; processes are tracked
# through /proc (proctrack/linuxproc), no task binding, no accounting. Everything the cluster
# writes lives under $QWENTITAN_SLURM_DIR (default /tmp/qwentitan-slurm); the config goes to
# /etc/slurm/slurm.conf, where every SLURM command looks, unless a config not written here is
# already there (then `up` refuses).
set -euo pipefail

STATE=${QWENTITAN_SLURM_DIR:-/tmp/qwentitan-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by qwentitan scripts/slurm_cluster.sh"
NODES=(n1 n2)

die() { echo "slurm_cluster.sh: $*" >&2; exit 1; }

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return 0
  [[ $(id -u) == 0 ]] || die "installing slurm-wlm needs root; run it as root or install it yourself."
  command -v apt-get >/dev/null || die "no apt-get here; install slurm-wlm and munge yourself."
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurm-wlm munge >/dev/null
}

write_conf() {
  if [[ -e $CONF ]] && ! grep -qxF "$MARK" "$CONF"; then
    die "$CONF exists and was not written here; this script leaves a real cluster alone."
  fi
  mkdir -p "$STATE/state" "$STATE/log" "$STATE/spool" /etc/slurm
  cat >"$CONF.tmp" <<EOF
$MARK
ClusterName=qwentitan
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire + 1 s before it may start again (default 120 s).
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/state
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmdSpoolDir=$STATE/spool/slurmd-%n
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# Pending jobs (a requeued one, once eligible) start within 2 s, not at the next 30-60 s pass.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
# One CPU per node on a machine with more: register as configured, not as detected.
SlurmdParameters=config_overrides
ReturnToService=2
# Finished jobs stay visible to scontrol for an hour (no accounting keeps them otherwise).
MinJobAge=3600
NodeName=n[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001-17002 CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.tmp" "$CONF"
}

start_munge() {
  [[ -S /run/munge/munge.socket.2 ]] && munge -n >/dev/null 2>&1 && return 0
  mkdir -p /run/munge
  chown munge:munge /run/munge
  runuser -u munge -- munged
  touch "$STATE/munged.ours"  # so that `down` stops only a munged started here
}

# The pid in pid file $1 if that process is still a SLURM daemon (a stale file names no other).
daemon() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == slurm* ]] && echo "$pid"
}

up() {
  command -v slurmctld >/dev/null || die "slurm-wlm is not installed; run '$0 install' first."
  write_conf
  start_munge
  daemon "$STATE/slurmctld.pid" >/dev/null || slurmctld -c  # -c: no jobs of an earlier `up`
  for node in "${NODES[@]}"; do
    daemon "$STATE/slurmd-$node.pid" >/dev/null || slurmd -N "$node"
  done
  for _ in $(seq 100); do
    if [[ $(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l) == "${#NODES[@]}" ]]; then
      sinfo
      return 0
    fi
    sleep 0.2
  done
  sinfo >&2 || true
  die "the nodes did not come up idle within 20 s; see $STATE/log/."
}

down() {
  local pids=() pid file
  for file in "$STATE"/slurmd-*.pid "$STATE/slurmctld.pid"; do
    pid=$(daemon "$file") && pids+=("$pid")
  done
  [[ ${#pids[@]} == 0 ]] || kill "${pids[@]}" 2>/dev/null || true
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
  done
  if [[ -e $STATE/munged.ours ]]; then
    pid=$(cat /run/munge/munged.pid 2>/dev/null) || pid=
    [[ -n $pid && $(cat "/proc/$pid/comm" 2>/dev/null) == munged ]] && kill "$pid"
    rm -f "$STATE/munged.ours"
  fi
  if [[ -e $CONF ]] && grep -qxF "$MARK" "$CONF"; then rm -f "$CONF"; fi
  # $STATE/log stays: the daemons' logs of a failed CI run.
}

case ${1:-} in
  install) install ;;
  up) up ;;
  down) down ;;
  *) die "usage: $0 install|up|down" ;;
esac
