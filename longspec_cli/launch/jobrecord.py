"""`python -m longspec_cli.launch.jobrecord`: the batch script's side of a stage's run record.

    begin OUTPUT_DIR --stage NAME     before the stage's step: phase running (job id, nodes, requeues)
    end OUTPUT_DIR --rc N             after it: phase ended, its exit code
    stop-requested OUTPUT_DIR         exit 0 when `longspec stop` asked this job to stop (the script
                                      then ends without requeueing itself), else 1

`record_submission` is `run --slurm --submit`'s side: every stage the job will run is recorded as
queued under the job id, so `status`, `run` and `stop` see the job before it starts. The record's
format and meaning belong to core/runrecord.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from longspec_cli.core import runrecord


def record_submission(stages: list[tuple[str, Path]], job_id: str, *, nodes: int, ranks_per_node: int,
                      overrides: list[str], script: Path) -> None:
    for name, out in stages:
        runrecord.slurm_submitted(out, name, job_id, nodes=nodes, ranks_per_node=ranks_per_node,
                                  overrides=overrides, script=str(script))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m longspec_cli.launch.jobrecord")
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("begin")
    b.add_argument("output_dir", type=Path)
    b.add_argument("--stage", required=True)
    e = sub.add_parser("end")
    e.add_argument("output_dir", type=Path)
    e.add_argument("--rc", type=int, required=True)
    s = sub.add_parser("stop-requested")
    s.add_argument("output_dir", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.what == "begin":
            runrecord.slurm_stage_begins(args.output_dir, args.stage, dict(os.environ))
        elif args.what == "end":
            runrecord.slurm_stage_ends(args.output_dir, args.rc)
        else:
            info = runrecord.read(args.output_dir)
            job = os.environ.get("SLURM_JOB_ID")
            asked = runrecord.stop_requested(info) and (job is None or str(info.get("job_id")) == job)
            return 0 if asked else 1
    except OSError as e:  # the record is advisory for the job: say so, never end the job over it
        print(f"longspec: run record in {args.output_dir} not written: {e.strerror or e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
