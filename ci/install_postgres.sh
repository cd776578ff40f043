#!/usr/bin/env bash
# Install Debian's PostgreSQL server and the psycopg 3 driver for the lifecycle catalog tests.
#   bash ci/install_postgres.sh            # into the active Python env (or ./.venv if none is active)
# Idempotent: skips apt when a server (initdb) is already installed and pip when psycopg imports.
# The tests start their own throwaway server (initdb in a temp dir, as a non-root user); this script
# never starts, enables or configures a system cluster.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

have_server() { ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1; }

if have_server; then
  echo "[install_postgres] PostgreSQL server already installed: $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | head -n1)"
elif command -v apt-get >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "[install_postgres] need root or sudo for apt-get" >&2; exit 1; }
    sudo="sudo"
  fi
  echo "[install_postgres] apt-get install postgresql"
  export DEBIAN_FRONTEND=noninteractive
  # Keep the package's maintainer scripts from starting a system cluster inside containers.
  policy=/usr/sbin/policy-rc.d
  added_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null && $sudo chmod +x "$policy" && added_policy=1
  fi
  trap '[ "$added_policy" = 1 ] && $sudo rm -f "$policy"' EXIT
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends postgresql postgresql-contrib
  have_server || { echo "[install_postgres] apt-get finished but no initdb was found" >&2; exit 1; }
else
  echo "[install_postgres] no apt-get on this machine; install a PostgreSQL server (initdb, pg_ctl) by other means" >&2
  exit 1
fi

if [ -z "${VIRTUAL_ENV:-}" ] && [ -x "$root/.venv/bin/python" ]; then
  py="$root/.venv/bin/python"
else
  py="$(command -v python3 || command -v python)"
fi
if "$py" -c 'import psycopg' >/dev/null 2>&1; then
  echo "[install_postgres] psycopg already importable: $("$py" -c 'import psycopg; print(psycopg.__version__)')"
else
  echo "[install_postgres] pip install psycopg[binary]"
  "$py" -m pip install --disable-pip-version-check -q "psycopg[binary]>=3.1"
fi
"$py" -c 'import psycopg; print(f"[install_postgres] ok: psycopg {psycopg.__version__} ({psycopg.pq.__impl__})")'
