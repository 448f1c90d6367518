"""The launcher's process of `pd train` (rank 0's under torchrun or srun): it checks everything
the files and options show before any worker starts (`job`, `preflight`), owns the checkpoint
folder (`folder_lock`, `session`), starts and watches the workers (`launch`, `network`, `scratch`;
`external` and `cluster_env` under torchrun or SLURM) and reports. What it hands a worker and
gets back is `runtime.run`."""
