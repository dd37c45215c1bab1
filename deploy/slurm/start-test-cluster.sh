#!/usr/bin/env bash
# Starts a one-node Slurm cluster on this machine (munged, slurmctld, slurmd, all as root) for
# tests/deploy/test_slurm.py, and waits until its node takes jobs. For a fresh Debian 12 machine or
# container as root (what CI and the dev machines are); idempotent: rerun, it changes nothing that is
# already right and is quick. Not a production setup: no accounting database, no cgroups (a container
# usually cannot delegate them), the daemons run as root.
set -euo pipefail

conf_dir=/etc/slurm
log_dir=/var/log/slurm
wait_s=${GRADQ_SLURM_WAIT:-60}

# Debian 12 ships Slurm 22.05 (slurm-wlm: slurmctld, slurmd and the client commands) and munge.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
    || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi

# Munge authenticates every Slurm message: one key, readable by the munge user only.
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    install -d -o munge -g munge -m 755 /run/munge
    install -d -o munge -g munge -m 700 /var/lib/munge /var/log/munge
    runuser -u munge -- munged  # daemonizes once its socket is up
fi
munge -n | unmunge >/dev/null

# One node, this host, with the CPUs and memory slurmd itself detects (a node claiming more than
# slurmd finds is drained). No cgroups: processes are tracked by their parent chain (linuxproc),
# tasks are not bound (task/none), and no job accounting is gathered or stored, so `sacct` has
# nothing; a finished job's state stays readable in `scontrol show job` for MinJobAge seconds.
node=$(hostname -s)
hardware=$(slurmd -C | head -n 1 | grep -o 'CPUs=.*RealMemory=[0-9]*')
config=$(cat <<EOF
# Written by deploy/slurm/start-test-cluster.sh: a one-node test cluster.
ClusterName=gradqtest
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MinJobAge=600
KillWait=30
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$log_dir/slurmctld.log
SlurmdLogFile=$log_dir/slurmd.log
NodeName=$node $hardware State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
)

# A daemon of ours is running when its pid file names a live process of that name.
running() {
    local pid
    pid=$(cat "/run/$1.pid" 2>/dev/null) && [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ]
}

stop() {
    local pid
    running "$1" || return 0
    pid=$(cat "/run/$1.pid")
    kill "$pid"
    while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
}

mkdir -p "$conf_dir" "$log_dir" /var/spool/slurmctld /var/spool/slurmd
if [ "$(cat "$conf_dir/slurm.conf" 2>/dev/null)" != "$config" ]; then
    # A changed configuration (or none yet): the daemons running on the old one start again on the new.
    stop slurmd
    stop slurmctld
    printf '%s\n' "$config" >"$conf_dir/slurm.conf"
fi
running slurmctld || slurmctld
running slurmd || slurmd

# Wait for the node, not a fixed time: slurmd registers within seconds of slurmctld answering.
deadline=$((SECONDS + wait_s))
until state=$(sinfo --noheader --nodes="$node" --format=%T 2>/dev/null) \
    && [[ $state =~ ^(idle|mixed|allocated)$ ]]; do
    if [[ ${state:-} =~ ^(drain|drained|draining|down) ]]; then
        # Left down or drained by an earlier run (a killed slurmd, a changed node): take it back.
        scontrol update NodeName="$node" State=RESUME 2>/dev/null || true
    fi
    if [ $SECONDS -ge $deadline ]; then
        echo "start-test-cluster.sh: node $node is '${state:-unknown}' after ${wait_s} s, not idle" >&2
        tail -n 20 "$log_dir/slurmctld.log" "$log_dir/slurmd.log" >&2 || true
        exit 1
    fi
    sleep 0.5
done
echo "slurm $(sinfo --version | awk '{print $2}'): node $node $state ($hardware)"
