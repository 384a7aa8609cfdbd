"""A project and its stage configs: longspec.yaml, presets, Hydra composition, validation
(torch-free: the front end imports this group; Hydra and OmegaConf only when a stage composes).

    manifest.py        longspec.yaml: Manifest / StageSpec dataclasses, load, find
    presets.py         target presets (qwq-32b-preview, qwen3-8b, ..., tiny) and the templates folder
    sizing.py          stages sized to the target and the machine (init): the recipe, fitted GPU
                       batches, or short CPU stages with their cost
    targets.py         supported target families and the one refusal sentence; a target folder's
                       config.json / tokenizer files read as JSON
    placeholders.py    `[Your Directory]`, `<path>`, ... found as text before parsing
    composed.py        Composed: a composed stage (data, origins, files, problems; to/from JSON)
    stageview.py       StageView: the typed settings of a composed stage, config.yaml's defaults read once
    hydracompose.py    compose a stage with Hydra itself, exactly as the trainer does; provenance
    hydraproblems.py   Hydra's errors as Problems with fixes
    composecache.py    compositions kept between commands, keyed by every file Hydra read
    schema.py          known keys, types and ranges of a stage config (both dialects)
    problem.py         Problem(severity, file, line, key, message, hint)
    mathkeys.py        which config keys change what is trained (resume and status compare them)
    serverkeys.py      which variable each regeneration server's key is read from; never a value
    validate.py        validate_paths() -> Report; its checks are checks/

Imports files/, formats/, runs/ (a stage's prepared and regenerated state), machine/ (sizing:
GPUs and the memory estimate) and `longspec.errors`.
(A docstring only: nothing loads through the package.)
"""
