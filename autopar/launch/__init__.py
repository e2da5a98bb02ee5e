"""``autopar launch``: the per-node torchrun command lines (or a Slurm sbatch script) that run a plan."""
