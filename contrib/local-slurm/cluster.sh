#!/usr/bin/env bash
# Bring up / tear down a real single-node Slurm cluster ("slurmgpu") on this machine,
# for tests and CI: munged -> mariadbd -> slurmdbd -> slurmctld -> slurmd, with fake GPUs.
#
#   bash contrib/local-slurm/cluster.sh up|down|status
#
# Needs root and Debian (12: Slurm 22.05, 13: Slurm 24.11); no systemd required.
# Installs the packages when missing. Idempotent: `up` leaves healthy daemons alone.
# Daemons are stopped by the PID in their pid file, never by name.
#
# Environment:
#   SLURMGPU_JOB_SUBMIT_LUA=/path  copy this file to /etc/slurm/job_submit.lua before slurmctld
#                                  starts (and `scontrol reconfigure` when it changed while running).
#                                  Without it a pass-through hook is written only if none exists.
#   SLURMGPU_CLUSTER_TIMEOUT=N     seconds to wait for each daemon (default 30).
set -euo pipefail

CLUSTER=slurmgpu
CONF_DIR=/etc/slurm
STATE_DIR=/var/lib/slurmgpu-cluster
LOG_DIR=/var/log/slurmgpu-cluster
RUN_SLURM=/run/slurm
GPU_DIR=$STATE_DIR/dev
TEST_USER=sguser
ACCOUNT=slurmgpu
DB_NAME=slurm_acct_db
DB_USER=slurm
DB_PASS=slurmgpu-local
MYSQL_SOCK=/run/mysqld/mysqld.sock
MYSQL_PID=/run/mysqld/mysqld.pid
MUNGE_PID=/run/munge/munged.pid
TIMEOUT=${SLURMGPU_CLUSTER_TIMEOUT:-30}
# GPU types, 4 each: a100 -> nvidia0-3, v100 -> nvidia4-7, t4 -> nvidia8-11
GPU_TYPES=(a100 v100 t4)
GPUS_PER_TYPE=4

say() { printf '[cluster] %s\n' "$*"; }
die() { printf '[cluster] ERROR: %s\n' "$1" >&2; shift
        for log in "$@"; do
            if [[ -r $log ]]; then printf -- '--- last lines of %s ---\n' "$log" >&2; tail -n 25 "$log" >&2; fi
        done
        exit 1; }

# --- pid-file helpers ---------------------------------------------------------------------------
# pid_of PIDFILE COMM: print the pid if the file names a live process whose comm is COMM.
pid_of() {
    local pid
    [[ -r $1 ]] || return 1
    pid=$(tr -dc '0-9' <"$1")
    [[ -n $pid ]] && alive "$pid" && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] || return 1
    echo "$pid"
}

# alive PID: the process exists and is not a zombie (a container's pid 1 may not reap it).
alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat%% *} != Z ]]
}

# wait_for NAME LOGFILE PIDFILE COMMAND...: poll COMMAND until it succeeds or TIMEOUT expires;
# fail early when daemon NAME (its comm) has had no live process in PIDFILE for 5 s.
wait_for() {
    local what=$1 log=$2 pidfile=$3; shift 3
    local deadline=$((SECONDS + TIMEOUT)) dead=0
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "$what not ready after ${TIMEOUT}s" "$log"
        if pid_of "$pidfile" "$what" >/dev/null; then dead=0
        elif ((++dead > 25)); then die "$what is not running (exited during start-up?)" "$log"; fi
        sleep 0.2
    done
}

# stop_daemon NAME PIDFILE COMM
stop_daemon() {
    local name=$1 pidfile=$2 comm=$3 pid i
    if ! pid=$(pid_of "$pidfile" "$comm"); then say "$name: not running"; return 0; fi
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < TIMEOUT * 5; i++)); do
        alive "$pid" || { say "$name: stopped (pid $pid)"; return 0; }
        sleep 0.2
    done
    kill -KILL "$pid" 2>/dev/null || true
    say "$name: killed (pid $pid did not stop on SIGTERM)"
}

