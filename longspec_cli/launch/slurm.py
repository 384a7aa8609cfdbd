"""`longspec run --slurm`: an sbatch script that starts one DeepSpeed per-node launcher per node.

Inside the allocation there is no ssh/pdsh fan-out: `srun` starts one task per node, and each
task runs `python -m longspec.nodelaunch` (DeepSpeed's per-node launcher, made patient with stop
signals: longspec/nodelaunch.py) with
  --world_info   urlsafe-base64 JSON {host: [slot, ...]} over the job's hosts, in node order
  --node_rank    $SLURM_NODEID of that task
  --master_addr  the first host of `scontrol show hostnames $SLURM_JOB_NODELIST`
  --master_port  one port for the job
which is exactly what DeepSpeed's runner passes each node itself (deepspeed/launcher/runner.py).
Between stages the script runs `longspec next-stage` (verify the draft, chain the next config).

Preemption and time limits: `#SBATCH --signal=USR1@S` has SLURM send SIGUSR1 to every process
of the running step S seconds before the time limit; the ranks save a checkpoint and exit 5
(longspec/preempt.py). A preempting scheduler sends SIGTERM, which does the same. On exit code 5
(or a `preempted` event as the stage's last lifecycle record) the script requeues its own job
(`#SBATCH --requeue`, `scontrol requeue`): the new run skips finished stages and resumes the
preempted one from its checkpoint by itself.
"""

from __future__ import annotations

import base64
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

NODE_LAUNCHER = "longspec.nodelaunch"
EXIT_PREEMPTED = 5  # longspec/preempt.py (the CLI never imports the trainer)
SIGNAL_AHEAD_S = 300  # SIGUSR1 this long before the time limit: time for one step and one save
# The per-node part: the only text here that is not an argv element. "$@" carries every argument.
_NODE_EXEC = 'exec "$LONGSPEC_PYTHON" -u -m ' + NODE_LAUNCHER + ' --node_rank="$SLURM_NODEID" "$@"'
_WORLD_INFO_PY = ("import base64,json,sys; n=int(sys.argv[1]); "
                  "print(base64.urlsafe_b64encode(json.dumps({h: list(range(n)) for h in "
                  "sys.stdin.read().split()}).encode()).decode())")


def encode_world_info(world: dict[str, list[int]]) -> str:
    """DeepSpeed's --world_info value: urlsafe base64 of the JSON {host: [slots]} mapping."""
    return base64.urlsafe_b64encode(json.dumps(world).encode("utf-8")).decode("utf-8")


def node_launch_argv(world: dict[str, list[int]], node_rank: int, master_addr: str, master_port: int,
                     trainer: list[str], python: str | None = None) -> list[str]:
    """The per-node launcher command of node `node_rank` (what each SLURM task runs)."""
    return [python or sys.executable, "-u", "-m", NODE_LAUNCHER, f"--world_info={encode_world_info(world)}",
            f"--node_rank={node_rank}", f"--master_addr={master_addr}", f"--master_port={master_port}",
            "--no_local_rank", *trainer]


@dataclass(frozen=True)
class SlurmStage:
    name: str
    output_dir: Path
    trainer: list[str]  # from argv.trainer_args: --module longspec.train --config-dir ... overrides
    chain_to: str | None  # the stage to chain after this one finishes (next-stage --to), if any


