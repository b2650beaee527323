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

mt_port_base() { # mt_port_base JOBID : first of 16 ports owned by this job (10000..21999)
  # Below SGLang's NCCL port picker (22000..29999, sglang/srt/utils/network.py) and Linux's ephemeral
  # range (32768..60999 by default), from which the kernel hands out outgoing ports.
  echo $((10000 + ($1 % 750) * 16))
}

mt_stop_timer() { # mt_stop_timer BUDGET PID : background sleeper that sends USR1 to PID BUDGET s before
  # the job's time limit (squeue's end time); prints its pid, or nothing without a limit or time for it
  local end now delay
  end=$(squeue --noheader --jobs="$SLURM_JOB_ID" --format=%e 2> /dev/null | head -n 1)
  end=$(date -d "$end" +%s 2> /dev/null) || return 0
  now=$(date +%s)
  delay=$((end - now - $1))
  if [ "$delay" -le 0 ]; then return 0; fi
  (
    trap 'kill "$s" 2> /dev/null; exit 0' TERM
    sleep "$delay" &
    s=$!
    wait "$s" && kill -USR1 "$2"
  ) > /dev/null 2>&1 &
  echo $!
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
  # turn them into "forcing job termination" (SIGKILL at once), so they go by "scancel --signal JOB.STEP"
  # (the tasks get the signal, then SIGKILL after KillWait if they are still there). On a multi-node job
  # Slurm 22.05's scancel also reports an error from the nodes the step does not use while the signal is
  # delivered, so its stderr is dropped.
  local sig=$1 pid=$2 name=$3 ids=()
  if [ "$sig" = TERM ] || [ "$sig" = INT ]; then mapfile -t ids < <(mt_step_ids "$name"); fi
  if [ "${#ids[@]}" -gt 0 ]; then
    scancel --quiet --signal="$sig" "${ids[@]}" 2>/dev/null || true
  elif [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -s "$sig" "$pid" 2>/dev/null || true
  fi
}

mt_stop_step() { # mt_stop_step SRUN_PID STEP_NAME SECONDS : end one of our steps
  # SIGTERM to the tasks; after SECONDS, SIGTERM to srun (which kills the step), then SIGKILL by step id.
  local pid=$1 name=$2 timeout=$3 ids
  if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then return 0; fi
  mt_log "stopping step $name (srun pid $pid)"
  mt_signal_step TERM "$pid" "$name"
  if mt_wait_pid_timeout "$pid" "$timeout"; then return 0; fi
  mt_log "step $name did not stop in ${timeout}s; killing it"
  kill -TERM "$pid" 2>/dev/null || true
  if mt_wait_pid_timeout "$pid" 10; then return 0; fi
  mapfile -t ids < <(mt_step_ids "$name")
  if [ "${#ids[@]}" -gt 0 ]; then scancel --quiet --signal=KILL "${ids[@]}" 2>/dev/null || true; fi
  if ! mt_wait_pid_timeout "$pid" 10; then kill -KILL "$pid" 2>/dev/null || true; fi
}

mt_abspath() { # mt_abspath PATH : absolute path; relative to the job's working directory (sbatch --chdir,
  # by default the submit directory), which is also the working directory of the trainer
  case "$1" in
    /*) echo "$1" ;;
    *) echo "$PWD/$1" ;;
  esac
}
