#!/usr/bin/env bash
# Start a one-node SLURM cluster on this (Debian) machine, as root, for tests/test_runs_slurm.py:
#   bash tests/helpers/slurm_single_node.sh        # then: python -m pytest -q tests/test_runs_slurm.py
# Installs slurm-wlm's daemons and munge with apt, writes /etc/slurm/slurm.conf for this host
# (all its CPUs, one partition "debug") and starts munged, slurmctld and slurmd in the background.
set -euo pipefail
if ! command -v slurmctld >/dev/null; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge
fi
host=$(hostname -s)
cpus=$(nproc)
mkdir -p /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
chown munge:munge /run/munge 2>/dev/null || true
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=llmforge-test
SlurmctldHost=${host}
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmUser=root
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
NodeName=${host} CPUs=${cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
pgrep -x munged >/dev/null || munged --force
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
sleep 3
sinfo
