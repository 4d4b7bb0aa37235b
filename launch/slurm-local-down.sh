#!/usr/bin/env bash
# Stop the cluster that `launch/slurm-local-up.sh ROOT` started: cancel its jobs, then stop every
# slurmd, slurmctld, slurmdbd, MariaDB and munged by the pid files under ROOT (SIGTERM, then
# SIGKILL after 20 s). Safe to run twice, or after a half-finished start.
#   launch/slurm-local-down.sh /tmp/slurm [--purge]     # --purge also deletes ROOT
set -uo pipefail
ROOT=${1:?usage: slurm-local-down.sh ROOT [--purge]}
[ -d "$ROOT" ] || { echo "slurm-local-down: no $ROOT"; exit 0; }
ROOT=$(cd "$ROOT" && pwd -P)
export PATH="$PATH:/usr/sbin:/sbin"
export SLURM_CONF="$ROOT/etc/slurm.conf"

alive() { [ -f "$ROOT/run/$1.pid" ] && kill -0 "$(cat "$ROOT/run/$1.pid")" 2>/dev/null; }

# jobs first, while the controller and the node still run, so no step outlives the cluster
if alive slurmctld; then
  scancel --full --quiet $(squeue -h -o %A 2>/dev/null | sort -u) 2>/dev/null || true
  for _ in $(seq 150); do
    [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break
    sleep 0.2
  done
fi

stop() {  # stop NAME: SIGTERM the pid in ROOT/run/NAME.pid, wait, SIGKILL if it lingers
  local name=$1 pid
  [ -f "$ROOT/run/$name.pid" ] || return 0
  pid=$(cat "$ROOT/run/$name.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "slurm-local-down: $name ($pid) ignored SIGTERM; SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null
    fi
  fi
  rm -f "$ROOT/run/$name.pid"
}
for pidfile in "$ROOT"/run/slurmd-*.pid; do
  [ -f "$pidfile" ] && stop "$(basename "$pidfile" .pid)"
done
for name in slurmctld slurmdbd mysqld munged; do stop "$name"; done
# slurmstepd processes of this cluster's jobs (if a job could not be cancelled): they hold
# SLURM_CONF=ROOT/etc/slurm.conf or run from ROOT/spool
for proc in /proc/[0-9]*; do
  pid=${proc#/proc/}
  exe=$(readlink "$proc/exe" 2>/dev/null) || continue
  case "$exe" in */slurmstepd) ;; *) continue ;; esac
  if tr '\0' '\n' <"$proc/environ" 2>/dev/null | grep -qx "SLURM_CONF=$SLURM_CONF"; then
    echo "slurm-local-down: stray slurmstepd $pid; SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null
  fi
done
echo "SLURM down: $ROOT"
if [ "${2:-}" = "--purge" ]; then rm -rf "$ROOT"; fi
