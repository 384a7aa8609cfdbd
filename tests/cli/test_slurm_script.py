"""The sbatch script's own logic, run by bash as SLURM runs it (one node), without a cluster.

A stand-in stands for the per-node launcher (it takes SIGUSR1/SIGTERM as the ranks do: it saves and
exits 5) and for next-stage; `scontrol` and `scancel` are stand-ins that note what they were asked;
the run record is the real one (python -m longspec_cli.launch.jobrecord). The real cluster runs are
tests/cluster/test_slurm_run.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from longspec.runs import runrecord
from longspec_cli.launch import slurm as S

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = r"""#!/bin/bash
# the job's Python: the node launcher and next-stage are stand-ins, the rest is the real interpreter
case " $* " in
  *" longspec.nodelaunch "*) exec "$REAL_PY" "$STAGE_PY" "$@" ;;
  *" next-stage "*) echo "next-stage $*" >> "$NOTES"; sleep "${CHAIN_S:-0}"; exit 0 ;;
  *) exec "$REAL_PY" "$@" ;;
esac
"""

STAGE_PY = r"""
import json, os, signal, sys, time
from pathlib import Path
out = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("output_dir=")))
notes = open(os.environ["NOTES"], "a")
got = []
for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
print(f"stage {out.name} begins", file=notes, flush=True)
if os.environ.get("FAIL_STAGE") == out.name:
    sys.exit(3)
deadline = time.monotonic() + float(os.environ.get("STAGE_S", "0.5"))
while time.monotonic() < deadline and not got:
    time.sleep(0.05)
time.sleep(0.3)  # a copy of the same request would arrive now
if got:
    print(f"stage {out.name} got {got}", file=notes, flush=True)
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"event": "preempted", "step": 3, "signal": "SIG" + got[0]}) + "\n")
    sys.exit(5)
(out / "stage_complete.json").write_text("{}")
"""


def setup(tmp_path: Path, **env) -> tuple[Path, dict]:
    bin_ = tmp_path / "bin"
    bin_.mkdir(parents=True)
    notes = tmp_path / "notes"
    for name, body in {"python": STAND_IN,
                       "scontrol": '#!/bin/sh\ncase "$1 $2" in\n  "show hostnames") echo node1 ;;\n'
                                   '  "show node") echo "NodeName=node1 NodeAddr=127.0.0.1 State=IDLE" ;;\n'
                                   f'  *) echo "scontrol $*" >> {notes} ;;\nesac\n',
                       "scancel": f'#!/bin/sh\necho "scancel $*" >> {notes}\n'}.items():
        (bin_ / name).write_text(body)
        (bin_ / name).chmod(0o755)
    (tmp_path / "stage.py").write_text(STAGE_PY)
    stages = [S.SlurmStage(n, tmp_path / "runs" / n, ["--module", "longspec.train", f"output_dir={tmp_path / 'runs' / n}"],
                           nxt) for n, nxt in (("base", "long"), ("long", None))]
    text = S.sbatch_script(project=tmp_path, job_name="x", nodes=1, gpus_per_node=1, stages=stages, cpu=True,
                           python=str(bin_ / "python"))
    script = tmp_path / "longspec.sbatch"
    script.write_text(text)
    os.utime(script, (time.time() - 60, time.time() - 60))
    full = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "REAL_PY": sys.executable,
            "STAGE_PY": str(tmp_path / "stage.py"), "NOTES": str(notes), "PYTHONPATH": str(ROOT),
            "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1", "SLURM_NODEID": "0", **env}
    return script, full


def start(script: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def notes(tmp_path: Path) -> list[str]:
    path = tmp_path / "notes"
    return path.read_text().splitlines() if path.exists() else []


def wait_note(tmp_path: Path, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in n for n in notes(tmp_path)):
        assert time.monotonic() < deadline, f"no note {text!r}: {notes(tmp_path)}"
        time.sleep(0.05)


def test_a_signal_during_a_stage_is_passed_on_once_and_the_job_requeues(tmp_path):
    script, env = setup(tmp_path, STAGE_S="60")
    job = start(script, env)
    wait_note(tmp_path, "stage base begins")
    job.send_signal(signal.SIGUSR1)  # SLURM's --signal=B:USR1@S reaches the batch shell alone
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert "stage base got ['SIGUSR1']" in notes(tmp_path)  # passed on once
    assert "scontrol requeue 42" in notes(tmp_path) and "stage long begins" not in notes(tmp_path)
    assert "SIGUSR1 reached the batch script" in err and "stage base saved a checkpoint and stopped (exit 5)" in err
    rec = runrecord.read(tmp_path / "runs" / "base")
    assert (rec["kind"], rec["job_id"], rec["phase"], rec["returncode"]) == ("slurm", "42", "ended", 5)


def test_a_signal_between_stages_requeues_before_the_next_stage(tmp_path):
    script, env = setup(tmp_path, CHAIN_S="2")
    job = start(script, env)
    wait_note(tmp_path, "next-stage")
    job.send_signal(signal.SIGUSR1)  # during next-stage
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert "scontrol requeue 42" in notes(tmp_path) and "stage long begins" not in notes(tmp_path)
    assert "SIGUSR1 came between stages, before stage long" in err

    # The requeued job: base finished earlier in this job (after the script was written): not run again.
    (tmp_path / "notes").unlink()
    job = start(script, env)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert "stage base begins" not in notes(tmp_path) and "stage long begins" in notes(tmp_path)
    assert "stage base finished earlier in this job" in err and "every stage of this job is done" in err


def test_a_failed_stage_ends_the_job_4_and_a_stop_request_ends_it_130(tmp_path):
    script, env = setup(tmp_path, FAIL_STAGE="base")
    job = start(script, env)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 4 and "stage base did not finish (exit 3" in err
    assert not any("requeue" in n for n in notes(tmp_path))

    # `longspec stop` recorded a stop request for this job: the saved stage is not requeued.
    script, env = setup(tmp_path / "b", STAGE_S="60")
    out_dir = tmp_path / "b" / "runs" / "base"
    job = start(script, env)
    wait_note(tmp_path / "b", "stage base begins")
    runrecord.update(out_dir, stop_requested_at=runrecord.utc_now())
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 130, err
    assert "asked this job to stop: not requeued" in err and not any("requeue" in n for n in notes(tmp_path / "b"))
