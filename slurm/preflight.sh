# Sourced by every batch file of slurm/ before it starts anything: the environment, the device, the
# head node and its port, the network interface, and the one thing a cluster must give: every node
# sees the same files.
#   sbatch --gres gpu:8 slurm/torchrun.sbatch      # GPU nodes: a process per GPU on each (8 here)
#   DEVICE=cpu sbatch slurm/torchrun.sbatch        # a CPU cluster: one process per node (GPUS_PER_NODE=N: N)
#   NET_INTERFACE=ib0 sbatch ... slurm/torchrun.sbatch # the interface the nodes share (default: the head's)
#   OUTPUT_DIR=... MASTER_PORT=... SCRIPT=...      # where the model goes, the rendezvous port, the script

# Started by bash on a login node, a batch file has no job, no nodes: say so before making anything.
if [[ -z $SLURM_JOB_ID ]]; then
    echo "error: $0 runs as a Slurm job: submit it from the repository root with \`sbatch --gres gpu:N $0\`" \
         "(N GPUs per node; on CPU nodes \`DEVICE=cpu sbatch $0\`)" >&2
    exit 2
fi
if [[ ! -x .venv/bin/python ]]; then
    echo "error: no .venv in $PWD: make it once on the shared filesystem (./test.sh --quick sets it up)" >&2
    exit 2
fi
# The scripts' --device: cuda unless DEVICE says otherwise, so that a job without its GPUs (a missing
# --gres, a broken driver) stops in one line instead of training on the CPU for hours. An option
# --device given to the batch file comes later and wins.
set -- --device "${DEVICE:-cuda}" "$@"
# The nodes' shape, for every batch file, in this one place: a process per GPU sbatch gave each node
# (sbatch --gres gpu:N); GPUS_PER_NODE overrides it (a cluster without gres); a CPU job runs one.
if [[ -z $GPUS_PER_NODE && ${DEVICE:-cuda} == cuda ]] && ((${SLURM_GPUS_ON_NODE:-0} == 0)); then
    echo "error: this job was given no GPUs: submit it with sbatch --gres gpu:N (N GPUs per node;" \
         "GPUS_PER_NODE=N where the cluster has no gres), or with DEVICE=cpu on a CPU cluster" >&2
    exit 2
fi
# A SLURM_JOB_ID left in the environment (a copied shell, an export) makes no job: only a job Slurm
# knows here has the nodes the rest of this file asks for.
if ! scontrol show job "$SLURM_JOB_ID" >/dev/null 2>&1; then
    echo "error: SLURM_JOB_ID is set ($SLURM_JOB_ID), but no Slurm job of that id runs here (scontrol cannot" \
         "show it): $0 runs as a Slurm job: submit it from the repository root with \`sbatch --gres gpu:N $0\`" >&2
    exit 2
fi
export GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
# A job that writes checkpoints (--save-steps) also writes one when Slurm signals it (preemption, or the
# --signal before the time limit), and continues from the last one when it runs again (a requeue, a
# resubmission); --resume starts at step 0 where there is none yet.
[[ " $* " != *" --save-steps"* ]] || set -- "$@" --save-on-signal --resume

# The first node of the job hosts the rendezvous; srun starts rank 0 there.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# One port per job id, so that two jobs sharing a first node do not meet; MASTER_PORT overrides it.
# (The same rule as a plain srun of the scripts, cli.py's use_slurm_task_environment.)
PORT=${MASTER_PORT:-$((15000 + SLURM_JOB_ID % 10000))}
SCRIPT=${SCRIPT:-multi-gpu-distributed-cls.py}
OUTPUT_DIR=$(realpath -m "${OUTPUT_DIR:-output/$(basename "$SCRIPT" .py)}")
export PATH="$PWD/.venv/bin:$PATH" HEAD_NODE PORT SCRIPT OUTPUT_DIR

# The interface gloo and NCCL talk over: NET_INTERFACE (or GLOO_SOCKET_IFNAME), else the one that holds
# the head node's address here. Left to themselves they may pick one the other nodes cannot reach.
head_address=$(getent ahostsv4 "$HEAD_NODE" | awk 'NR == 1 {print $1}')
NET_INTERFACE=${NET_INTERFACE:-${GLOO_SOCKET_IFNAME:-$(ip -o -4 addr show |
    awk -v address="$head_address" '{split($4, cidr, "/")} cidr[1] == address {print $2; exit}')}}
if [[ -z $NET_INTERFACE || $NET_INTERFACE == lo ]] && ((SLURM_NNODES > 1)); then
    echo "error: $HEAD_NODE resolves to ${head_address:-no address} on no interface the other nodes reach:" \
         "set NET_INTERFACE to the one they share (ip -br addr lists them)" >&2
    exit 2
fi
[[ -z $NET_INTERFACE ]] || export GLOO_SOCKET_IFNAME=$NET_INTERFACE NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$NET_INTERFACE}

# A file written here must be there on every node: the same .venv, and the same output folder (rank 0
# saves the model, every rank reads the checkpoint on --resume); and every node has the interface.
# Node-local disks and a wrong interface fail this at once, not after an hour of training.
mkdir -p "$OUTPUT_DIR"
shared_check="$OUTPUT_DIR/.shared-check-$SLURM_JOB_ID"
touch "$shared_check"
srun --nodes "$SLURM_NNODES" --ntasks-per-node 1 bash -c \
    'test -e "$0" -a -x "$1" || exit 3; [[ -z $2 ]] || ip link show dev "$2" >/dev/null 2>&1 || exit 4' \
    "$shared_check" "$PWD/.venv/bin/python" "$NET_INTERFACE" 2>/dev/null
node_check=$?
rm -f "$shared_check"
if ((node_check == 4)); then
    echo "error: network interface $NET_INTERFACE is missing on a node of this job: set NET_INTERFACE to the" \
         "one every node has (ip -br addr lists them)" >&2
    exit 2
elif ((node_check != 0)); then
    echo "error: $OUTPUT_DIR or $PWD/.venv is not on a filesystem every node shares: put the repository (or OUTPUT_DIR) on the cluster's shared filesystem" >&2
    exit 2
fi
echo "network: ${NET_INTERFACE:-chosen by gloo and NCCL} (NET_INTERFACE overrides it)"
