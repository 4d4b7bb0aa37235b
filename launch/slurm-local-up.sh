#!/usr/bin/env bash
# Start a SLURM cluster on this machine, as root, without systemd: munged, MariaDB (TCP on
# 127.0.0.1), slurmdbd (accounting, which `sacct` and so submitit need), slurmctld and one slurmd
# per node (default one node, the machine itself; NODES=2 adds a second slurmd on the same host
# so that a multi-node job, e.g. slurm/torchrun.sbatch, really spans two SLURM nodes).
# Every file (configs, state, logs, pid files, sockets, the database) lives under ROOT, so
# `launch/slurm-local-down.sh ROOT` stops exactly what this started.
#
#   apt-get install slurmctld slurmd slurm-client munge slurmdbd mariadb-server   # once
#   launch/slurm-local-up.sh /tmp/slurm [NODES] && . /tmp/slurm/env.sh            # SLURM_CONF
#   cluster-fl grid configs/grids/slurm-ci.yaml --cluster slurm --wait
#   launch/slurm-local-down.sh /tmp/slurm
#
# Why each setting (measured with Debian's SLURM 22.05):
#   proctrack/linuxproc + task/none   no cgroups or systemd needed
#   cons_tres + CR_Core_Memory        CPUs and memory are consumable; DefMemPerCPU keeps a job
#                                     without --mem from taking the whole node
#   cred_expire=10                    a requeued job starts again after ~10 s instead of 121 s
#   NodeAddr=127.0.0.1                nothing leaves the loopback interface
#   GresTypes=gpu + gres.conf         only when /dev/nvidia* exist (gpus_per_task > 0)
#   NodeName=$(hostname) NodeAddr=...   node k > 1 is $(hostname)-k, same host, its own slurmd port
# Ports: SLURM_LOCAL_PORT (default 6817) for slurmctld, +1 the first slurmd, +2 slurmdbd,
# +3 MariaDB, +2+k the slurmd of node k > 1.
set -euo pipefail
ROOT=${1:?usage: slurm-local-up.sh ROOT [NODES]}
NODES=${2:-1}
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd -P)
PORT=${SLURM_LOCAL_PORT:-6817}
HOST=$(hostname -s)
CLUSTER=${SLURM_LOCAL_CLUSTER:-cfl}

