#!/bin/sh
# Install pyslurm into a virtual environment, matched to the running Slurm (its releases are tied
# to one Slurm major.minor). Order: an already matching pyslurm is kept; else a vendored wheel for
# this Slurm and this Python; else the vendored source tag for this Slurm is built (needs
# libslurm-dev: installed with apt-get when run as root, unless SLURMGPU_PYSLURM_APT=no). When
# nothing matches it says so in one line and exits 0: slurmgpu then uses the Slurm command-line tools.
#
#   contrib/pyslurm/install.sh [PYTHON]      PYTHON defaults to .venv/bin/python
#   PYSLURM_VENDOR=DIR                       where the wheels and tag archives are
#                                            (default: ../shared/vendor/pyslurm beside the repository)
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
py=${1:-$here/.venv/bin/python}
vendor=${PYSLURM_VENDOR:-$here/../shared/vendor/pyslurm}

skip() { echo "pyslurm: $1; not installed (slurmgpu uses the Slurm command-line tools)"; exit 0; }

# pyslurm links against libslurm.so.<N> and builds against slurm.h: Debian's slurm-wlm ships neither
# (its daemons use a private libslurmfull), libslurm-dev brings both. $1 says what needs it.
need_libslurm() {
  if [ -f /usr/include/slurm/slurm.h ] && ls /usr/lib/*/libslurm.so.* /usr/lib64/libslurm.so.* >/dev/null 2>&1; then
    return 0
  fi
  if [ "$(id -u)" = 0 ] && [ "${SLURMGPU_PYSLURM_APT:-yes}" != no ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q libslurm-dev >/dev/null 2>&1 \
      || skip "libslurm-dev (needed by $1) did not install"
  else
    skip "$1 needs libslurm-dev (install it as root)"
  fi
}

[ -x "$py" ] || skip "no Python at $py"
command -v sinfo >/dev/null 2>&1 || skip "no sinfo on PATH, the running Slurm's version is unknown"
slurm=$(sinfo --version 2>/dev/null | awk '{print $NF}')
major=$(echo "$slurm" | cut -d. -f1)
minor=$(echo "$slurm" | cut -d. -f2 | sed 's/^0*//')
case "$major.$minor" in
  [0-9]*.[0-9]*) ;;
  *) skip "cannot read the Slurm version from 'sinfo --version' ($slurm)" ;;
esac
tag="$major.${minor:-0}"   # pyslurm numbers Slurm 22.05 as 22.5

have=$("$py" -c 'import pyslurm; print(pyslurm.__version__)' 2>/dev/null)
case "$have" in
  "$tag".*) echo "pyslurm: $have already installed, matches Slurm $slurm"; exit 0 ;;
esac

pytag=$("$py" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
arch=$(uname -m)
wheel=$(ls "$vendor"/pyslurm-"$tag".*-"$pytag"-"$pytag"-linux_"$arch".whl 2>/dev/null | sort -V | tail -n 1)
if [ -n "$wheel" ]; then
  need_libslurm "$(basename "$wheel")"
  "$py" -m pip install -q --no-index --no-deps --force-reinstall "$wheel" >/dev/null 2>&1 \
    || skip "the wheel $(basename "$wheel") did not install"
else
  src=$(ls "$vendor"/pyslurm-"$tag".*.tar.gz 2>/dev/null | sort -V | tail -n 1)
  [ -n "$src" ] || skip "no wheel or source for Slurm $slurm ($tag.x) and Python $pytag in $vendor"
  need_libslurm "building $(basename "$src")"
  work=$(mktemp -d) || skip "no temporary directory"
  trap 'rm -rf "$work"' EXIT
  tar xzf "$src" -C "$work" || skip "cannot unpack $(basename "$src")"
  dir=$(ls -d "$work"/pyslurm-* | head -n 1)
  libdir=$(dirname "$(ls /usr/lib/*/libslurm.so /usr/lib64/libslurm.so /usr/lib/libslurm.so 2>/dev/null | head -n 1)")
  echo "pyslurm: building $(basename "$src") for Slurm $slurm (a few minutes)"
  # The tag's own build requirements first; 22.x tags want an old Cython and setuptools, without isolation.
  if ! (cd "$dir" && SLURM_LIB_DIR=$libdir SLURM_INCLUDE_DIR=/usr/include \
          "$py" -m pip wheel -q --no-deps -w "$work/dist" . >"$work/build.log" 2>&1); then
    "$py" -m venv "$work/build" && "$work/build/bin/pip" install -q "Cython>=0.29.30,<3.0" "setuptools==59.2.0" wheel \
        >>"$work/build.log" 2>&1 \
      && (cd "$dir" && SLURM_LIB_DIR=$libdir SLURM_INCLUDE_DIR=/usr/include \
          "$work/build/bin/pip" wheel -q --no-build-isolation --no-deps -w "$work/dist" . >>"$work/build.log" 2>&1) \
      || skip "building $(basename "$src") failed: $(tail -n 1 "$work/build.log")"
  fi
  "$py" -m pip install -q --no-index --no-deps --force-reinstall "$work"/dist/pyslurm-*.whl >/dev/null 2>&1 \
    || skip "the wheel built from $(basename "$src") did not install"
fi
got=$("$py" -c 'import pyslurm; print(pyslurm.__version__)' 2>/dev/null)
case "$got" in
  "$tag".*) echo "pyslurm: $got installed for Slurm $slurm" ;;
  *) "$py" -m pip uninstall -q -y pyslurm >/dev/null 2>&1
     skip "the installed pyslurm does not import or match Slurm $slurm" ;;
esac
