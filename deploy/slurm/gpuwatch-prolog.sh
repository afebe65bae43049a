#!/usr/bin/env bash
# Slurm node prolog: refuse to start a job on a node whose NCCL environment or hardware is known bad.
#
# slurm.conf:  Prolog=/etc/slurm/gpuwatch-prolog.sh   (runs as root on every allocated node before the job)
#
# It runs `gpuwatch diagnose --preflight --fail-on critical` against this node (sysfs, NVML, and the NCCL_*
# variables of the prolog's environment: slurmd does not pass the job's environment to the prolog, so set the
# site-wide NCCL variables your jobs inherit in GPUWATCH_PROLOG_ENV, a file of VAR=value lines, and they are
# checked too). On a critical finding it drains the node with the finding as the reason, e.g.
#     NCCL001: NCCL_IB_DISABLE=1 while 4 InfiniBand/RoCE port(s) are active on gpu-17: ...
# and exits 1, so Slurm requeues the job elsewhere (Slurm may then set the reason to "Prolog error"; the
# finding is also written to the prolog's stderr, which slurmd logs).
# A diagnose that cannot run (not installed, crashed) never blocks jobs: it is logged and the prolog exits 0.
#
# Knobs (environment): GPUWATCH (the gpuwatch command), SCONTROL (the scontrol command), GPUWATCH_SYSFS_ROOT,
# GPUWATCH_PROLOG_ENV, GPUWATCH_PROLOG_ARGS (extra diagnose flags, e.g. "--ignore HW005").
set -uo pipefail

gpuwatch=${GPUWATCH:-gpuwatch}
scontrol=${SCONTROL:-scontrol}
node=${SLURMD_NODENAME:-$(hostname -s)}

log() { echo "gpuwatch-prolog[$node]: $*" >&2; }

if [[ -n "${GPUWATCH_PROLOG_ENV:-}" && -r "$GPUWATCH_PROLOG_ENV" ]]; then
    set -a
    # shellcheck disable=SC1090
    source "$GPUWATCH_PROLOG_ENV"
    set +a
fi

# shellcheck disable=SC2086
report=$("$gpuwatch" diagnose --preflight --fail-on critical --format json \
         --sysfs-root "${GPUWATCH_SYSFS_ROOT:-/sys}" ${GPUWATCH_PROLOG_ARGS:-})
status=$?

case $status in
    0) exit 0 ;;
    1) ;;  # a critical finding: drain below
    *) log "gpuwatch diagnose failed (exit status $status); not draining"; exit 0 ;;
esac

# The first critical finding, as "CODE: title", on one line and short enough for a node reason.
reason=$(printf '%s' "$report" | python3 -c '
import json, sys
findings = [f for f in json.load(sys.stdin)["findings"] if f["severity"] == "critical"]
first = findings[0]
more = f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""
text = " ".join((first["code"] + ": " + first["title"]).split())
print(text[:200 - len(more)] + more)
' 2>/dev/null) || reason="gpuwatch diagnose --preflight found a critical problem"

log "draining: $reason"
"$scontrol" update nodename="$node" state=drain reason="gpuwatch: $reason" \
    || log "scontrol update failed; the node is NOT drained"
exit 1
