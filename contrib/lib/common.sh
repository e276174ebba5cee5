# Helpers shared by contrib/local-slurm/cluster.sh and contrib/local-db/databases.sh.
# Source it after setting PREFIX (the tag every message starts with).

say() { printf '[%s] %s\n' "$PREFIX" "$*"; }
# die MESSAGE [LOG...]: print MESSAGE and the tail of each readable LOG, then exit 1.
die() { printf '[%s] ERROR: %s\n' "$PREFIX" "$1" >&2; shift
        for log in "$@"; do
            if [[ -r $log ]]; then printf -- '--- last lines of %s ---\n' "$log" >&2; tail -n 25 "$log" >&2; fi
        done
        exit 1; }

# alive PID: the process exists and is not a zombie (a container's pid 1 may not reap it).
alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat%% *} != Z ]]
}

# pid_of PIDFILE COMM: print the pid if the file names a live process whose comm is COMM.
pid_of() {
    local pid
    [[ -r $1 ]] || return 1
    pid=$(tr -dc '0-9' <"$1")
    [[ -n $pid ]] && alive "$pid" && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] || return 1
    echo "$pid"
}

# install_packages LOG PACKAGE...: apt-get install the packages not yet installed, with a
# policy-rc.d that stops package scripts from starting daemons (only if none is in place).
install_packages() {
    local log=$1; shift
    local installed
    installed=$(dpkg-query -W -f='${db:Status-Abbrev}\n' "$@" 2>/dev/null | grep -c '^ii' || true)
    ((installed == $#)) && return 0
    say "installing $*"
    local own_policy=0 rc=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        own_policy=1
    fi
    {
        DEBIAN_FRONTEND=noninteractive timeout 600 apt-get update -q &&
        DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -q --no-install-recommends "$@"
    } >"$log" 2>&1 || rc=$?
    if ((own_policy)); then rm -f /usr/sbin/policy-rc.d; fi
    ((rc == 0)) || die "installing $* failed (exit $rc)" "$log"
}

# stop_daemon NAME PIDFILE COMM: SIGTERM the daemon by its pid file, SIGKILL after TIMEOUT seconds.
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
