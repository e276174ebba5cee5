#!/usr/bin/env bash
# Bring up / tear down a real Slurm cluster ("slurmgpu") on this machine, for tests and CI:
# munged -> mariadbd -> slurmdbd -> slurmctld -> two slurmd (one host, Slurm's multiple-slurmd
# mode), with fake GPUs. Three nodes, so partitions differ in GPU types as on a real site:
#   gpu1: a100:4 v100:4 (partitions gpu, debug)     gpu2: t4:4 (partitions gpu-small, debug)
#   gpu3: stand-in MIG instances a100_1g.10gb:4 a100_3g.40gb:2 and shard:8 (partition mig)
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
PREFIX=cluster
# shellcheck source=../lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/common.sh"

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
# GPU types and counts per node, numbered in this order: a100 -> nvidia0-3, v100 -> nvidia4-7 (gpu1),
# t4 -> nvidia8-11 (gpu2), a100_1g.10gb -> nvidia12-15, a100_3g.40gb -> nvidia16-17 (gpu3). Slurm
# schedules a MIG instance as a GPU of its own type: one device file each stands in for it.
NODES=(gpu1 gpu2 gpu3)
declare -A NODE_GPUS=([gpu1]="a100:4 v100:4" [gpu2]="t4:4" [gpu3]="a100_1g.10gb:4 a100_3g.40gb:2")
# Shared GPUs (gres "shard", Slurm 22.05+): spread evenly over the node's GPUs; no device files.
declare -A NODE_SHARDS=([gpu3]=8)
declare -A NODE_FEATURES=([gpu1]="a100,a100-80gb,v100" [gpu2]="t4" [gpu3]="mig,a100_1g.10gb,a100_3g.40gb")
declare -A NODE_PORT=([gpu1]=17001 [gpu2]=17002 [gpu3]=17003)
GPU_COUNT=0
for _node in "${NODES[@]}"; do
    for _spec in ${NODE_GPUS[$_node]}; do GPU_COUNT=$((GPU_COUNT + ${_spec##*:})); done
done

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
# lua-socket lets job_submit.lua reach slurmgpu's daemon; lua5.1 runs the hook's own tests.
PACKAGES=(slurm-wlm slurmdbd slurm-wlm-basic-plugins munge mariadb-server lua-socket lua5.1)

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
    local node
    for node in "${NODES[@]}"; do install -d -o root -g root -m 0755 "$STATE_DIR/slurmd-$node"; done

    # Fake GPUs: character devices (regular files give no CUDA_VISIBLE_DEVICES).
    local i
    for ((i = 0; i < GPU_COUNT; i++)); do
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
    local gres_conf="AutoDetect=off"$'\n' node_lines="" node spec t n first=0 last gres_node
    for node in "${NODES[@]}"; do
        gres_node=""
        for spec in ${NODE_GPUS[$node]}; do
            t=${spec%:*} n=${spec##*:}
            last=$((first + n - 1))
            gres_node+="${gres_node:+,}gpu:$t:$n"
            gres_conf+="NodeName=$node Name=gpu Type=$t File=$GPU_DIR/nvidia[$first-$last]"$'\n'
            first=$((last + 1))
        done
        if [[ -n ${NODE_SHARDS[$node]:-} ]]; then
            gres_node+=",shard:${NODE_SHARDS[$node]}"
            gres_conf+="NodeName=$node Name=shard Count=${NODE_SHARDS[$node]}"$'\n'
        fi
        node_lines+="NodeName=$node NodeHostname=localhost NodeAddr=127.0.0.1 Port=${NODE_PORT[$node]} CPUs=8 Boards=1 SocketsPerBoard=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=16000 Feature=${NODE_FEATURES[$node]} Gres=$gres_node State=UNKNOWN"$'\n'
    done

    if write_if_changed "$CONF_DIR/slurm.conf" 0644 root:root <<EOF
# Generated by contrib/local-slurm/cluster.sh -- local three-node test cluster on one host.
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
GresTypes=gpu,shard
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
SlurmdSpoolDir=$STATE_DIR/slurmd-%n
SlurmctldPidFile=$RUN_SLURM/slurmctld.pid
SlurmdPidFile=$RUN_SLURM/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
${node_lines}PartitionName=gpu Nodes=gpu1 Default=YES State=UP
PartitionName=gpu-small Nodes=gpu2 Default=NO State=UP
PartitionName=debug Nodes=gpu1,gpu2 Default=NO State=UP
PartitionName=mig Nodes=gpu3 Default=NO State=UP
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
        stop_slurmds
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

# stop_slurmds: every node's slurmd, and the one an older single-node layout left running.
stop_slurmds() {
    local node
    for node in "${NODES[@]}"; do stop_daemon slurmd "$RUN_SLURM/slurmd-$node.pid" slurmd; done
    stop_daemon slurmd "$RUN_SLURM/slurmd.pid" slurmd
}

start_slurmd() {
    local node pid log
    for node in "${NODES[@]}"; do
        log=$LOG_DIR/slurmd-$node.log
        if pid=$(pid_of "$RUN_SLURM/slurmd-$node.pid" slurmd); then say "slurmd $node: running (pid $pid)"
        else
            # One slurmd per node name (-N); starting a second one for the same name kills the first.
            /usr/sbin/slurmd -N "$node" || die "slurmd $node failed to start" "$log"
            say "slurmd $node: started"
        fi
    done
    for node in "${NODES[@]}"; do wait_node "$node"; done
}

# wait_node NODE: until sinfo says the node can run jobs (resuming it once if it was left down).
wait_node() {
    local node=$1 log=$LOG_DIR/slurmd-$1.log
    local deadline=$((SECONDS + TIMEOUT)) state resumed=0
    while :; do
        state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
        case $state in
            idle | mixed | allocated | completing) break ;;
            *inval*) die "node $node is INVAL (config mismatch)" "$LOG_DIR/slurmctld.log" "$log" ;;
            drain* | down | fail*)
                if ((!resumed)); then
                    say "node $node is $state: resuming"
                    scontrol update nodename="$node" state=resume || true
                    resumed=1
                fi ;;
        esac
        pid_of "$RUN_SLURM/slurmd-$node.pid" slurmd >/dev/null || ((SECONDS < deadline - TIMEOUT + 5)) ||
            die "slurmd $node is not running (exited during start-up?)" "$log"
        ((SECONDS < deadline)) || die "node $node not idle after ${TIMEOUT}s (state: ${state:-?})" \
            "$log" "$LOG_DIR/slurmctld.log"
        sleep 0.2
    done
    say "node $node: $state"
}

# --- commands -----------------------------------------------------------------------------------
cmd_up() {
    install_packages /tmp/slurmgpu-cluster-apt.log "${PACKAGES[@]}"
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
    stop_slurmds
    stop_daemon slurmctld "$RUN_SLURM/slurmctld.pid" slurmctld
    stop_daemon slurmdbd "$RUN_SLURM/slurmdbd.pid" slurmdbd
    stop_daemon mariadbd "$MYSQL_PID" mariadbd
    stop_daemon munged "$MUNGE_PID" munged
}

cmd_status() {
    local rc=0 name pidfile comm pid node specs=()
    specs=("munged $MUNGE_PID" "mariadbd $MYSQL_PID" "slurmdbd $RUN_SLURM/slurmdbd.pid"
           "slurmctld $RUN_SLURM/slurmctld.pid")
    for node in "${NODES[@]}"; do specs+=("slurmd:$node $RUN_SLURM/slurmd-$node.pid"); done
    for spec in "${specs[@]}"; do
        read -r name pidfile <<<"$spec"; comm=${name%%:*}
        if pid=$(pid_of "$pidfile" "$comm"); then printf '%-12s running (pid %s)\n' "$name" "$pid"
        else printf '%-12s stopped\n' "$name"; rc=3; fi
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
