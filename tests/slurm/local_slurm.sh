#!/usr/bin/env bash
# local_slurm.sh - a real Slurm cluster on one Debian 12 machine, for CI.
# (copy of ../shared/tools/local_slurm.sh, shellcheck-clean; the tests under tests/slurm use it)
#
#   local_slurm.sh start      install (if needed), configure, start; idempotent
#   local_slurm.sh install    only install the Debian packages (if needed)
#   local_slurm.sh stop       cancel jobs, stop daemons by pid (munged only if we started it)
#   local_slurm.sh status     daemons + sinfo
#   local_slurm.sh selftest   submit smoke jobs (1 node, 2 nodes, concurrent steps, hetjob,
#                             torchrun+gloo if python3 can import torch)
#   local_slurm.sh purge      stop + remove state dir and generated config
#
# Needs root. No systemd or cgroups. Uses Debian's packages: slurm 22.05.8, munge 0.5.15.
# It emulates N compute nodes "node1".."nodeN" by running one slurmd per node. Debian builds
# slurm with --enable-multiple-slurmd. Each slurmd gets its own port and runs in its own
# UTS+mount namespace (unshare), so jobs on nodeI see hostname=nodeI. In that namespace
# /etc/hosts is bind-mounted with "127.0.10.I nodeI" lines, so
# MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) resolves, and
# torchrun's c10d rendezvous knows which node hosts the store. The real /etc/hosts and
# hostname are not touched. LOCAL_SLURM_NODES=1 uses one node named after the real host
# instead, with no namespaces.
#
# Knobs (environment):
#   LOCAL_SLURM_NODES=2            number of emulated nodes
#   LOCAL_SLURM_CPUS=$(nproc)      CPUs declared per node (may exceed real cores: config_overrides)
#   LOCAL_SLURM_MEM_MB=<80% RAM>   RealMemory per node (not consumed: CR_CPU)
#   LOCAL_SLURM_GPUS=0             fake GPUs per node (gres/gpu on mknod'ed /dev/null copies;
#                                  --gpus-per-node/--gres=gpu:N schedule, CUDA_VISIBLE_DEVICES set)
#   LOCAL_SLURM_PARTITIONS=debug   comma-separated; first is default; all contain all nodes
#   LOCAL_SLURM_ROOT=/var/tmp/local-slurm   state, spool, logs, pid files
#   LOCAL_SLURM_PORT_BASE=17000    slurmd of nodeI listens on PORT_BASE+I; slurmctld on 6817
#   LOCAL_SLURM_CRED_EXPIRE=       AuthInfo=cred_expire=N: step credential lifetime, which is also how
#                                  long a requeued job waits before it may start again (Slurm's default,
#                                  when unset: 120 s; tests that requeue use a few seconds)
set -euo pipefail

NODES=${LOCAL_SLURM_NODES:-2}
CPUS=${LOCAL_SLURM_CPUS:-$(nproc)}
MEM_MB=${LOCAL_SLURM_MEM_MB:-$(awk '/^MemTotal:/{printf "%d", $2/1024*0.8}' /proc/meminfo)}
GPUS=${LOCAL_SLURM_GPUS:-0}
PARTITIONS=${LOCAL_SLURM_PARTITIONS:-debug}
ROOT=${LOCAL_SLURM_ROOT:-/var/tmp/local-slurm}
PORT_BASE=${LOCAL_SLURM_PORT_BASE:-17000}
CRED_EXPIRE=${LOCAL_SLURM_CRED_EXPIRE:-}
CTLD_PORT=6817
CONF=/etc/slurm/slurm.conf
GRES_CONF=/etc/slurm/gres.conf
CTLD_HOST=$(hostname -s)

