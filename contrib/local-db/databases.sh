#!/usr/bin/env bash
# Make real PostgreSQL and MariaDB servers available for the database tests.
#
#   bash contrib/local-db/databases.sh up|down|status|env
#   eval "$(bash contrib/local-db/databases.sh env)"   # exports SLURMGPU_TEST_{PG,MYSQL}_URL
#
# PostgreSQL: the Debian default cluster (`pg_lsclusters`: 15 on Debian 12, 17 on Debian 13),
#   started with pg_ctlcluster, reached over TCP 127.0.0.1:5432 with password auth.
# MariaDB: the mariadbd of contrib/local-slurm/cluster.sh (same datadir, socket and pid file, so
#   the two scripts cooperate); started here, the same way, only when it is not running. It runs
#   with --skip-networking: clients use the unix socket.
# Both get role/user `slurmgpu` (password `slurmgpu`) owning database `slurmgpu_test`.
#
# Needs root for up/down; no systemd required. Installs packages when missing. Idempotent and
# fast when everything is up. `down` stops PostgreSQL, and MariaDB only when slurmdbd does not use it.
#
# Environment:
#   SLURMGPU_DB_TIMEOUT=N   seconds to wait for each server (default 30).
set -euo pipefail
PREFIX=databases
# shellcheck source=../lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/common.sh"

DB_NAME=slurmgpu_test
DB_USER=slurmgpu
DB_PASS=slurmgpu
PG_HOST=127.0.0.1
PG_PORT=5432
MYSQL_SOCK=/run/mysqld/mysqld.sock
MYSQL_PID=/run/mysqld/mysqld.pid
MYSQL_DATADIR=/var/lib/mysql
SLURMDBD_PID=/run/slurm/slurmdbd.pid
LOG_DIR=/var/log/slurmgpu-db
TIMEOUT=${SLURMGPU_DB_TIMEOUT:-30}

PG_URL="postgresql+psycopg2://$DB_USER:$DB_PASS@$PG_HOST:$PG_PORT/$DB_NAME"
MYSQL_URL="mysql+pymysql://$DB_USER:$DB_PASS@localhost/$DB_NAME?unix_socket=$MYSQL_SOCK&charset=utf8mb4"


# --- PostgreSQL -----------------------------------------------------------------------------------
PG_VER="" PG_STATUS="" PG_LOG=""
# pg_cluster: set PG_VER/PG_STATUS/PG_LOG from the `main` cluster (the newest one if several).
pg_cluster() {
    local line port
    PG_VER="" PG_STATUS="" PG_LOG=""
    command -v pg_lsclusters >/dev/null || return 1
    line=$(pg_lsclusters -h 2>/dev/null | awk '$2 == "main"' | sort -V | tail -n 1)
    [[ -n $line ]] || return 1
    read -r PG_VER _ port PG_STATUS _ _ PG_LOG <<<"$line"
    [[ $port == "$PG_PORT" ]] || die "PostgreSQL cluster $PG_VER/main uses port $port, expected $PG_PORT"
}

pg_login_ok() {
    PGPASSWORD=$DB_PASS PGCONNECT_TIMEOUT=5 psql -X -A -t -q -w -h "$PG_HOST" -p "$PG_PORT" \
        -U "$DB_USER" -d "$DB_NAME" -c 'select 1' 2>/dev/null | grep -qx 1
}
# pg_su SQL: run SQL as the postgres superuser over the local socket; prints the tuples.
pg_su() { (cd / && runuser -u postgres -- psql -X -A -t -q -v ON_ERROR_STOP=1 -p "$PG_PORT" -d postgres -c "$1"); }

