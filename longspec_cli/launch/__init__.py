"""`longspec run`, `stop` and `demo`: build the DeepSpeed launcher command, start it in its own
process group, tee its output, chain the stages.

Nothing here imports torch, deepspeed, transformers or hydra: the launcher is a separate process.

  argv.py      the DeepSpeed launcher argv (GPUs, nodes, CPU fallback) and override checks
  process.py   process group, signals, run.json, train.log tee, progress line, stop
  pipeline.py  one stage or `--all`: preflight, skip/stale, chaining, resume
  slurm.py     the sbatch script (one DeepSpeed per-node launcher per SLURM task)
  memory.py    per-GPU memory estimate of a stage (pure arithmetic)
"""