# write_if_changed DEST MODE OWNER < content; returns 0 when the file was (re)written.
write_if_changed() {
    local dest=$1 mode=$2 owner=$3 tmp
    tmp=$(mktemp "$dest.XXXXXX")
    cat >"$tmp"
    chmod "$mode" "$tmp"; chown "$owner" "$tmp"
    if [[ -f $dest ]] && cmp -s "$tmp" "$dest"; then
        rm -f "$tmp"
        chmod "$mode" "$dest"; chown "$owner" "$dest"
        return 1
    fi
    mv -f "$tmp" "$dest"
    return 0
}

# --- install ------------------------------------------------------------------------------------
PACKAGES=(slurm-wlm slurmdbd slurm-wlm-basic-plugins munge mariadb-server)
install_packages() {
    local installed missing=0
    installed=$(dpkg-query -W -f='${db:Status-Abbrev}\n' "${PACKAGES[@]}" 2>/dev/null | grep -c '^ii' || true)
    ((installed == ${#PACKAGES[@]})) || missing=1
    ((missing)) || return 0
    say "installing Slurm, munge and MariaDB packages"
    local own_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        own_policy=1
    fi
    local rc=0
    {
        DEBIAN_FRONTEND=noninteractive apt-get update -q &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            "${PACKAGES[@]}"
    } >"/tmp/slurmgpu-cluster-apt.log" 2>&1 || rc=$?
    if ((own_policy)); then rm -f /usr/sbin/policy-rc.d; fi
    ((rc == 0)) || die "package installation failed (exit $rc)" /tmp/slurmgpu-cluster-apt.log
}

# --- host preparation ---------------------------------------------------------------------------
prepare_host() {
    # Slurm tools stall ~10 s per call when localhost / the hostname do not resolve (minimal images).
    local h; h=$(hostname)
    if ! getent hosts localhost >/dev/null || ! getent hosts "$h" >/dev/null; then
        say "adding '127.0.0.1 localhost $h' to /etc/hosts"
        printf '127.0.0.1 localhost %s\n' "$h" >>/etc/hosts
    fi
    # Debian 13 packages do not create these run directories; harmless on 12.
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o mysql -g mysql -m 0755 /run/mysqld
    install -d -o slurm -g slurm -m 0755 "$RUN_SLURM"
    [[ -d /var/log/munge ]] || install -d -o munge -g munge -m 0700 /var/log/munge
    [[ -d /var/lib/munge ]] || install -d -o munge -g munge -m 0700 /var/lib/munge
    install -d -o root -g root -m 0755 "$STATE_DIR" "$GPU_DIR"
    install -d -o slurm -g slurm -m 0755 "$STATE_DIR/slurmctld" "$LOG_DIR"
    install -d -o root -g root -m 0755 "$STATE_DIR/slurmd"

    # Fake GPUs: character devices (regular files give no CUDA_VISIBLE_DEVICES).
    local n=$((${#GPU_TYPES[@]} * GPUS_PER_TYPE)) i
    for ((i = 0; i < n; i++)); do
        [[ -c $GPU_DIR/nvidia$i ]] && continue
        rm -f "$GPU_DIR/nvidia$i"
        mknod -m 0666 "$GPU_DIR/nvidia$i" c 1 3
    done

    if ! id "$TEST_USER" >/dev/null 2>&1; then
        say "creating user $TEST_USER"
        useradd -m -s /bin/bash "$TEST_USER"
    fi
}

# --- configuration ------------------------------------------------------------------------------
SLURM_CONF_CHANGED=0
DBD_CONF_CHANGED=0
LUA_CHANGED=0

write_configs() {
    install -d -m 0755 "$CONF_DIR"
    local gres_node="" gres_conf="AutoDetect=off"$'\n' t first=0 last
    for t in "${GPU_TYPES[@]}"; do
        last=$((first + GPUS_PER_TYPE - 1))
        gres_node+="${gres_node:+,}gpu:$t:$GPUS_PER_TYPE"
        gres_conf+="NodeName=localhost Name=gpu Type=$t File=$GPU_DIR/nvidia[$first-$last]"$'\n'
        first=$((last + 1))
    done

    if write_if_changed "$CONF_DIR/slurm.conf" 0644 root:root <<EOF
# Generated by contrib/local-slurm/cluster.sh -- local single-node test cluster.
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=500
SchedulerType=sched/backfill
GresTypes=gpu
ReturnToService=2
MinJobAge=600
MailProg=/bin/true
JobSubmitPlugins=lua
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=5
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageTRES=gres/gpu,gres/gpu:a100,gres/gpu:v100,gres/gpu:t4
AccountingStoreFlags=job_comment
SlurmdParameters=config_overrides
StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmctldPidFile=$RUN_SLURM/slurmctld.pid
SlurmdPidFile=$RUN_SLURM/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 Boards=1 SocketsPerBoard=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=16000 Feature=a100,v100,t4 Gres=$gres_node State=UNKNOWN
PartitionName=gpu Nodes=localhost Default=YES State=UP
PartitionName=gpu-small Nodes=localhost Default=NO State=UP
PartitionName=debug Nodes=localhost Default=NO State=UP
EOF
    then SLURM_CONF_CHANGED=1; fi

    if printf '%s' "$gres_conf" | write_if_changed "$CONF_DIR/gres.conf" 0644 root:root; then
        SLURM_CONF_CHANGED=1
    fi

    if write_if_changed "$CONF_DIR/slurmdbd.conf" 0600 slurm:slurm <<EOF
# Generated by contrib/local-slurm/cluster.sh
AuthType=auth/munge
DbdHost=localhost
SlurmUser=slurm
PidFile=$RUN_SLURM/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=$DB_NAME
StorageUser=$DB_USER
StoragePass=$DB_PASS
EOF
    then DBD_CONF_CHANGED=1; fi

    local lua=$CONF_DIR/job_submit.lua
    if [[ -n ${SLURMGPU_JOB_SUBMIT_LUA:-} ]]; then
        [[ -r $SLURMGPU_JOB_SUBMIT_LUA ]] || die "SLURMGPU_JOB_SUBMIT_LUA=$SLURMGPU_JOB_SUBMIT_LUA is not readable"
        if write_if_changed "$lua" 0644 root:root <"$SLURMGPU_JOB_SUBMIT_LUA"; then
            LUA_CHANGED=1; say "installed job_submit.lua from $SLURMGPU_JOB_SUBMIT_LUA"
        fi
    elif [[ ! -e $lua ]]; then
        write_if_changed "$lua" 0644 root:root <<'EOF' || true
-- Pass-through job_submit hook written by contrib/local-slurm/cluster.sh.
function slurm_job_submit(job_desc, part_list, submit_uid)
    return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    return slurm.SUCCESS
end

return slurm.SUCCESS
EOF
        LUA_CHANGED=1
    fi
}

# --- daemons ------------------------------------------------------------------------------------
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
mysql_ok() { mariadb-admin --socket="$MYSQL_SOCK" ping >/dev/null 2>&1; }
# dbd_ok also keeps the cluster list, to save a sacctmgr round trip (~0.2 s each).
dbd_ok()   { CLUSTERS=$(sacctmgr -n -P show cluster format=cluster 2>/dev/null); }
ctld_ok()  { scontrol ping 2>/dev/null | grep 'is UP' >/dev/null; }

start_munge() {
    if [[ ! -s /etc/munge/munge.key ]]; then
        say "creating munge key"
        if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key --force
        else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
        chmod 0400 /etc/munge/munge.key
    fi
    chown munge:munge /etc/munge/munge.key; chmod go-rwx /etc/munge/munge.key
    local pid
    if pid=$(pid_of "$MUNGE_PID" munged); then say "munged: running (pid $pid)"
    else
        runuser -u munge -- /usr/sbin/munged || die "munged failed to start" /var/log/munge/munged.log
        say "munged: started"
    fi
    wait_for munged /var/log/munge/munged.log "$MUNGE_PID" munge_ok
}

start_mariadb() {
    local pid log=$LOG_DIR/mariadb.log
    if [[ ! -d /var/lib/mysql/mysql ]]; then
        say "initialising MariaDB data directory"
        mariadb-install-db --user=mysql --datadir=/var/lib/mysql >"$LOG_DIR/mariadb-install.log" 2>&1 ||
            die "mariadb-install-db failed" "$LOG_DIR/mariadb-install.log"
    fi
    if pid=$(pid_of "$MYSQL_PID" mariadbd); then say "mariadbd: running (pid $pid)"
    elif mysql_ok; then say "mariadbd: running (not started by this script)"
    else
        # innodb flags: Slurm 24.11's slurmdbd warns without them; valid on MariaDB 10.11 too.
        setsid /usr/sbin/mariadbd --user=mysql --datadir=/var/lib/mysql --socket="$MYSQL_SOCK" \
            --pid-file="$MYSQL_PID" --skip-networking \
            --innodb-buffer-pool-size=256M --innodb-lock-wait-timeout=900 \
            </dev/null >>"$log" 2>&1 &
        say "mariadbd: started"
    fi
    wait_for mariadbd "$log" "$MYSQL_PID" mysql_ok
    mariadb --socket="$MYSQL_SOCK" -u root <<EOF || die "could not create the accounting database/user" "$log"
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
ALTER USER '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';
EOF
}

start_slurmdbd() {
    local pid log=$LOG_DIR/slurmdbd.log
    if pid=$(pid_of "$RUN_SLURM/slurmdbd.pid" slurmdbd) && ((DBD_CONF_CHANGED)); then
        say "slurmdbd.conf changed: restarting slurmdbd"
        stop_daemon slurmdbd "$RUN_SLURM/slurmdbd.pid" slurmdbd
    fi
    if pid=$(pid_of "$RUN_SLURM/slurmdbd.pid" slurmdbd); then say "slurmdbd: running (pid $pid)"
    else
        /usr/sbin/slurmdbd || die "slurmdbd failed to start" "$log"
        say "slurmdbd: started"
    fi
    wait_for slurmdbd "$log" "$RUN_SLURM/slurmdbd.pid" dbd_ok
    if ! grep -x "$CLUSTER" <<<"$CLUSTERS" >/dev/null; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster failed" "$log"
        say "slurmdbd: added cluster $CLUSTER"
    fi
}

add_associations() {
    local assocs  # lines "account|user" ("account|" for the account itself)
    assocs=$(sacctmgr -n -P show assoc where cluster="$CLUSTER" format=account,user 2>/dev/null) ||
        die "sacctmgr show assoc failed" "$LOG_DIR/slurmdbd.log"
    if ! grep -x "$ACCOUNT|" <<<"$assocs" >/dev/null; then
        sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER" description="slurmgpu tests" \
            organization=slurmgpu >/dev/null || die "sacctmgr add account failed"
    fi
    local u
    for u in "$TEST_USER" root; do
        if ! grep -E "\|$u\$" <<<"$assocs" >/dev/null; then
            sacctmgr -i add user "$u" account="$ACCOUNT" cluster="$CLUSTER" >/dev/null ||
                die "sacctmgr add user $u failed"
            say "accounting: added association $u/$ACCOUNT"
        fi
    done
}

start_slurmctld() {
    local pid log=$LOG_DIR/slurmctld.log restarted=0
    if pid=$(pid_of "$RUN_SLURM/slurmctld.pid" slurmctld) && ((SLURM_CONF_CHANGED)); then
        say "slurm.conf/gres.conf changed: restarting slurmctld and slurmd"
        stop_daemon slurmd "$RUN_SLURM/slurmd.pid" slurmd
        stop_daemon slurmctld "$RUN_SLURM/slurmctld.pid" slurmctld
    fi
    if pid=$(pid_of "$RUN_SLURM/slurmctld.pid" slurmctld); then say "slurmctld: running (pid $pid)"
    else
        /usr/sbin/slurmctld || die "slurmctld failed to start" "$log"
        say "slurmctld: started"; restarted=1
    fi
    wait_for slurmctld "$log" "$RUN_SLURM/slurmctld.pid" ctld_ok
    if ((LUA_CHANGED && !restarted)); then
        scontrol reconfigure || die "scontrol reconfigure failed" "$log"
        say "slurmctld: reconfigured for the new job_submit.lua"
    fi
}

start_slurmd() {
    local pid log=$LOG_DIR/slurmd.log
    if pid=$(pid_of "$RUN_SLURM/slurmd.pid" slurmd); then say "slurmd: running (pid $pid)"
    else
        # Never start a second slurmd: it kills the first. The pid check above guards that.
        /usr/sbin/slurmd -N localhost || die "slurmd failed to start" "$log"
        say "slurmd: started"
    fi
    local deadline=$((SECONDS + TIMEOUT)) state resumed=0
    while :; do
        state=$(sinfo -h -n localhost -o %T 2>/dev/null || true)
        case $state in
            idle | mixed | allocated | completing) break ;;
            *inval*) die "node localhost is INVAL (config mismatch)" "$LOG_DIR/slurmctld.log" "$log" ;;
            drain* | down | fail*)
                if ((!resumed)); then
                    say "node localhost is $state: resuming"
                    scontrol update nodename=localhost state=resume || true
                    resumed=1
                fi ;;
        esac
        pid_of "$RUN_SLURM/slurmd.pid" slurmd >/dev/null || ((SECONDS < deadline - TIMEOUT + 5)) ||
            die "slurmd is not running (exited during start-up?)" "$log"
        ((SECONDS < deadline)) || die "node localhost not idle after ${TIMEOUT}s (state: ${state:-?})" \
            "$log" "$LOG_DIR/slurmctld.log"
        sleep 0.2
    done
    say "node localhost: $state"
}

# --- commands -----------------------------------------------------------------------------------
cmd_up() {
    install_packages
    prepare_host
    write_configs
    start_munge
    start_mariadb
    start_slurmdbd
    add_associations
    start_slurmctld
    start_slurmd
    say "cluster $CLUSTER is up"
}

cmd_down() {
    stop_daemon slurmd "$RUN_SLURM/slurmd.pid" slurmd
    stop_daemon slurmctld "$RUN_SLURM/slurmctld.pid" slurmctld
    stop_daemon slurmdbd "$RUN_SLURM/slurmdbd.pid" slurmdbd
    stop_daemon mariadbd "$MYSQL_PID" mariadbd
    stop_daemon munged "$MUNGE_PID" munged
}

cmd_status() {
    local rc=0 name pidfile comm pid
    for spec in "munged $MUNGE_PID" "mariadbd $MYSQL_PID" "slurmdbd $RUN_SLURM/slurmdbd.pid" \
                "slurmctld $RUN_SLURM/slurmctld.pid" "slurmd $RUN_SLURM/slurmd.pid"; do
        read -r name pidfile <<<"$spec"; comm=$name
        if pid=$(pid_of "$pidfile" "$comm"); then printf '%-10s running (pid %s)\n' "$name" "$pid"
        else printf '%-10s stopped\n' "$name"; rc=3; fi
    done
    return $rc
}

[[ $(id -u) -eq 0 ]] || die "must run as root"
case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