pg_up() {
    install_packages /tmp/slurmgpu-db-apt-postgresql.log postgresql
    if ! pg_cluster; then
        local ver
        ver=$(ls /usr/lib/postgresql 2>/dev/null | sort -V | tail -n 1)
        [[ -n $ver ]] || die "no PostgreSQL server version under /usr/lib/postgresql"
        say "postgresql: creating cluster $ver/main"
        pg_createcluster "$ver" main >/tmp/slurmgpu-db-pg-createcluster.log 2>&1 ||
            die "pg_createcluster $ver main failed" /tmp/slurmgpu-db-pg-createcluster.log
        pg_cluster || die "pg_lsclusters shows no main cluster after pg_createcluster"
    fi
    if [[ $PG_STATUS == online* ]]; then
        pg_login_ok && { say "postgresql $PG_VER/main: running, $DB_USER@$DB_NAME ok"; return 0; }
    else
        # Debian 13 (no systemd-tmpfiles here) may lack the socket directory.
        install -d -o postgres -g postgres -m 2775 /run/postgresql
        local out=/tmp/slurmgpu-db-pg-ctlcluster.log
        timeout "$TIMEOUT" pg_ctlcluster "$PG_VER" main start >"$out" 2>&1 ||
            die "pg_ctlcluster $PG_VER main start failed or took over ${TIMEOUT}s" "$out" "$PG_LOG"
        say "postgresql $PG_VER/main: started"
    fi
    local deadline=$((SECONDS + TIMEOUT))
    until pg_isready -q -h "$PG_HOST" -p "$PG_PORT" -t 2; do
        ((SECONDS < deadline)) || die "postgresql not accepting TCP on $PG_HOST:$PG_PORT after ${TIMEOUT}s" "$PG_LOG"
        sleep 0.2
    done
    # Role, password, database and owner (each created/fixed only when needed).
    local state
    state=$(pg_su "select (select count(*) from pg_roles where rolname = '$DB_USER') || ',' ||
                          coalesce((select pg_get_userbyid(datdba) from pg_database
                                    where datname = '$DB_NAME'), '')") ||
        die "psql as postgres failed" "$PG_LOG"
    if [[ ${state%%,*} == 0 ]]; then
        pg_su "CREATE ROLE $DB_USER LOGIN PASSWORD '$DB_PASS'" || die "CREATE ROLE failed" "$PG_LOG"
        say "postgresql: created role $DB_USER"
    else
        pg_su "ALTER ROLE $DB_USER LOGIN PASSWORD '$DB_PASS'" || die "ALTER ROLE failed" "$PG_LOG"
    fi
    case ${state#*,} in
        "") pg_su "CREATE DATABASE $DB_NAME OWNER $DB_USER ENCODING 'UTF8' TEMPLATE template0" ||
                die "CREATE DATABASE failed" "$PG_LOG"
            say "postgresql: created database $DB_NAME" ;;
        "$DB_USER") ;;
        *) pg_su "ALTER DATABASE $DB_NAME OWNER TO $DB_USER" || die "ALTER DATABASE failed" "$PG_LOG" ;;
    esac
    pg_login_ok || die "cannot log in as $DB_USER over TCP $PG_HOST:$PG_PORT (check pg_hba.conf)" "$PG_LOG"
    say "postgresql $PG_VER/main: ready, $DB_USER@$DB_NAME ok"
}

pg_down() {
    if ! pg_cluster; then say "postgresql: no cluster"; return 0; fi
    if [[ $PG_STATUS != online* ]]; then say "postgresql $PG_VER/main: not running"; return 0; fi
    local out=/tmp/slurmgpu-db-pg-ctlcluster.log
    timeout "$TIMEOUT" pg_ctlcluster "$PG_VER" main stop -m fast >"$out" 2>&1 ||
        die "pg_ctlcluster $PG_VER main stop failed or took over ${TIMEOUT}s" "$out" "$PG_LOG"
    say "postgresql $PG_VER/main: stopped"
}

pg_status() {
    if ! pg_cluster; then echo "postgresql  not installed (no main cluster)"; return 3; fi
    if [[ $PG_STATUS == online* ]]; then
        local pid
        pid=$(head -n 1 "/var/lib/postgresql/$PG_VER/main/postmaster.pid" 2>/dev/null || echo '?')
        echo "postgresql  running ($PG_VER/main, pid $pid, $PG_HOST:$PG_PORT)"
    else
        echo "postgresql  stopped ($PG_VER/main)"; return 3
    fi
}

