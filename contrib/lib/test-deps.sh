#!/usr/bin/env bash
# Debian packages the tests use beyond Slurm and the databases (their own scripts install those):
# the venv module for `make install`, headless Chromium for the HTML report's check.
# `make test-deps` runs it; `make test` and .ci/run both depend on it. Needs root only to install.
set -euo pipefail
need=()
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
command -v chromium >/dev/null || need+=(chromium)
if [ "${#need[@]}" -eq 0 ]; then exit 0; fi
echo "test-deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"
