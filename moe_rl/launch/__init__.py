"""Multi-node launches: render SLURM batch scripts, and the helpers those scripts run.

- `slurm.py`: `render_script()` turns a run config and a node shape into an sbatch
  script from the template in `launch/slurm/`; `submit()` hands it to `sbatch`.
- `plan.py`: which nodes train and which serve rollouts, checked before anything runs.
- `task.py`: small commands the job runs on its nodes (`rank-env`, `wait-healthy`,
  `finished`, `prepare-model`), kept in Python so they are tested like the rest.
- `standin.py`: stand-ins for `srun`, `sbatch` and `scontrol` that run a rendered
  script on one machine, each "node" a local process group (the CPU rehearsal).
- `cli.py`: `moe-rl launch slurm ...`.

Nothing here imports torch or megatron at module level: the job's helpers start fast.
"""
