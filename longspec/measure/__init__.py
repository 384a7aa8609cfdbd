"""What a draft achieves where users decode: tau from the question, by context length.

    prompts.py      evaluation prompts from records: chat/CoT questions, document prefixes
    benchfiles.py   LongBench / AIME files as downloaded (`--bench`)
    perprompt.py    each prompt decoded plainly and per method: per-prompt rows
    report.py       length buckets, figures per bucket and per task, result-file names
    chainwalk.py    eval's chain tau over the target's greedy continuations (the walk), for training
    contcache.py    the host's cache of those continuations: a new run folder does not decode them again
    runread.py      a finished stage's run folder as eval and export read it; EvalError
    evalargs.py     `python -m longspec.evaluate`'s flags, their checks, what is not the default
    evalrun.py      one measurement: models (kept between requests on the CPU), prompts, figures, timings

Imports longspec.model, longspec.data and longspec.decode. (A docstring only.)
"""
