"""Tokenize a stage's train_file once into the prepared cache (longspec.data.cache); the trainer
reads that cache.

    python -m longspec.prepare --config-dir DIR/conf +exp=STAGE [key=value ...] [--workers N]
        [--world N] [--json]

The stage is composed by the trainer's own Hydra entry (same primary config and search path).
Exit codes: 0 ok, 1 refused (a config error; more records with nothing to train within
max_seq_length than data.max_untrainable_share allows), 3 unreadable input (a malformed record).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from longspec.data.cache import CacheWriteError, UntrainableRefused, default_workers, ensure
from longspec.formats import datafiles, prepared as P

# ----------------------------------------------------------------------------- entry point

def _take_flags(argv: list[str]) -> tuple[list[str], dict]:
    flags = {"json": False, "workers": None, "world": None}
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--json":
            flags["json"] = True
        elif a in ("--workers", "--world") and i + 1 < len(argv):
            flags[a[2:]] = int(argv[i + 1])
            i += 1
        elif a.startswith(("--workers=", "--world=")):
            k, v = a[2:].split("=", 1)
            flags[k] = int(v)
        else:
            out.append(a)
        i += 1
    return out, flags


FLAGS: dict = {}


def run(cfg) -> dict:
    from longspec.training.entry import TrainError, read_config

    conf = read_config(cfg)
    d = conf["data"]
    target = conf["model_name_or_path"]
    train_file = Path(conf["train_file"])
    if not datafiles.names_data(train_file):
        raise TrainError(f"train_file = {train_file}: file not found")
    workers = FLAGS.get("workers") or default_workers(d["collator"], _size(train_file))
    world = FLAGS.get("world") or int(os.environ.get("WORLD_SIZE", "1"))
    t0 = time.monotonic()
    ds, man, built = ensure(train_file, target, d, workers=workers, label=f"[{conf['stage']}] prepare")
    return {**P.result_of(man, conf, world, ds.folder, built, time.monotonic() - t0), "workers": workers}


def _size(train_file: Path) -> int:
    try:
        return datafiles.resolve(train_file).size
    except (datafiles.SourceError, OSError):
        return 0                            # the build names what is wrong


def _print_summary(r: dict) -> None:
    print("\n".join(P.result_text(r)), file=sys.stderr, flush=True)


def guarded(cfg) -> int:
    from longspec.data.encoding import DataError
    from longspec.training.entry import EXIT_ERROR, EXIT_INPUT, tool_boundary

    def code_of(e: BaseException) -> int:
        refused = isinstance(e, (CacheWriteError, UntrainableRefused))     # not unreadable input
        return EXIT_INPUT if isinstance(e, DataError) and not refused else EXIT_ERROR

    code, r = tool_boundary(run, cfg, json_out=bool(FLAGS.get("json")), extra_errors=(CacheWriteError,),
                            code_of=code_of)
    if r is not None:
        if FLAGS.get("json"):
            print(json.dumps(r), flush=True)
        _print_summary(r)
    return code


def main() -> None:
    """`python -m longspec.prepare [--json] --config-dir DIR/conf +exp=STAGE [overrides]`: the stage
    composed by the trainer's own Hydra entry (same primary config and search path)."""
    from longspec.training.entry import implied_config_dir, make_hydra_entry
    from longspec.machine import cudaarch

    cudaarch.fix_environ()                       # an arch list DeepSpeed can parse, if it builds an op
    argv, flags = _take_flags(sys.argv[1:])
    FLAGS.update(flags)
    sys.argv = [sys.argv[0]] + implied_config_dir(argv)
    make_hydra_entry(guarded)()      # returns on success only (exit codes leave through sys.exit)
    # The cache and the result are written: skip the interpreter's teardown (seconds on a busy CPU).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

if __name__ == "__main__":
    main()