log() { echo "[local_slurm] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root"

node_names() {
  if [ "$NODES" -le 1 ]; then echo "$CTLD_HOST"; else seq -f 'node%g' 1 "$NODES"; fi
}
alive() { # alive PIDFILE COMM -> true if the pid in PIDFILE is running COMM
  local pid; pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$2" ]
}
wait_gone() { # wait_gone PID SECONDS
  local i; for ((i = 0; i < $2 * 10; i++)); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done; return 1
}
stop_pidfiles() { # stop_pidfiles COMM PIDFILE... : SIGTERM all, wait up to 20s, then SIGKILL
  local comm=$1 f pid pids=(); shift
  for f in "$@"; do
    if alive "$f" "$comm"; then pid=$(cat "$f"); pids+=("$pid"); log "stopping $comm (pid $pid)"; kill -TERM "$pid" 2>/dev/null || true; fi
    rm -f "$f"
  done
  for pid in "${pids[@]}"; do
    wait_gone "$pid" 20 || { log "$comm pid $pid ignored SIGTERM; sending SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; wait_gone "$pid" 5 || true; }
  done
}

install_pkgs() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
     command -v sbatch >/dev/null && command -v munged >/dev/null; then return 0; fi
  log "installing slurmctld slurmd slurm-client munge from Debian"
  local t0=$SECONDS made_policy=0
  # Keep package maintainer scripts from starting daemons (we start them ourselves).
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; made_policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=300 \
    slurmctld slurmd slurm-client munge >/dev/null
  if [ "$made_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  log "installed $(slurmd -V), $(munged --version 2>&1 | head -n1) in $((SECONDS - t0))s"
}

write_config() { # (re)writes /etc/slurm/slurm.conf, gres.conf and $ROOT/hosts
  local nodes_list hosts_tmp conf_tmp gres_tmp i n f first=1 gres=""
  mkdir -p /etc/slurm "$ROOT"/{ctld,spool,log,run}
  nodes_list=$(node_names | paste -sd, -)
  if [ "$GPUS" -gt 0 ]; then gres=" Gres=gpu:$GPUS"; fi
  conf_tmp=$(mktemp); gres_tmp=$(mktemp)
  {
    echo "# generated by local_slurm.sh - do not edit"
    echo "ClusterName=localci"
    echo "SlurmctldHost=${CTLD_HOST}(127.0.0.1)"
    echo "SlurmctldPort=$CTLD_PORT"
    echo "SlurmUser=root"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    if [ -n "$CRED_EXPIRE" ]; then echo "AuthInfo=cred_expire=$CRED_EXPIRE"; fi
    echo "MpiDefault=none"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobCompType=jobcomp/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "SchedulerType=sched/backfill"
    # hetjobs are only started by backfill; sched_interval=2 (default 60): a requeued job starts as soon
    # as its begin time (now + cred_expire) has passed, not up to a minute later
    echo "SchedulerParameters=bf_interval=1,sched_interval=2"
    echo "SlurmdParameters=config_overrides"  # trust declared CPUs/memory
    echo "ReturnToService=2"
    echo "MinJobAge=4"                        # >=4 keeps sbatch --wait polling every 2s (default 300: 2,8,32,32..s)
    echo "KillWait=5"
    echo "InactiveLimit=0"
    echo "MailProg=/bin/true"
    echo "StateSaveLocation=$ROOT/ctld"
    echo "SlurmdSpoolDir=$ROOT/spool/%n"
    echo "SlurmctldPidFile=$ROOT/run/slurmctld.pid"
    echo "SlurmdPidFile=$ROOT/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$ROOT/log/slurmctld.log"
    echo "SlurmdLogFile=$ROOT/log/slurmd-%n.log"
    [ "$GPUS" -gt 0 ] && echo "GresTypes=gpu"
    i=0
    for n in $(node_names); do
      i=$((i + 1))
      if [ "$NODES" -le 1 ]; then
        echo "NodeName=$n NodeAddr=127.0.0.1 Port=$((PORT_BASE + i)) CPUs=$CPUS RealMemory=$MEM_MB$gres State=UNKNOWN"
      else
        echo "NodeName=$n NodeAddr=127.0.10.$i Port=$((PORT_BASE + i)) CPUs=$CPUS RealMemory=$MEM_MB$gres State=UNKNOWN"
      fi
    done
    for p in ${PARTITIONS//,/ }; do
      echo "PartitionName=$p Nodes=$nodes_list Default=$([ $first = 1 ] && echo YES || echo NO) MaxTime=INFINITE State=UP OverSubscribe=NO"
      first=0
    done
  } > "$conf_tmp"
  if [ "$GPUS" -gt 0 ]; then
    # gres/gpu drops GPUs that have no File=; character devices are required, so every
    # fake GPU is a mknod'ed copy of /dev/null (major 1, minor 3)
    mkdir -p "$ROOT/fakedev"
    for ((i = 0; i < GPUS; i++)); do [ -c "$ROOT/fakedev/nvidia$i" ] || mknod "$ROOT/fakedev/nvidia$i" c 1 3; done
    if [ "$GPUS" = 1 ]; then f=nvidia0; else f="nvidia[0-$((GPUS - 1))]"; fi
    echo "NodeName=$nodes_list Name=gpu File=$ROOT/fakedev/$f" > "$gres_tmp"
  fi

  cmp -s "$conf_tmp" "$CONF" || install -m 644 "$conf_tmp" "$CONF"
  if [ "$GPUS" -gt 0 ]; then cmp -s "$gres_tmp" "$GRES_CONF" || install -m 644 "$gres_tmp" "$GRES_CONF"; else rm -f "$GRES_CONF"; fi
  rm -f "$conf_tmp" "$gres_tmp"

  # hosts file that each emulated node sees (real /etc/hosts + node names)
  hosts_tmp=$(mktemp)
  { grep -vE '[[:space:]]node[0-9]+([[:space:]]|$)' /etc/hosts || true
    if [ "$NODES" -gt 1 ]; then for ((i = 1; i <= NODES; i++)); do echo "127.0.10.$i node$i"; done; fi
  } > "$hosts_tmp"
  install -m 644 "$hosts_tmp" "$ROOT/hosts"; rm -f "$hosts_tmp"
}
config_sum() { { cat "$CONF" "$ROOT/hosts"; if [ -e "$GRES_CONF" ]; then cat "$GRES_CONF"; fi; } | sha256sum | cut -d' ' -f1; }

start_munge() {
  if munge -n >/dev/null 2>&1; then log "munged already running"; return 0; fi
  if [ ! -s /etc/munge/munge.key ]; then
    log "creating munge key"
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 status=none
  fi
  chown -R munge:munge /etc/munge; chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  chmod 755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  local i; for ((i = 0; i < 50; i++)); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || die "munged did not come up"
  cp /run/munge/munged.pid "$ROOT/run/munged.pid"   # marks "we started it" for stop
  log "munged started (pid $(cat "$ROOT/run/munged.pid"))"
}

start_ctld() {
  if alive "$ROOT/run/slurmctld.pid" slurmctld; then return 0; fi
  log "starting slurmctld"
  slurmctld                                   # daemonizes; writes pid file
  local i; for ((i = 0; i < 150; i++)); do scontrol ping 2>/dev/null | grep -q 'is UP' && return 0; sleep 0.2; done
  tail -n 30 "$ROOT/log/slurmctld.log" >&2 || true; die "slurmctld did not come up"
}

start_slurmd() { # start_slurmd NODENAME
  local n=$1
  if alive "$ROOT/run/slurmd-$n.pid" slurmd; then return 0; fi
  log "starting slurmd for $n"
  mkdir -p "$ROOT/spool/$n"
  if [ "$NODES" -le 1 ]; then
    slurmd -N "$n"
  else
    # private UTS + mount namespace: hostname=nodeI and an /etc/hosts that knows all nodes
    # shellcheck disable=SC2016  # $1/$2 are expanded by the inner sh
    unshare --mount --uts --propagation private -- /bin/sh -c \
      'mount --bind "$1" /etc/hosts && echo "$2" > /proc/sys/kernel/hostname && exec slurmd -N "$2"' \
      sh "$ROOT/hosts" "$n"
  fi
}

wait_nodes_idle() {
  local i bad
  for ((i = 0; i < 300; i++)); do
    bad=$(sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 !~ /^(idle|mixed|allocated|completing|planned|reserved)$/ {print $1}' | sort -u)
    if [ -z "$bad" ] && [ -n "$(sinfo -h -N -o '%N' 2>/dev/null)" ]; then return 0; fi
    # nodes marked down by an earlier run come back with RESUME once slurmd has registered
    if [ $((i % 25)) = 24 ]; then for n in $bad; do scontrol update NodeName="$n" State=RESUME 2>/dev/null || true; done; fi
    sleep 0.2
  done
  sinfo -N -l >&2 || true; die "nodes not idle: $bad (see $ROOT/log)"
}

do_start() {
  local t0=$SECONDS
  install_pkgs
  if ! [ "$NODES" -le 1 ] && ! unshare --mount --uts -- true 2>/dev/null; then
    die "unshare --mount --uts is not permitted here (needs CAP_SYS_ADMIN); use LOCAL_SLURM_NODES=1"
  fi
  write_config
  # daemons record the config they were started with; on any difference restart from clean state
  if [ "$(config_sum)" != "$(cat "$ROOT/run/config.sum" 2>/dev/null)" ]; then
    log "new or changed config -> (re)starting slurm daemons with clean state"
    stop_slurm_daemons
    rm -rf "${ROOT:?}"/ctld/* "${ROOT:?}"/spool/* "$ROOT/run/config.sum"
  fi
  start_munge
  start_ctld
  for n in $(node_names); do start_slurmd "$n"; done
  wait_nodes_idle
  config_sum > "$ROOT/run/config.sum"
  log "cluster up in $((SECONDS - t0))s: $(sinfo -h -o '%P %D %T %N' | paste -sd';' -)"
}

stop_slurm_daemons() { # slurmds and slurmctld in parallel; slurmctld takes ~5s to exit
  local f sd=()
  for f in "$ROOT"/run/slurmd-*.pid; do if [ -e "$f" ]; then sd+=("$f"); fi; done
  if [ ${#sd[@]} -gt 0 ]; then stop_pidfiles slurmd "${sd[@]}" & fi
  stop_pidfiles slurmctld "$ROOT/run/slurmctld.pid"
  wait
}

do_stop() {
  if alive "$ROOT/run/slurmctld.pid" slurmctld; then
    local ids i
    mapfile -t ids < <(squeue -h -o %A 2>/dev/null | sort -u)
    if [ ${#ids[@]} -gt 0 ]; then
      log "cancelling jobs: ${ids[*]}"; scancel "${ids[@]}" || true
      for ((i = 0; i < 100; i++)); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
    fi
  fi
  stop_slurm_daemons
  if [ -e "$ROOT/run/munged.pid" ]; then stop_pidfiles munged "$ROOT/run/munged.pid"; fi
  log "stopped"
}

do_status() {
  local f
  for f in "$ROOT"/run/*.pid; do if [ -e "$f" ]; then echo "$(basename "$f" .pid): pid $(cat "$f")"; fi; done
  sinfo -N -l 2>/dev/null || echo "slurmctld not reachable"
}

do_selftest() {
  local d rc=0 nn
  d=$(mktemp -d "$ROOT/selftest.XXXXXX"); cd "$d"
  nn=$(sinfo -h -N -o %N | sort -u | wc -l)
  # 1) one node, two tasks
  cat > one.sbatch <<'EOF'
#!/bin/bash
#SBATCH --nodes=1 --ntasks-per-node=2 --time=2 --output=one.out
srun python3 -c 'import os; print("procid", os.environ["SLURM_PROCID"])'
EOF
  sbatch --wait one.sbatch >/dev/null || rc=1
  [ "$(grep -c '^procid' one.out)" = 2 ] || { log "one-node job failed"; cat one.out >&2; rc=1; }
  # 2) all nodes + multi-node idiom + concurrent steps on different nodes + hetjob
  cat > multi.sbatch <<EOF
#!/bin/bash
#SBATCH --nodes=$nn --ntasks-per-node=1 --cpus-per-task=1 --time=2 --output=multi.out
set -e
MASTER_ADDR=\$(scontrol show hostnames "\$SLURM_JOB_NODELIST" | head -n1)
getent hosts "\$MASTER_ADDR"
srun bash -c 'echo "task \$SLURM_PROCID on \$(hostname)"'
for n in \$(scontrol show hostnames "\$SLURM_JOB_NODELIST"); do
  srun --nodes=1 --ntasks=1 --exclusive --nodelist=\$n bash -c 'sleep 1; echo "step \$SLURM_STEP_ID on \$SLURMD_NODENAME"' &
done
wait
EOF
  sbatch --wait multi.sbatch >/dev/null || rc=1
  [ "$(grep -c '^step ' multi.out)" = "$nn" ] || { log "multi-node job failed"; cat multi.out >&2; rc=1; }
  if [ "$nn" -ge 2 ]; then
    cat > het.sbatch <<'EOF'
#!/bin/bash
#SBATCH --nodes=1 --ntasks=1 --time=2 --output=het.out
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1
srun --het-group=0 bash -c 'echo "server on $(hostname)"' &
srun --het-group=1 bash -c 'echo "trainer on $(hostname)"'
wait
EOF
    sbatch --wait het.sbatch >/dev/null || rc=1
    if ! { grep -q '^server' het.out && grep -q '^trainer' het.out; }; then log "hetjob failed"; cat het.out >&2; rc=1; fi
  fi
  # 3) torchrun (c10d rendezvous) + gloo all_reduce across nodes, if torch is importable
  if python3 -c 'import torch' 2>/dev/null; then
    cat > ar.py <<'EOF'
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo"); w = dist.get_world_size(); t = torch.ones(1); dist.all_reduce(t)
assert t.item() == w; sys.stdout.write(f"allreduce ok rank {dist.get_rank()} of {w}\n"); sys.stdout.flush()
dist.barrier(); dist.destroy_process_group()
EOF
    cat > tr.sbatch <<EOF
#!/bin/bash
#SBATCH --nodes=$nn --ntasks-per-node=1 --time=5 --output=tr.out
MASTER_ADDR=\$(scontrol show hostnames "\$SLURM_JOB_NODELIST" | head -n1)
srun torchrun --nnodes=\$SLURM_NNODES --nproc_per_node=2 --rdzv_id=\$SLURM_JOB_ID \
  --rdzv_backend=c10d --rdzv_endpoint=\$MASTER_ADDR:29500 ar.py
EOF
    sbatch --wait tr.sbatch >/dev/null || rc=1
    [ "$(grep -o 'allreduce ok' tr.out | wc -l)" = $((2 * nn)) ] || { log "torchrun job failed"; tail -n 40 tr.out >&2; rc=1; }
  else
    log "torch not importable by python3: skipping torchrun test"
  fi
  cat ./*.out
  if [ $rc = 0 ]; then log "selftest PASSED ($d)"; else log "selftest FAILED ($d)"; fi
  return $rc
}

case "${1:-start}" in
  start) do_start ;;
  install) install_pkgs ;;
  stop) do_stop ;;
  restart) do_stop; do_start ;;
  status) do_status ;;
  selftest) do_selftest ;;
  purge) do_stop; rm -rf "${ROOT:?}"; rm -f "$CONF" "$GRES_CONF" ;;
  *) echo "usage: $0 {start|install|stop|restart|status|selftest|purge}" >&2; exit 2 ;;
esac
