"""The work behind the verbs: `longspec run`, `stop` and `demo` (build the DeepSpeed launcher command,
start it in its own process group, tee its output, chain the stages), `eval`, `regenerate`, `prepare`,
and every trainer module's command line (trainer.py).

Nothing here imports torch, deepspeed, transformers or hydra: the launcher is a separate process.

  trainer.py   every trainer module's command line (train, prepare, show, evaluate, export, regenerate,
               doctor, draftcheck, tiny), built and started here; the JSON result read back
  argv.py      the DeepSpeed launcher argv (GPUs, nodes, CPU fallback) and override checks
  process.py   one launch: run.json, train.log tee, progress line, Ctrl-C
  group.py     the launch's process group: training ranks, save request, stop escalation, `stop`
  plan.py      what each stage will do (skip/start/resume/rerun) and the run's types
  preflight.py overrides, validation, memory and disk estimates before anything starts
  execute.py   one stage or `--all`: the launches, chaining, resume (`run_request`)
  gate.py      --eval/--gate: measure a finished stage, the quality gate
  evalworker.py the run's one measuring process (`python -m longspec.evaluate --serve`) for its stages
  slurm.py     the sbatch script (one DeepSpeed per-node launcher per SLURM task)
  nodes.py     a run on several nodes over ssh: each node's command and environment, per-host requests
  fanout.py    the leader of such a run (`python -m longspec_cli.launch.fanout`): probe, start, stop, check
  evalrun.py   `eval`'s work: options checked, stages chosen (runs.stagedraft), memory checked, each measured
  evalcheck.py `eval`'s memory check of a finished stage: its device's free memory against longspec/machine/evalmemory.py
  disk.py      disk estimate of a stage's checkpoints and weights (pure arithmetic)
  prepare.py   a stage's prepared-data state with overrides; `python -m longspec.prepare` runs
  regen.py     `regenerate`'s work: options checked, each stage regenerated, --use; the demo's plan
"""
