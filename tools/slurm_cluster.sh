#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for the real-SLURM test tier (tests/slurm/).
#
#   bash tools/slurm_cluster.sh up       # install if missing, configure, start, wait for 2 idle nodes
#   bash tools/slurm_cluster.sh status   # exit 0 when both nodes answer; prints SLURM_CONF to export
#   bash tools/slurm_cluster.sh down     # stop the daemons this script started (safe when none are)
#
# Debian's slurm-wlm 22.05 is built with MULTIPLE_SLURMD: two slurmd (node1, node2) on one host,
# each on its own port, share its cores (OverSubscribe). Each node has its own loopback address
# (node1 127.0.0.1, node2 127.0.0.2, in /etc/hosts): servers bind to their node's name, so one
# port on two nodes (the colocated shape: a server per node on the same port) must not collide. Needs root (apt-get, the
# daemons, /etc/hosts). Everything lives under one root (--root DIR or MOE_RL_SLURM_ROOT, default
# /var/tmp/moe_rl_slurm): slurm.conf, a private munged and its socket, state, spool, logs, pid files.
# Nothing global is rewritten: the daemons and clients read that slurm.conf through SLURM_CONF /
# -f, and /etc/hosts only gains the node1/node2 lines it lacks. `down` signals only the processes
# whose pid files this script wrote, never a daemon found by name.
set -euo pipefail

usage() {
  echo "usage: $0 up|status|down [--root DIR]  (default root: /var/tmp/moe_rl_slurm)" >&2
  exit 2
}

