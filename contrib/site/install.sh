#!/usr/bin/env bash
# Site install of slurmgpu for every user of a login or controller node. Run once as root from a
# checkout; run again to upgrade (it is idempotent and never overwrites an existing config).
#
#   PREFIX=/opt/slurmgpu      a venv of the system Python with slurmgpu installed from a wheel of
#                             this checkout (not editable: users run code that root owns)
#   BINDIR=/usr/local/bin     gsbatch, slurmgpu and slurmgpu-monitor linked here (where the rendered
#                             systemd units, cron line and job_submit.lua set-up expect them)
#   CONFDIR=/etc/slurmgpu     slurmgpu.toml, copied from CONFIG (default contrib/slurmgpu.toml) if absent
#   STATEDIR=/var/lib/slurmgpu     the nightly account's home: history database (0600), model bundle
#   SPOOLDIR=/var/spool/slurmgpu   submissions/ (3733) and gpu/ (2770), as docs/security.md says
#   LOGDIR=/var/log/slurmgpu       the cron line's log
#   ACCOUNT=slurmgpu          the nightly account and the spools' group
#   EXTRAS=train              pip extras: "train" for the host that ingests and trains (SQLAlchemy,
#                             CatBoost, ...); "" for a submit-only login node; "train,postgres" etc.
#   PYTHON=/usr/bin/python3   the interpreter the venv is made from (3.11 or newer)
#   PYSLURM=yes               pyslurm matched to the running Slurm into the venv, by
#                             contrib/pyslurm/install.sh (PYSLURM_VENDOR: where the vendored wheels
#                             and tags are); without a match it says why in one line and the
#                             commands use the Slurm command-line tools. "no" skips it.
set -euo pipefail
umask 022
SRC=$(cd "$(dirname "$0")/../.." && pwd)
PREFIX=${PREFIX:-/opt/slurmgpu}
BINDIR=${BINDIR:-/usr/local/bin}
CONFDIR=${CONFDIR:-/etc/slurmgpu}
CONFIG=${CONFIG:-$SRC/contrib/slurmgpu.toml}
STATEDIR=${STATEDIR:-/var/lib/slurmgpu}
SPOOLDIR=${SPOOLDIR:-/var/spool/slurmgpu}
LOGDIR=${LOGDIR:-/var/log/slurmgpu}
ACCOUNT=${ACCOUNT:-slurmgpu}
EXTRAS=${EXTRAS-train}
PYTHON=${PYTHON:-/usr/bin/python3}
PYSLURM=${PYSLURM:-yes}

say() { printf 'site-install: %s\n' "$*"; }
die() { printf 'site-install: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (it creates $PREFIX, $BINDIR links, the $ACCOUNT account and spools)"
case $PREFIX in /*) ;; *) die "PREFIX must be an absolute path, not '$PREFIX'" ;; esac
case $PYSLURM in yes|no) ;; *) die "PYSLURM must be yes or no, not '$PYSLURM'" ;; esac
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
    || die "$PYTHON is missing or older than 3.11"
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || die "$PYTHON has no venv module: apt-get install python3-venv"

# 1. The venv, from the system interpreter: every user can run it (no home directory in the path).
if [ ! -x "$PREFIX/bin/python" ]; then
    say "creating the venv $PREFIX"
    "$PYTHON" -m venv "$PREFIX"
fi
# 2. A wheel of this checkout, installed over any earlier one (same version number or not).
wheeldir=$(mktemp -d)
trap 'rm -rf "$wheeldir"' EXIT
say "building a wheel of $SRC"
"$PREFIX/bin/pip" wheel -q --no-deps --wheel-dir "$wheeldir" "$SRC"
wheel=$(ls "$wheeldir"/slurmgpu-*.whl)
"$PREFIX/bin/pip" install -q --force-reinstall --no-deps "$wheel"
"$PREFIX/bin/pip" install -q "$wheel${EXTRAS:+[$EXTRAS]}"
# pyslurm never fails the install: without a match the Slurm command-line tools are used.
if [ "$PYSLURM" = no ]; then
    say "pyslurm skipped (PYSLURM=no): the commands use the Slurm command-line tools"
else
    sh "$SRC/contrib/pyslurm/install.sh" "$PREFIX/bin/python" \
        || say "pyslurm not installed: the commands use the Slurm command-line tools"
fi
chmod -R u+rwX,go+rX,go-w "$PREFIX"

# 3. Commands on every user's PATH.
install -d -m 0755 "$BINDIR"
for cmd in gsbatch slurmgpu slurmgpu-monitor; do
    ln -sfn "$PREFIX/bin/$cmd" "$BINDIR/$cmd"
done

# 4. The nightly account and group (the spools' group; the daemon runs as it once bound).
getent group "$ACCOUNT" >/dev/null || groupadd --system "$ACCOUNT"
getent passwd "$ACCOUNT" >/dev/null \
    || useradd --system --gid "$ACCOUNT" --home-dir "$STATEDIR" --shell /usr/sbin/nologin "$ACCOUNT"

# 5. Config (world-readable: every gsbatch reads it), state, spools and log.
install -d -m 0755 "$CONFDIR"
if [ -e "$CONFDIR/slurmgpu.toml" ]; then
    say "kept the existing $CONFDIR/slurmgpu.toml"
else
    install -m 0644 "$CONFIG" "$CONFDIR/slurmgpu.toml"
    say "installed $CONFDIR/slurmgpu.toml from $CONFIG: edit it, then run slurmgpu config check"
fi
install -d -m 0755 -o "$ACCOUNT" -g "$ACCOUNT" "$STATEDIR"   # the bundle in it is read by every gsbatch
install -d -m 0755 "$SPOOLDIR"
install -d -m 3733 -o "$ACCOUNT" -g "$ACCOUNT" "$SPOOLDIR/submissions"
install -d -m 2770 -o root -g "$ACCOUNT" "$SPOOLDIR/gpu"
install -d -m 0750 -o "$ACCOUNT" -g "$ACCOUNT" "$LOGDIR"

say "installed $("$BINDIR/slurmgpu" --version 2>&1 | head -n 1) in $PREFIX; commands in $BINDIR"
