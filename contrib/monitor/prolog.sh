#!/bin/sh
# Slurm Prolog: start slurmgpu-monitor beside this job on this node, detached from the Prolog.
#
# Runs as root with Slurm's job variables (SLURM_JOB_ID, SLURM_JOB_GPUS, SLURM_CLUSTER_NAME, ...).
# Always exits 0: a failing Prolog drains the node and requeues the job, and a missing usage
# record is not worth that. Settings come from /etc/slurmgpu/monitor.env (see README.md).

(
    SLURMGPU_MONITOR_BIN=slurmgpu-monitor
    SLURMGPU_MONITOR_SPOOL=/var/spool/slurmgpu/gpu
    SLURMGPU_MONITOR_RUN_DIR=/run/slurmgpu-monitor
    SLURMGPU_MONITOR_INTERVAL=5
    SLURMGPU_MONITOR_LOG=/var/log/slurmgpu-monitor.log
    PATH=${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}
    env_file=${SLURMGPU_MONITOR_ENV:-/etc/slurmgpu/monitor.env}

    [ -n "${SLURM_JOB_ID:-}" ] || exit 0
    [ -n "${SLURM_JOB_GPUS:-}" ] || exit 0 # no GPUs for this job on this node
    if [ -r "$env_file" ]; then . "$env_file"; fi

    mkdir -p -m 0755 "$SLURMGPU_MONITOR_RUN_DIR" || exit 0
    log=$SLURMGPU_MONITOR_LOG
    { : >>"$log"; } 2>/dev/null || log=/dev/null

    # setsid: its own session, so nothing aimed at the Prolog's process group reaches it;
    # all three standard streams redirected, so slurmd does not wait on the Prolog's pipes.
    export PATH
    nohup setsid "$SLURMGPU_MONITOR_BIN" run --spool "$SLURMGPU_MONITOR_SPOOL" \
        --run-dir "$SLURMGPU_MONITOR_RUN_DIR" --interval "$SLURMGPU_MONITOR_INTERVAL" \
        </dev/null >>"$log" 2>&1 &
) </dev/null >/dev/null 2>&1

exit 0
