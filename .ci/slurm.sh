#!/usr/bin/env bash
# A one-node Slurm cluster on this host for the test suite (tests/slurm): Debian's slurm-wlm and
# munge, a slurm.conf generated for this host, munged / slurmctld / slurmd started as this user.
#
#   source .ci/slurm.sh; slurm_up DIR && trap slurm_down EXIT     (exports SLURM_CONF)
#
# Everything but the packages lives under DIR (config, spool, state, logs, pid files). slurm_up
# returns non-zero (and the Slurm tests skip) when the packages cannot be installed or a daemon
# does not come up; the reason is printed.

slurm_install() {
  command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 && return 0
  command -v apt-get >/dev/null 2>&1 || { echo "slurm: no apt-get here; Slurm tests will skip" >&2; return 1; }
  local sudo=""; [[ "$(id -u)" == 0 ]] || sudo="sudo -n"
  if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq slurm-wlm munge; } \
      >"${SLURM_CI_DIR:-/tmp}/apt.log" 2>&1; then
    echo "slurm: apt-get install slurm-wlm munge failed (log: ${SLURM_CI_DIR:-/tmp}/apt.log); Slurm tests will skip" >&2
    return 1
  fi
}

slurm_write_conf() {
  local dir="$1" host cpus mem user
  # not nproc: it obeys OMP_NUM_THREADS, which .ci/run sets to 1
  host="$(hostname -s)"; cpus="$(getconf _NPROCESSORS_ONLN)"; user="$(id -un)"
  mem="$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)"
  mkdir -p "$dir/spool/ctld" "$dir/spool/d" "$dir/log" "$dir/run"
  cat >"$dir/slurm.conf" <<CONF
ClusterName=ci
SlurmctldHost=$host
SlurmUser=$user
SlurmdUser=$user
SlurmctldPort=$((6800 + RANDOM % 400))
SlurmdPort=$((7300 + RANDOM % 400))
AuthType=auth/munge
AuthInfo=cred_expire=5
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=20
MinJobAge=600
StateSaveLocation=$dir/spool/ctld
SlurmdSpoolDir=$dir/spool/d
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=cpu Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
}

slurm_up() {
  local dir="$1"
  export SLURM_CI_DIR="$dir"
  mkdir -p "$dir"
  slurm_install || return 1
  slurm_write_conf "$dir"
  export SLURM_CONF="$dir/slurm.conf"
  mkdir -p /run/munge
  if ! pgrep -x munged >/dev/null 2>&1; then
    munged --force --socket=/run/munge/munge.socket.2 --pid-file="$dir/run/munged.pid" \
      --log-file="$dir/log/munged.log" 2>>"$dir/log/munged.log" || { echo "slurm: munged did not start" >&2; return 1; }
  fi
  slurmctld -i -f "$SLURM_CONF" || { echo "slurm: slurmctld did not start (log: $dir/log/slurmctld.log)" >&2; return 1; }
  slurmd -f "$SLURM_CONF" || { echo "slurm: slurmd did not start (log: $dir/log/slurmd.log)" >&2; return 1; }
  local i
  for i in $(seq 60); do
    if sinfo -h -o '%t' 2>/dev/null | grep -qx 'idle'; then echo "slurm: up (SLURM_CONF=$SLURM_CONF)"; return 0; fi
    sleep 1
  done
  echo "slurm: the node did not become idle in 60 s (logs: $dir/log)" >&2
  return 1
}

slurm_down() {
  local dir="${SLURM_CI_DIR:-}" name pid i
  [[ -n "$dir" ]] || return 0
  for name in slurmd slurmctld; do  # munged stays: a system service other programs may use
    pid="$(cat "$dir/run/$name.pid" 2>/dev/null)" || continue
    kill "$pid" 2>/dev/null || continue
    for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  done
  return 0
}
