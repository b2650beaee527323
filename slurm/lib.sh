# shellcheck shell=bash
# lib.sh - functions sourced by slurm/rl.sbatch. Nothing here acts on processes or steps that the job
# did not start itself: steps are stopped through their own srun client (by PID) and, if that does not
# end them, by "scancel JOBID.STEPID" for the steps of *this* job with *our* step names.

mt_log() { # mt_log MSG... : timestamped line to stdout (the sbatch --output file) and $MT_BATCH_LOG
  local line
  line="[rl.sbatch $(date +%H:%M:%S)] $*"
  echo "$line"
  if [ -n "${MT_BATCH_LOG:-}" ]; then echo "$line" >> "$MT_BATCH_LOG"; fi
}

mt_die() { mt_log "ERROR: $*"; exit 1; }

mt_port_base() { # mt_port_base JOBID : first of 10 ports owned by this job (20000..59990)
  echo $((20000 + ($1 % 4000) * 10))
}

mt_step_ids() { # mt_step_ids NAME : ids (JOBID.STEPID) of this job's running steps named NAME
  squeue --noheader --steps --jobs="$SLURM_JOB_ID" --format='%i %j' 2>/dev/null |
    awk -v n="$1" '$2 == n {print $1}'
}

mt_wait_pid() { # mt_wait_pid PID : wait for a child; a trapped signal does not end the wait early
  local pid=$1 rc
  while :; do
    MT_SIGNALLED=0
    rc=0
    wait "$pid" || rc=$?
    if [ "$MT_SIGNALLED" = 0 ]; then return "$rc"; fi
  done
}

mt_wait_pid_timeout() { # mt_wait_pid_timeout PID SECONDS : 0 when PID exited within SECONDS
  local pid=$1 i
  for ((i = 0; i < $2 * 5; i++)); do
    if ! kill -0 "$pid" 2>/dev/null; then wait "$pid" 2>/dev/null || true; return 0; fi
    sleep 0.2
  done
  return 1
}

mt_signal_step() { # mt_signal_step SIGNAL SRUN_PID STEP_NAME : deliver SIGNAL to every task of our step
  # USR1/USR2/...: through the step's own srun, which forwards them to its tasks. TERM/INT: srun would
  # turn them into "forcing job termination" (SIGKILL after KillWait), so they go by "scancel --signal
  # JOBID.STEPID", which only signals. (On a multi-node job scancel also reports an error from the nodes
  # the step does not use, Slurm 22.05, while the signal is delivered: its stderr is dropped.)
  local sig=$1 pid=$2 name=$3 ids
  if [ "$sig" != TERM ] && [ "$sig" != INT ] && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -s "$sig" "$pid" 2>/dev/null || true
    return 0
  fi
  mapfile -t ids < <(mt_step_ids "$name")
  if [ "${#ids[@]}" -gt 0 ]; then scancel --quiet --signal="$sig" "${ids[@]}" 2>/dev/null || true; fi
}

mt_stop_step() { # mt_stop_step SRUN_PID STEP_NAME SECONDS : end one of our steps
  # SIGTERM to its srun: srun sends the tasks SIGTERM, then SIGKILL after KillWait. If srun is still
  # there after SECONDS, the step is cancelled by id.
  local pid=$1 name=$2 timeout=$3 ids
  if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then return 0; fi
  mt_log "stopping step $name (srun pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  if mt_wait_pid_timeout "$pid" "$timeout"; then return 0; fi
  mapfile -t ids < <(mt_step_ids "$name")
  mt_log "step $name did not stop in ${timeout}s; scancel ${ids[*]:-(srun pid $pid)}"
  if [ "${#ids[@]}" -gt 0 ]; then scancel --quiet --signal=KILL "${ids[@]}" 2>/dev/null || true; fi
  if ! mt_wait_pid_timeout "$pid" 10; then kill -KILL "$pid" 2>/dev/null || true; fi
}

mt_abspath() { # mt_abspath PATH : absolute path, relative paths taken from the submit directory
  case "$1" in
    /*) echo "$1" ;;
    *) echo "${SLURM_SUBMIT_DIR:-$PWD}/$1" ;;
  esac
}