# --- MariaDB --------------------------------------------------------------------------------------
mysql_ok() { mariadb-admin --socket="$MYSQL_SOCK" ping >/dev/null 2>&1; }

mysql_up() {
    local pid log=$LOG_DIR/mariadb.log
    if ! mysql_ok; then
        install_packages /tmp/slurmgpu-db-apt-mariadb.log mariadb-server
        install -d -o mysql -g mysql -m 0755 /run/mysqld
        install -d -m 0755 "$LOG_DIR"
        if [[ ! -d $MYSQL_DATADIR/mysql ]]; then
            say "initialising MariaDB data directory"
            mariadb-install-db --user=mysql --datadir="$MYSQL_DATADIR" >"$LOG_DIR/mariadb-install.log" 2>&1 ||
                die "mariadb-install-db failed" "$LOG_DIR/mariadb-install.log"
        fi
        if pid=$(pid_of "$MYSQL_PID" mariadbd); then
            say "mariadbd: pid $pid is running but not answering yet"
        else
            # Exactly the command line of contrib/local-slurm/cluster.sh, so either script can
            # find (pid file) and stop this server.
            setsid /usr/sbin/mariadbd --user=mysql --datadir="$MYSQL_DATADIR" --socket="$MYSQL_SOCK" \
                --pid-file="$MYSQL_PID" --skip-networking \
                --innodb-buffer-pool-size=256M --innodb-lock-wait-timeout=900 \
                </dev/null >>"$log" 2>&1 &
            say "mariadbd: started (log $log)"
        fi
        local deadline=$((SECONDS + TIMEOUT)) dead=0
        until mysql_ok; do
            ((SECONDS < deadline)) || die "mariadbd not ready after ${TIMEOUT}s" "$log"
            if pid_of "$MYSQL_PID" mariadbd >/dev/null; then dead=0
            elif ((++dead > 25)); then die "mariadbd is not running (exited during start-up?)" "$log"; fi
            sleep 0.2
        done
    fi
    mariadb --socket="$MYSQL_SOCK" -u root <<EOF || die "could not create the MariaDB test database/user" "$log"
CREATE DATABASE IF NOT EXISTS $DB_NAME CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
ALTER USER '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL PRIVILEGES ON $DB_NAME.* TO '$DB_USER'@'localhost';
EOF
    mariadb --socket="$MYSQL_SOCK" -u "$DB_USER" -p"$DB_PASS" -N -e 'select 1' "$DB_NAME" >/dev/null 2>&1 ||
        die "cannot log in to MariaDB as $DB_USER via $MYSQL_SOCK" "$log"
    say "mariadb: ready, $DB_USER@$DB_NAME ok (socket $MYSQL_SOCK)"
}

mysql_down() {
    local dbd
    if dbd=$(pid_of "$SLURMDBD_PID" slurmdbd); then
        say "mariadbd: left running (used by slurmdbd pid $dbd)"; return 0
    fi
    if ! pid_of "$MYSQL_PID" mariadbd >/dev/null && mysql_ok; then
        say "mariadbd: left running (not started from $MYSQL_PID)"; return 0
    fi
    stop_daemon mariadbd "$MYSQL_PID" mariadbd
}

mysql_status() {
    local pid
    if pid=$(pid_of "$MYSQL_PID" mariadbd); then echo "mariadb     running (pid $pid, socket $MYSQL_SOCK)"
    elif mysql_ok; then echo "mariadb     running (socket $MYSQL_SOCK)"
    else echo "mariadb     stopped"; return 3; fi
}

# --- commands -------------------------------------------------------------------------------------
need_root() { [[ $(id -u) -eq 0 ]] || die "must run as root"; }

case ${1:-} in
    up) need_root; pg_up; mysql_up ;;
    down) need_root; pg_down; mysql_down ;;
    status) rc=0; pg_status || rc=$?; mysql_status || rc=$?; exit $rc ;;
    env) printf "export SLURMGPU_TEST_PG_URL='%s'\nexport SLURMGPU_TEST_MYSQL_URL='%s'\n" "$PG_URL" "$MYSQL_URL" ;;
    *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
