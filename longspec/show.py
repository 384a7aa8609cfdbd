"""See what a stage trains: its first records as the trainer encodes them, token by token.

    python -m longspec.show --config-dir DIR/conf +exp=STAGE [key=value ...] [--show K] [--json]

prints {"stage", "collator", "max_seq_length", "records": [{"index", "line", "tokens": [[id, text,
trained], ...], "prompt", "trained", "cut", "chat", "end_of_turn_trained", "untrained_answers"}]}
(`longspec prepare DIR STAGE --show K` renders it: colour on a terminal, brackets without one).
The records are read and encoded by longspec.data.preview.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from longspec.data.preview import DEFAULT_SHOW, show_records

# ----------------------------------------------------------------------------- entry point

FLAGS: dict = {"json": False, "show": DEFAULT_SHOW}


def _take_flags(argv: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--json":
            FLAGS["json"] = True
        elif a == "--show" and i + 1 < len(argv):
            FLAGS["show"] = int(argv[i + 1])
            i += 1
        elif a.startswith("--show="):
            FLAGS["show"] = int(a.split("=", 1)[1])
        else:
            out.append(a)
        i += 1
    return out


def run(cfg) -> dict:
    from longspec.training.entry import TrainError, read_config
    from longspec.data.encoding import load_tokenizer

    conf = read_config(cfg)
    d, train_file = conf["data"], Path(conf["train_file"])
    from longspec.formats.datafiles import names_data

    if not names_data(train_file):
        raise TrainError(f"train_file = {train_file}: file not found")
    tok = load_tokenizer(conf["model_name_or_path"])   # the trainer's own (a pad token set)
    records = show_records(train_file, tok, d["collator"], d["max_seq_length"], max(0, FLAGS["show"]),
                           d.get("on_bad_record", "error"))
    return {"stage": conf["stage"], "collator": d["collator"], "max_seq_length": d["max_seq_length"],
            "train_file": str(train_file), "records": records}


def guarded(cfg) -> int:
    from longspec.data.encoding import DataError
    from longspec.training.entry import EXIT_ERROR, EXIT_INPUT, tool_boundary

    code, r = tool_boundary(run, cfg, json_out=FLAGS["json"],
                            code_of=lambda e: EXIT_INPUT if isinstance(e, DataError) else EXIT_ERROR)
    if r is not None:
        print(json.dumps(r), flush=True)
    return code


def main() -> None:
    from longspec.training.entry import implied_config_dir, make_hydra_entry

    argv = _take_flags(sys.argv[1:])
    sys.argv = [sys.argv[0]] + implied_config_dir(argv)
    make_hydra_entry(guarded)()


if __name__ == "__main__":
    main()