die() { echo "slurm-local-up: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (the daemons and jobs run as root here)"
for bin in munged mariadb-install-db mariadbd slurmdbd slurmctld slurmd sbatch sacct; do
  command -v "$bin" >/dev/null || [ -x "/usr/sbin/$bin" ] || die "$bin not found; install the \
Debian packages: apt-get install slurmctld slurmd slurm-client munge slurmdbd mariadb-server"
done
export PATH="$PATH:/usr/sbin:/sbin"
[[ "$NODES" =~ ^[1-9][0-9]?$ ]] || die "NODES must be a number from 1 to 99, got $NODES"
for pidfile in "$ROOT"/run/*.pid; do
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    die "$(basename "$pidfile" .pid) already runs from $ROOT (stop it: launch/slurm-local-down.sh $ROOT)"
  fi
done

for p in $(seq "$PORT" $((PORT + 3))) $(seq $((PORT + 4)) $((PORT + 2 + NODES))); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
    die "port $p is taken (another cluster?); choose other ports with SLURM_LOCAL_PORT=N"
  fi
done

mkdir -p "$ROOT"/{etc,run,log,state,spool,mysql}
chmod 0755 "$ROOT" "$ROOT"/{etc,run,log,state,spool}
SOCK="$ROOT/run/munge.socket"
rm -f "$ROOT"/log/*.log  # each start reads only its own logs

# wait_for SECONDS WHAT COMMAND...: poll until COMMAND succeeds, or fail naming WHAT and its log
wait_for() {
  local limit=$1 what=$2 log=$3; shift 3
  for _ in $(seq $((limit * 5))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  echo "slurm-local-up: $what did not come up within ${limit}s; last lines of $log:" >&2
  tail -n 20 "$log" >&2 || true
  exit 1
}

# --- munge: a key of our own, a socket under ROOT
if [ ! -f "$ROOT/etc/munge.key" ]; then
  dd if=/dev/urandom of="$ROOT/etc/munge.key" bs=1024 count=1 status=none
fi
chmod 0600 "$ROOT/etc/munge.key"
munged --force --socket="$SOCK" --key-file="$ROOT/etc/munge.key" \
  --pid-file="$ROOT/run/munged.pid" --log-file="$ROOT/log/munged.log" \
  --seed-file="$ROOT/run/munged.seed"
wait_for 10 munged "$ROOT/log/munged.log" munge --socket="$SOCK" -n

# --- MariaDB for slurmdbd: its package starts it only under systemd, so start it here
DB_PORT=$((PORT + 3))
if [ ! -d "$ROOT/mysql/mysql" ]; then
  mariadb-install-db --no-defaults --datadir="$ROOT/mysql" --user=root \
    --auth-root-authentication-method=normal --skip-test-db >"$ROOT/log/mariadb-install.log" 2>&1 \
    || { tail -n 20 "$ROOT/log/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
fi
mariadbd --no-defaults --user=root --datadir="$ROOT/mysql" --socket="$ROOT/run/mysqld.sock" \
  --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$ROOT/run/mysqld.pid" \
  --log-error="$ROOT/log/mysqld.log" --skip-log-bin --innodb-buffer-pool-size=64M \
  --innodb-log-file-size=32M --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
wait_for 60 MariaDB "$ROOT/log/mysqld.log" \
  mariadb --no-defaults --socket="$ROOT/run/mysqld.sock" -uroot -e "SELECT 1"
mariadb --no-defaults --socket="$ROOT/run/mysqld.sock" -uroot -e "
  CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"

# --- configs
cat >"$ROOT/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$SOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$((PORT + 2))
SlurmUser=root
LogFile=$ROOT/log/slurmdbd.log
PidFile=$ROOT/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
chmod 0600 "$ROOT/etc/slurmdbd.conf"

# the machine as slurmd sees it (sockets, cores, threads, memory); every node is this machine
HW=$(slurmd -C | head -n 1 | sed "s/^NodeName=[^ ]* //")
CPUS=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$HW")
MEM=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$HW")
GRES=""
GPUS=$(ls /dev/nvidia[0-9]* 2>/dev/null | wc -l || true)
if [ "$GPUS" -gt 0 ]; then
  GRES="GresTypes=gpu"
  HW="$HW Gres=gpu:$GPUS"
  echo "Name=gpu File=/dev/nvidia[0-$((GPUS - 1))]" >"$ROOT/etc/gres.conf"
fi
node_name() { if [ "$1" = 1 ]; then echo "$HOST"; else echo "$HOST-$1"; fi; }
node_port() { if [ "$1" = 1 ]; then echo $((PORT + 1)); else echo $((PORT + 2 + $1)); fi; }
NODE_LINES=""
for k in $(seq "$NODES"); do
  NODE_LINES+="NodeName=$(node_name "$k") NodeAddr=127.0.0.1 NodeHostname=$HOST Port=$(node_port "$k") $HW State=UNKNOWN"$'\n'
  mkdir -p "$ROOT/spool/$(node_name "$k")"
done
cat >"$ROOT/etc/slurm.conf" <<EOF
# $NODES-node cluster on one machine, written by launch/slurm-local-up.sh
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$SOCK,cred_expire=10
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$((MEM / CPUS / 2))
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 2))
AccountingStoragePass=$SOCK
JobCompType=jobcomp/none
$GRES
$NODE_LINES
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$ROOT/etc/slurm.conf"
cat >"$ROOT/env.sh" <<EOF
export SLURM_CONF=$SLURM_CONF
EOF

# --- daemons: accounting first (slurmctld registers the cluster with it), the controller, the nodes
slurmdbd  # reads slurmdbd.conf next to $SLURM_CONF
wait_for 60 slurmdbd "$ROOT/log/slurmdbd.log" sacctmgr -n list cluster
slurmctld -f "$SLURM_CONF"
wait_for 30 slurmctld "$ROOT/log/slurmctld.log" scontrol ping
for k in $(seq "$NODES"); do
  slurmd -f "$SLURM_CONF" -N "$(node_name "$k")"
done
nodes_idle() { [ "$(sinfo -h -N -t idle -o %N | wc -l)" = "$NODES" ]; }
wait_for 30 "slurmd (all $NODES nodes idle)" "$ROOT/log/slurmd-$HOST.log" nodes_idle
wait_for 30 "accounting (sacct)" "$ROOT/log/slurmctld.log" sacct -n -X -S now
echo "SLURM up: cluster $CLUSTER, $NODES node(s) on $HOST ($CPUS CPUs, $MEM MB each) under $ROOT"
echo "export SLURM_CONF=$SLURM_CONF    # or: . $ROOT/env.sh"
