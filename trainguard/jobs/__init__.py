"""Jobs: what runs on this node and who owns it. Job sources (SLURM, declared processes), the shared cached
`JobCatalog`, the `Job` model with trusted pids, and a job's processes, log files and heartbeat (`tree`).

May import: trainguard.core, trainguard.node.
"""
