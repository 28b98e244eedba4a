# Sourced by every batch file of slurm/ before it starts anything: the head node, the rendezvous
# port, the environment, and the one thing a cluster must give: every node sees the same files.

# The first node of the job hosts the rendezvous; srun starts rank 0 there.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# One port per job id, so that two jobs sharing a first node do not meet; MASTER_PORT overrides it.
# (The same rule as a plain srun of the scripts, cli.py's use_slurm_task_environment.)
PORT=${MASTER_PORT:-$((15000 + SLURM_JOB_ID % 10000))}
SCRIPT=${SCRIPT:-multi-gpu-distributed-cls.py}
OUTPUT_DIR=$(realpath -m "${OUTPUT_DIR:-output/$(basename "$SCRIPT" .py)}")
export PATH="$PWD/.venv/bin:$PATH" HEAD_NODE PORT SCRIPT OUTPUT_DIR

# A file written here must be there on every node: the same .venv, and the same output folder (rank 0
# saves the model, every rank reads the checkpoint on --resume). Node-local disks fail this at once,
# not after an hour of training.
mkdir -p "$OUTPUT_DIR"
shared_check="$OUTPUT_DIR/.shared-check-$SLURM_JOB_ID"
touch "$shared_check"
if ! srun --nodes "$SLURM_NNODES" --ntasks-per-node 1 test -e "$shared_check" -a -x "$PWD/.venv/bin/python" \
        2>/dev/null; then
    echo "error: $OUTPUT_DIR or $PWD/.venv is not on a filesystem every node shares: put the repository (or OUTPUT_DIR) on the cluster's shared filesystem" >&2
    rm -f "$shared_check"
    exit 2
fi
rm -f "$shared_check"
