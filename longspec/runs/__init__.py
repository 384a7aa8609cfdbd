"""Runs and their state: the run-folder contract, who owns a folder, what each stage's state is
(torch-free: the front end imports this group; the trainer writes through runfolder's names).

    runfolder.py    the run-folder contract: metrics lines and their meaning, stage_complete, a
                    stage's finished draft, the fingerprint
    runrecord.py    a stage's run record (run.json): a local process group or a SLURM job; `owner`
    scheduler.py    what SLURM says of a job (`scontrol show job`), `scancel`; bounded calls
    status.py       StageState per stage, and what `run` would do next
    quality.py      eval.json and the quality gate
    stagedraft.py   the draft of a stage as eval, export and serve use it (or the refusal: none finished)
    draftpick.py    which draft a stage starts from (final or best/), the draft key a stage composes to
    regenstate.py   a regeneration folder as status/validate see it (progress, target digest, rows)
    diskspace.py    free space, failed writes and the checkpoint a rerun resumes from

(A docstring only: nothing loads through the package.)
"""
