#!/bin/sh
# Slurm Epilog: stop this job's slurmgpu-monitor and wait (bounded) until its record is written.
#
# Runs as root with Slurm's job variables. Always exits 0: a failing Epilog drains the node.
# Settings come from /etc/slurmgpu/monitor.env (see README.md); they must match the Prolog's.

(
    SLURMGPU_MONITOR_BIN=slurmgpu-monitor
    SLURMGPU_MONITOR_RUN_DIR=/run/slurmgpu-monitor
    SLURMGPU_MONITOR_LOG=/var/log/slurmgpu-monitor.log
    SLURMGPU_MONITOR_STOP_WAIT=10
    PATH=${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}
    env_file=${SLURMGPU_MONITOR_ENV:-/etc/slurmgpu/monitor.env}

    [ -n "${SLURM_JOB_ID:-}" ] || exit 0
    [ -n "${SLURM_JOB_GPUS:-}" ] || exit 0 # the Prolog started nothing
    if [ -r "$env_file" ]; then . "$env_file"; fi

    log=$SLURMGPU_MONITOR_LOG
    { : >>"$log"; } 2>/dev/null || log=/dev/null
    export PATH
    "$SLURMGPU_MONITOR_BIN" stop --run-dir "$SLURMGPU_MONITOR_RUN_DIR" --wait "$SLURMGPU_MONITOR_STOP_WAIT" \
        </dev/null >>"$log" 2>&1
) </dev/null >/dev/null 2>&1

exit 0
