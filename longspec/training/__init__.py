"""One stage's training run on DeepSpeed, and what keeps a rank alive and its folder whole.

    loop.py        the training loop, top to bottom (run -> Session: setup, train, save, finish)
    entry.py       the Hydra entry every `python -m longspec.<module>` shares, read_config, TrainError
    dsconfig.py    the DeepSpeed config from the stage's keys; the step plan
    preflight.py   a stage's checks before any weight loads; the config's origin
    resume.py      which checkpoint a run resumes from
    failure.py     the run's error boundary: `error:` block, error event, a full disk
    runwriter.py   what the trainer writes into output_dir (metrics, checkpoints, stage_complete.json)
    rank.py        one rank: rank / world size, print0, --local_rank, seeded generators, progress
    preempt.py     stop signals: SIGTERM/SIGUSR1 save a checkpoint, a second one exits at once
    positions.py   anchor-offset position ids, noisy cross-attention lag
    simtau.py      tau while training: held-out records, when to measure, best/

May import every other group. (A docstring only: `longspec.nodelaunch` imports preempt.py without
loading torch.)
"""
