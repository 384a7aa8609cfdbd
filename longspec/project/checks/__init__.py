"""validate's checks, one small function each, every problem collected (longspec/project/validate.py runs them).

    common.py    Context (the project, the stage's composed data, the problems so far) and helpers
    stage.py     one composed stage file: keys, types, paths, precision, ZeRO, batch, length
    project.py   the chain, lineage forks, the manifest's run folders, multi-node paths
    target.py    the target's family: a draft can be built for it, or the one refusal sentence
    seqpar.py    sequence_parallel_size: world, the target's and draft's head counts, sequence length
"""