(( $# >= 1 )) || usage
ACTION=$1; shift
ROOT=${MOE_RL_SLURM_ROOT:-/var/tmp/moe_rl_slurm}
while (( $# )); do
  case $1 in
    --root) (( $# >= 2 )) || usage; ROOT=$2; shift 2 ;;
    *) usage ;;
  esac
done

NODES=(node1 node2)
NODE_ADDRS=(127.0.0.1 127.0.0.2)
NODE_PORTS=(17001 17002)
CTLD_PORT=16817                 # not the default 6817, so a site slurmctld on this host is no clash
# Each node declares 4 CPUs (more than this host has; config_overrides below keeps slurmd from draining
# it): the rehearsal's trainer is 4 gloo ranks on one node, one task and one CPU each.
CPUS_PER_NODE=4
HEALTH_TIMEOUT=${MOE_RL_SLURM_HEALTH_TIMEOUT:-60}
CONF="$ROOT/etc/slurm.conf"
MUNGE_DIR="$ROOT/munge"
MUNGE_SOCKET="$MUNGE_DIR/munge.socket"
export SLURM_CONF="$CONF"

log() { echo "slurm_cluster: $*" >&2; }
die() { log "$*"; exit 1; }

# ------------------------------------------------------------------ install
need_root() {
  (( EUID == 0 )) || die "needs root (apt-get, the daemons and /etc/hosts); run it as root or skip the real-SLURM tier"
}

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurmctld)
  command -v slurmd >/dev/null || missing+=(slurmd)
  command -v sbatch >/dev/null || missing+=(slurm-client)
  command -v munged >/dev/null || missing+=(munge)
  (( ${#missing[@]} )) || return 0
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
  log "installing ${missing[*]} (apt-get; log: $ROOT/log/apt.log)"
  mkdir -p "$ROOT/log"
  # policy-rc.d 101: the packages' postinst must not start the system daemons with /etc/slurm's
  # config; ours start below, from this root. The file is removed again if this script made it.
  local made_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    made_policy=1
  fi
  local rc=0
  { DEBIAN_FRONTEND=noninteractive apt-get update -q \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
           slurmctld slurmd slurm-client munge; } > "$ROOT/log/apt.log" 2>&1 || rc=$?
  if (( made_policy )); then rm -f /usr/sbin/policy-rc.d; fi
  (( rc == 0 )) || die "apt-get failed (exit $rc): see $ROOT/log/apt.log"
}

# ------------------------------------------------------------------ configuration
add_hosts() {
  # The job script uses node names as host names (MASTER_ADDR=node1, servers bound to their
  # node's name): they must resolve, each to its node's address.
  local i node addr have
  for i in "${!NODES[@]}"; do
    node=${NODES[i]}; addr=${NODE_ADDRS[i]}
    have=$(getent ahostsv4 "$node" 2>/dev/null | awk 'NR == 1 {print $1}' || true)
    if [[ -z $have ]]; then
      log "adding '${addr} ${node}' to /etc/hosts"
      echo "${addr} ${node}" >> /etc/hosts
    elif [[ $have != "$addr" ]]; then
      die "${node} resolves to ${have}, this cluster needs ${addr}: change that line of /etc/hosts (or its other source) to '${addr} ${node}'"
    fi
  done
}

write_munge_key() {
  mkdir -p "$MUNGE_DIR"
  chmod 700 "$MUNGE_DIR"
  if [[ ! -s "$MUNGE_DIR/munge.key" ]]; then
    # munge's own key generator where it exists (munge >= 0.5.14); 1 KiB of urandom otherwise
    if command -v mungekey >/dev/null; then
      mungekey --create --keyfile="$MUNGE_DIR/munge.key" --force
    else
      dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
    fi
  fi
  chmod 400 "$MUNGE_DIR/munge.key"
}

write_conf() {
  mkdir -p "$ROOT/etc" "$ROOT/state" "$ROOT/spool" "$ROOT/log" "$ROOT/run"
  local host
  host=$(hostname -s)
  # Short timeouts keep the tests quick; cred_expire is also how long a requeued job waits
  # before it may start again (120 s by default).
  cat > "$CONF" <<EOF
# Written by tools/slurm_cluster.sh: a two-node cluster on one host (MULTIPLE_SLURMD).
ClusterName=moe_rl_test
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmdPort=${NODE_PORTS[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
AuthInfo=socket=${MUNGE_SOCKET},cred_expire=10
StateSaveLocation=${ROOT}/state
SlurmdSpoolDir=${ROOT}/spool/slurmd.%n
SlurmctldPidFile=${ROOT}/run/slurmctld.pid
SlurmdPidFile=${ROOT}/run/slurmd.%n.pid
SlurmctldLogFile=${ROOT}/log/slurmctld.log
SlurmdLogFile=${ROOT}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# the main loop every 2 s (60 s by default): a requeued job starts as soon as it is eligible
SchedulerParameters=sched_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# No slurmdbd: the final state of each job is appended here (JobState=..., ExitCode=...).
JobCompType=jobcomp/filetxt
JobCompLoc=${ROOT}/log/jobcomp.txt
JobRequeue=1
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
# the nodes' CPUs are the ones declared here, not the host's (both nodes share its cores)
SlurmdParameters=config_overrides
SlurmctldTimeout=10
SlurmdTimeout=30
MessageTimeout=5
KillWait=5
InactiveLimit=0
MinJobAge=300
Waittime=0
NodeName=${NODES[0]} NodeHostname=${host} NodeAddr=${NODE_ADDRS[0]} Port=${NODE_PORTS[0]} CPUs=${CPUS_PER_NODE} State=UNKNOWN
NodeName=${NODES[1]} NodeHostname=${host} NodeAddr=${NODE_ADDRS[1]} Port=${NODE_PORTS[1]} CPUs=${CPUS_PER_NODE} State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

# ------------------------------------------------------------------ daemons
# A pid file names a process this script started when the pid is alive and runs that program.
running() {
  local pidfile=$1 prog=$2 pid
  [[ -s $pidfile ]] || return 1
  pid=$(<"$pidfile")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$prog" ]]
}

start_munged() {
  running "$MUNGE_DIR/munged.pid" munged && return 0
  munged --socket="$MUNGE_SOCKET" --key-file="$MUNGE_DIR/munge.key" \
    --pid-file="$MUNGE_DIR/munged.pid" --log-file="$ROOT/log/munged.log" \
    --seed-file="$MUNGE_DIR/munged.seed" --force \
    || die "munged did not start: see $ROOT/log/munged.log"
}

start_slurmctld() {
  running "$ROOT/run/slurmctld.pid" slurmctld && return 0
  # -c: a fresh state each bring-up (no jobs left from an earlier cluster)
  slurmctld -c -f "$CONF" || die "slurmctld did not start: see $ROOT/log/slurmctld.log"
}

start_slurmd() {
  local node=$1
  running "$ROOT/run/slurmd.${node}.pid" slurmd && return 0
  mkdir -p "$ROOT/spool/slurmd.${node}"
  slurmd -f "$CONF" -N "$node" || die "slurmd -N ${node} did not start: see $ROOT/log/slurmd.${node}.log"
}

wait_idle() {
  local deadline=$(( SECONDS + HEALTH_TIMEOUT )) states
  while (( SECONDS < deadline )); do
    states=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true)
    if [[ $(grep -cE '^node[12] idle$' <<<"$states") == 2 ]]; then return 0; fi
    sleep 1
  done
  die "both nodes not idle after ${HEALTH_TIMEOUT}s (sinfo: ${states:-no answer}); see $ROOT/log/slurmctld.log, $ROOT/log/slurmd.node1.log, $ROOT/log/slurmd.node2.log"
}

stop_pidfile() {
  local pidfile=$1 prog=$2 pid deadline
  if running "$pidfile" "$prog"; then
    pid=$(<"$pidfile")
    log "stopping ${prog} (pid ${pid})"
    kill -TERM "$pid"
    deadline=$(( SECONDS + 15 ))
    while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$pidfile"
}

# ------------------------------------------------------------------ actions
up() {
  need_root
  mkdir -p "$ROOT/log"
  install_packages
  add_hosts
  write_munge_key
  if ! running "$ROOT/run/slurmctld.pid" slurmctld; then write_conf; fi
  start_munged
  start_slurmctld
  local node
  for node in "${NODES[@]}"; do start_slurmd "$node"; done
  wait_idle
  log "up: ${NODES[*]} idle; export SLURM_CONF=${CONF}"
}

status() {
  [[ -f $CONF ]] || { log "no cluster configured under ${ROOT}"; return 1; }
  running "$ROOT/run/slurmctld.pid" slurmctld || { log "slurmctld is not running"; return 1; }
  sinfo -N -o '%N %T %C' || return 1
  echo "export SLURM_CONF=${CONF}"
}

# The cluster's own jobs go first (slurmd leaves running job steps behind when it stops).
cancel_jobs() {
  running "$ROOT/run/slurmctld.pid" slurmctld || return 0
  local jobs deadline=$(( SECONDS + 30 ))
  mapfile -t jobs < <(squeue -h -o '%A' 2>/dev/null || true)
  (( ${#jobs[@]} )) || return 0
  log "cancelling jobs ${jobs[*]}"
  scancel "${jobs[@]}" || true
  while [[ -n $(squeue -h -o '%A' 2>/dev/null) ]] && (( SECONDS < deadline )); do sleep 1; done
}

down() {
  local node
  cancel_jobs
  for node in "${NODES[@]}"; do stop_pidfile "$ROOT/run/slurmd.${node}.pid" slurmd; done
  stop_pidfile "$ROOT/run/slurmctld.pid" slurmctld
  stop_pidfile "$MUNGE_DIR/munged.pid" munged
  log "down"
}

case $ACTION in
  up) up ;;
  status) status ;;
  down) down ;;
  *) usage ;;
esac