def sbatch_script(*, project: Path, job_name: str, nodes: int, gpus_per_node: int, stages: list[SlurmStage],
                  master_port: int = 29500, cpu: bool = False, python: str | None = None,
                  extra_sbatch: list[str] | None = None, command_line: str | None = None,
                  signal_ahead_s: int = SIGNAL_AHEAD_S) -> str:
    """The batch script text. Every value that comes from the user is shell-quoted."""
    q = shlex.quote
    py = python or sys.executable
    out = ["#!/bin/bash",
           f"# written by longspec{': ' + command_line if command_line else ''}",
           f"# submit: sbatch {q(str(project / 'longspec.sbatch'))}",
           f"#SBATCH --job-name={job_name}",
           f"#SBATCH --nodes={nodes}",
           "#SBATCH --ntasks-per-node=1"]
    if not cpu:
        out.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    out.append(f"#SBATCH --output={project}/slurm-%j.out")
    out.append(f"#SBATCH --signal=USR1@{int(signal_ahead_s)}")
    out.append("#SBATCH --requeue")
    out.append("#SBATCH --open-mode=append")
    out += [f"#SBATCH {line}" for line in (extra_sbatch or [])]
    out += ["set -euo pipefail",
            f"cd {q(str(project))}",
            f"export LONGSPEC_PYTHON={q(py)}"]
    if cpu:
        out.append("export DS_ACCELERATOR=cpu")
    out += ['MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
            f"MASTER_PORT={int(master_port)}",
            "# DeepSpeed's world info over the job's hosts: {host: [0..slots-1]} as urlsafe base64 JSON",
            f'WORLD_INFO="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | "$LONGSPEC_PYTHON" -c '
            f'{q(_WORLD_INFO_PY)} {gpus_per_node})"',
            "export MASTER_ADDR MASTER_PORT WORLD_INFO",
            "# A stage that saved a checkpoint on a stop signal: requeue this job; it resumes there.",
            "requeue_if_preempted() {",
            '  if [ "$1" -eq ' + str(EXIT_PREEMPTED) + ' ] || { [ "$1" -ne 0 ] && tail -n 50 "$2/metrics.jsonl" 2>/dev/null '
            "| grep '\"event\":' | tail -n 1 | grep -q '\"event\":\"preempted\"'; }; then",
            '    echo "stage in $2 was preempted after saving a checkpoint; requeueing job $SLURM_JOB_ID" >&2',
            '    scontrol requeue "$SLURM_JOB_ID"',
            "    exit 0",
            "  fi",
            "}", ""]
    for st in stages:
        log = st.output_dir / "train.log"
        done = st.output_dir / "stage_complete.json"
        out += [f"# ---- stage {st.name}",
                f"mkdir -p {q(str(st.output_dir))}",
                "rc=0",
                f"srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 "
                f"--output={q(str(log))} --open-mode=append \\",
                f"  bash -c {q(_NODE_EXEC)} node-launch \\",
                '  "--world_info=$WORLD_INFO" "--master_addr=$MASTER_ADDR" "--master_port=$MASTER_PORT" '
                "--no_local_rank \\",
                "  " + " ".join(q(a) for a in st.trainer) + " || rc=$?",
                f"requeue_if_preempted \"$rc\" {q(str(st.output_dir))}",
                f"test -f {q(str(done))} || {{ echo {q(f'stage {st.name} did not finish (no stage_complete.json); see ' + str(log))} >&2; exit 4; }}"]
        if st.chain_to:
            out.append(f'"$LONGSPEC_PYTHON" -m longspec_cli next-stage {q(str(project))} --to {q(st.chain_to)}')
        out.append("")
    return "\n".join(out)


def write_slurm(req, *, submit: bool, out=None) -> Path:
    """Plan the stages as `run` would, write DIR/longspec.sbatch, optionally submit it."""
    import shutil
    import subprocess

    from longspec_cli.errors import RefusedError, UsageError
    from longspec_cli.launch import argv as A
    from longspec_cli.launch import plan, preflight

    out = out or sys.stdout
    console = plan.Console(out)
    from longspec_cli.core.manifest import load_manifest

    manifest = load_manifest(req.project)
    first = manifest.stage(req.stage) if req.stage else manifest.stages[0]
    preflight.check_overrides(first, req.overrides)
    p = req.placement
    if p.hostfile is not None or p.include:
        raise UsageError("--slurm takes its hosts from the allocation; drop --hostfile/--include",
                         hint="use --num-nodes N and --gpus G (per node)")
    nodes = p.num_nodes or manifest.launch.nodes
    gpus = p.gpus or manifest.launch.gpus
    if nodes < 1 or gpus < 1:
        raise UsageError("--num-nodes and --gpus must be at least 1")
    plans = [pl for pl in plan.plan_stages(manifest, req) if pl.action != "skip"]
    if not plans:
        console.say("nothing to do: every stage is done with an unchanged config")
        return manifest.root / "longspec.sbatch"
    stages = []
    for i, pl in enumerate(plans):
        conf, exp = plan.exp_location(pl.spec)
        nxt = next((q.spec.name for q in plans[i + 1:] if q.spec.draft_from == pl.spec.name), None)
        stages.append(SlurmStage(pl.spec.name, pl.spec.output_dir,
                                 A.trainer_args(conf, exp, pl.spec.output_dir, req.overrides), nxt))
    text = sbatch_script(project=manifest.root, job_name=f"longspec-{manifest.name}", nodes=nodes,
                         gpus_per_node=gpus, stages=stages, master_port=p.master_port or A.DEFAULT_MASTER_PORT,
                         command_line=f"longspec run {manifest.root} --slurm")
    path = manifest.root / "longspec.sbatch"
    from longspec_cli.core.atomic import atomic_write_text

    atomic_write_text(path, text + "\n")
    os_chmod_exec(path)
    console.say(f"wrote {path}: {nodes} node(s) x {gpus} GPU(s), stages {', '.join(s.name for s in stages)}")
    for pl in plans:
        if pl.action == "rerun":
            console.say(f"note: {pl.spec.name} is set to re-run ({pl.reason}); move {pl.spec.output_dir} aside "
                        "before the job starts, or it resumes/skips there")
    if submit:
        sbatch = shutil.which("sbatch")
        if sbatch is None:
            raise RefusedError("sbatch not found on this machine", hint=f"submit {path} from a SLURM login node")
        proc = subprocess.run([sbatch, str(path)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RefusedError(f"sbatch failed (exit {proc.returncode}): {proc.stderr.strip()}")
        console.say(proc.stdout.strip())
    else:
        console.say(f"submit it with: sbatch {shlex.quote(str(path))}")
    return path


def os_chmod_exec(path: Path) -> None:
    import os

    os.chmod(path, 0o755)
