"""`longspec run --slurm`: an sbatch script that starts one DeepSpeed per-node launcher per node.

Inside the allocation there is no ssh/pdsh fan-out. On several nodes `srun` starts one task per
node, and each task runs `python -m longspec.nodelaunch` (DeepSpeed's per-node launcher, patient
with stop signals: longspec/nodelaunch.py); on one node the batch script runs that launcher itself
(no srun: srun answers a SIGTERM by killing its tasks at once, which would leave no time to save).
The launcher gets
  --world_info   urlsafe-base64 JSON {host: [slot, ...]} over the job's hosts, in node order
  --node_rank    $SLURM_NODEID of that task
  --master_addr  the address SLURM has for the first host (its NodeAddr)
  --master_port  one free port of the first node, chosen per stage (or --master-port)
which is exactly what DeepSpeed's runner passes each node itself (deepspeed/launcher/runner.py).
Between stages the script runs `longspec next-stage` (verify the draft, chain the next config).

Stop signals, none lost (the script's own comments say the same, where it does it):
- `#SBATCH --signal=B:USR1@S`: SLURM sends SIGUSR1 to the batch shell S seconds before the time
  limit. The shell traps USR1 and TERM before anything else runs; a stage that runs gets the
  signal passed on once (`scancel --signal` to the job's steps, or `kill` to the one-node
  launcher); the ranks save at their step and exit 5 (longspec/training/preempt.py).
- A signal between stages (during `next-stage`) is remembered; the job requeues itself before the
  next stage starts. A request in a stage's last step lets the stage finish (it is done); the job
  then requeues itself before the next one.
- On exit code 5 (or a `preempted` event as the stage's last lifecycle record, when srun reports a
  task it ended) the job requeues itself (`#SBATCH --requeue`, `scontrol requeue`): the new run
  skips the stages this job finished and resumes the preempted one from its checkpoint. Unless
  `longspec stop` asked the job to stop (the run record says so): then it ends, exit 130.
- The run record (longspec/runs/runrecord.py through launch/jobrecord.py) is written before and after
  each stage's step.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from longspec_cli.launch.argv import encode_world_info

NODE_LAUNCHER = "longspec.nodelaunch"
EXIT_PREEMPTED = 5  # longspec/training/preempt.py (the CLI never imports the trainer)
SIGNAL_AHEAD_S = 300  # SIGUSR1 this long before the time limit: time for one step and one save
MAX_SIGNAL_S = 65535  # sbatch's limit for --signal's time
# The per-node part under srun: the only text here that is not an argv element. "$@" carries every argument.
_NODE_EXEC = 'exec "$LONGSPEC_PYTHON" -u -m ' + NODE_LAUNCHER + ' --node_rank="$SLURM_NODEID" "$@"'
_WORLD_INFO_PY = ("import base64,json,sys; n=int(sys.argv[1]); "
                  "print(base64.urlsafe_b64encode(json.dumps({h: list(range(n)) for h in "
                  "sys.stdin.read().split()}).encode()).decode())")
_FREE_PORT_PY = "import socket; s=socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"


def node_launch_argv(world: dict[str, list[int]], node_rank: int, master_addr: str, master_port: int,
                     trainer: list[str], python: str | None = None) -> list[str]:
    """The per-node launcher command of node `node_rank` (what each SLURM task runs)."""
    return [python or sys.executable, "-u", "-m", NODE_LAUNCHER, f"--world_info={encode_world_info(world)}",
            f"--node_rank={node_rank}", f"--master_addr={master_addr}", f"--master_port={master_port}",
            "--no_local_rank", *trainer]


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_limit_s(text: str) -> int:
    """SLURM's time formats (sbatch --time) in seconds: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    from longspec.errors import UsageError

    m = _TIME.match(text.strip())
    if not m or text.strip() in ("0",):
        raise UsageError(f"--time {text!r} is not a SLURM time limit",
                         hint="minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, e.g. --time 2:00:00")
    days, a, b, c = m.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, s = (nums + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + mi * 60 + s
    if len(nums) == 1:
        return nums[0] * 60
    if len(nums) == 2:
        return nums[0] * 60 + nums[1]
    return nums[0] * 3600 + nums[1] * 60 + nums[2]


@dataclass(frozen=True)
class SlurmOptions:
    """What `run --slurm` passes to sbatch besides the stages (None = sbatch's/the site's default)."""

    time: str | None = None  # sbatch --time
    signal_lead_s: int | None = None  # SIGUSR1 this many seconds before the limit (default SIGNAL_AHEAD_S)
    partition: str | None = None
    account: str | None = None
    extra: list[str] = field(default_factory=list)  # more sbatch options, each one `--flag=value`
    cpu: bool = False  # the nodes have no GPU: no gres, the CPU accelerator

    def lead(self) -> int:
        """The signal lead, checked against the time limit (exit 2 when it cannot work)."""
        from longspec.errors import UsageError

        lead = SIGNAL_AHEAD_S if self.signal_lead_s is None else self.signal_lead_s
        if not 0 < lead <= MAX_SIGNAL_S:
            raise UsageError(f"--signal-lead {lead}: between 1 and {MAX_SIGNAL_S} seconds")
        if self.time is not None:
            limit = time_limit_s(self.time)
            if lead >= limit:
                raise UsageError(f"--signal-lead {lead} s is not shorter than --time {self.time} ({limit} s): "
                                 "the warning would come before the job starts",
                                 hint=f"pass --signal-lead under {limit} s (time for one step and one save)")
        return lead

    def sbatch_lines(self) -> list[str]:
        out = [f"--time={self.time}"] if self.time else []
        out += [f"--partition={self.partition}"] if self.partition else []
        out += [f"--account={self.account}"] if self.account else []
        for arg in self.extra:
            if not arg.startswith("-") or "\n" in arg:
                from longspec.errors import UsageError

                raise UsageError(f"--sbatch-arg {arg!r}: one sbatch option, e.g. --sbatch-arg=--qos=high")
            out.append(arg)
        return out


@dataclass(frozen=True)
class SlurmStage:
    name: str
    output_dir: Path
    trainer: list[str]  # from argv.trainer_args: --module longspec.train --config-dir ... overrides
    chain_to: str | None  # the stage to chain after this one finishes (next-stage --to), if any


# The batch script's fixed part, after the #SBATCH lines: the stop-signal traps come first.
_PRELUDE = r"""
# ---- stop signals: trapped before anything else runs, never lost
# SIGUSR1 comes from SLURM --signal=B:... before the time limit (to this shell only); SIGTERM from
# scancel, a preempting scheduler or the time limit. A running stage gets it passed on once; one
# that comes between stages (during next-stage) requeues the job before the next stage starts.
STOP=""; STEP=""; FORWARDED=""; TRAPPED=""; LAST_OUT=""
on_stop() {
  TRAPPED=1
  if [ -z "$STOP" ]; then
    STOP=$1
    echo "longspec: SIG$1 reached the batch script at $(date '+%F %T') (job $SLURM_JOB_ID, restart ${SLURM_RESTART_COUNT:-0})" >&2
  fi
  if [ -n "$STEP" ] && [ -z "$FORWARDED" ] && kill -0 "$STEP" 2>/dev/null; then
    FORWARDED=1
    forward_signal "$1"
  fi
}
trap 'on_stop USR1' USR1
trap 'on_stop TERM' TERM
set -uo pipefail
"""

_FUNCTIONS = r"""
# The job's exit: 0 done, 4 a stage failed, 130 stopped by `longspec stop`; requeued otherwise.
requeue() {  # WHY OUTPUT_DIR
  if "$LONGSPEC_PYTHON" -m longspec_cli.launch.jobrecord stop-requested "$2"; then
    echo "longspec: $1; \`longspec stop\` asked this job to stop: not requeued" >&2
    exit 130
  fi
  echo "longspec: $1; requeueing job $SLURM_JOB_ID at $(date '+%F %T')" >&2
  if ! scontrol requeue "$SLURM_JOB_ID"; then
    echo "longspec: scontrol requeue failed; submit the script again to resume" >&2
    exit 5
  fi
  exit 0
}
last_event_preempted() {  # OUTPUT_DIR: the stage's last lifecycle record is `preempted`
  tail -n 50 "$1/metrics.jsonl" 2>/dev/null | grep '"event":' | tail -n 1 | grep -q '"event":"preempted"'
}
stage_begin() {  # NAME OUTPUT_DIR; fails (returns 1) for a stage this job already finished
  if [ -n "$STOP" ]; then requeue "SIG$STOP came between stages, before stage $1" "${LAST_OUT:-$2}"; fi
  LAST_OUT=$2
  if [ "$2/stage_complete.json" -nt "$SCRIPT" ]; then
    echo "longspec: stage $1 finished earlier in this job" >&2
    return 1
  fi
  mkdir -p "$2"
  "$LONGSPEC_PYTHON" -m longspec_cli.launch.jobrecord begin "$2" --stage "$1"
  if [ -z "$FIXED_PORT" ]; then MASTER_PORT="$("$LONGSPEC_PYTHON" -c "$FREE_PORT_PY")"; fi
  FORWARDED=""
  return 0
}
wait_step() {  # the stage's exit code, through any number of trapped signals
  local r r2
  while :; do
    TRAPPED=""
    wait "$STEP"; r=$?
    if [ -n "$TRAPPED" ] && [ "$r" -gt 128 ]; then
      if kill -0 "$STEP" 2>/dev/null; then continue; fi
      wait "$STEP" 2>/dev/null; r2=$?
      if [ "$r2" -ne 127 ]; then r=$r2; fi
    fi
    STEP=""
    return "$r"
  done
}
stage_end() {  # NAME OUTPUT_DIR: after the stage's step was started in the background as $STEP
  local rc=0
  wait_step || rc=$?
  "$LONGSPEC_PYTHON" -m longspec_cli.launch.jobrecord end "$2" --rc "$rc"
  if [ "$rc" -eq 5 ] || { [ "$rc" -ne 0 ] && last_event_preempted "$2"; }; then
    requeue "stage $1 saved a checkpoint and stopped (exit $rc)" "$2"
  fi
  if [ ! -f "$2/stage_complete.json" ]; then
    if [ -n "$STOP" ]; then
      requeue "stage $1 ended on SIG$STOP before saving (exit $rc); it resumes from its newest checkpoint" "$2"
    fi
    echo "longspec: stage $1 did not finish (exit $rc, no stage_complete.json); see $2/train.log" >&2
    exit 4
  fi
}
chain() {  # PROJECT NEXT_STAGE: next-stage, as `longspec next-stage PROJECT --to NEXT_STAGE`
  local rc=0
  "$LONGSPEC_PYTHON" -m longspec_cli next-stage "$1" --to "$2" || rc=$?
  if [ "$rc" -ne 0 ]; then
    if [ -n "$STOP" ]; then requeue "next-stage --to $2 ended on SIG$STOP (exit $rc)" "$LAST_OUT"; fi
    echo "longspec: next-stage --to $2 failed (exit $rc)" >&2
    exit "$rc"
  fi
}
"""


def sbatch_script(*, project: Path, job_name: str, nodes: int, gpus_per_node: int, stages: list[SlurmStage],
                  master_port: int | None = None, cpu: bool = False, python: str | None = None,
                  extra_sbatch: list[str] | None = None, command_line: str | None = None,
                  signal_ahead_s: int = SIGNAL_AHEAD_S, env: dict[str, str] | None = None) -> str:
    """The batch script text. Every value that comes from the user is shell-quoted.
    gpus_per_node: GPUs per node, or CPU ranks per node when `cpu` (then no gres line)."""
    q = shlex.quote
    py = python or sys.executable
    script = project / "longspec.sbatch"
    out = ["#!/bin/bash",
           f"# written by longspec{': ' + command_line if command_line else ''}",
           f"# submit: sbatch {q(str(script))}",
           f"#SBATCH --job-name={job_name}",
           f"#SBATCH --nodes={nodes}",
           "#SBATCH --ntasks-per-node=1"]
    if not cpu:
        out.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    out.append(f"#SBATCH --output={project}/slurm-%j.out")
    out.append(f"#SBATCH --signal=B:USR1@{int(signal_ahead_s)}")
    out.append("#SBATCH --requeue")
    out.append("#SBATCH --open-mode=append")
    out += [f"#SBATCH {line}" for line in (extra_sbatch or [])]
    out.append(_PRELUDE)
    out += [f"cd {q(str(project))}",
            f"SCRIPT={q(str(script))}",
            f"export LONGSPEC_PYTHON={q(py)}"]
    if cpu:
        out += ["export DS_ACCELERATOR=cpu",
                f"export OMP_NUM_THREADS=\"${{OMP_NUM_THREADS:-$(( ${{SLURM_CPUS_ON_NODE:-1}} / {gpus_per_node} > 0 "
                f"? ${{SLURM_CPUS_ON_NODE:-1}} / {gpus_per_node} : 1 ))}}\""]
    for k, v in (env or {}).items():
        out.append(f"export {k}=\"${{{k}:-{v}}}\"" if re.fullmatch(r"[\w/.:@+-]*", v) else f"export {k}={q(v)}")
    if nodes == 1:
        out.append("forward_signal() { kill -s \"$1\" \"$STEP\" 2>/dev/null; }  # the node launcher passes it on")
    else:
        out.append("forward_signal() { scancel --signal=\"$1\" \"$SLURM_JOB_ID\"; }  # every step, not this shell")
    out += ["# the first host as SLURM reaches it (NodeAddr), and DeepSpeed's world info over the job's hosts",
            'FIRST_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
            'MASTER_ADDR="$(scontrol show node "$FIRST_NODE" -o | tr " " "\\n" | sed -n "s/^NodeAddr=//p")"',
            'MASTER_ADDR="${MASTER_ADDR:-$FIRST_NODE}"',
            f"FIXED_PORT={int(master_port) if master_port else ''}",
            'MASTER_PORT="$FIXED_PORT"',
            f"FREE_PORT_PY={q(_FREE_PORT_PY)}",
            f'WORLD_INFO="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | "$LONGSPEC_PYTHON" -c '
            f'{q(_WORLD_INFO_PY)} {gpus_per_node})"',
            "export MASTER_ADDR WORLD_INFO"]
    out.append(_FUNCTIONS)
    for st in stages:
        log = st.output_dir / "train.log"
        name, od = q(st.name), q(str(st.output_dir))
        args = " ".join(q(a) for a in st.trainer)
        out.append(f"# ---- stage {st.name}")
        out.append(f"if stage_begin {name} {od}; then")
        if nodes == 1:
            out += [f'  "$LONGSPEC_PYTHON" -u -m {NODE_LAUNCHER} --node_rank=0 "--world_info=$WORLD_INFO" '
                    '"--master_addr=$MASTER_ADDR" "--master_port=$MASTER_PORT" --no_local_rank \\',
                    f"    {args} >>{q(str(log))} 2>&1 &"]
        else:
            out += [f"  srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 "
                    f"--output={q(str(log))} --open-mode=append \\",
                    f"    bash -c {q(_NODE_EXEC)} node-launch \\",
                    '    "--world_info=$WORLD_INFO" "--master_addr=$MASTER_ADDR" "--master_port=$MASTER_PORT" '
                    "--no_local_rank \\",
                    f"    {args} &"]
        out += ["  STEP=$!",
                f"  stage_end {name} {od}",
                "fi"]
        if st.chain_to:
            out.append(f"chain {q(str(project))} {q(st.chain_to)}")
        out.append("")
    out.append('echo "longspec: every stage of this job is done" >&2')
    return "\n".join(out)


def write_slurm(req, opts: SlurmOptions | None = None, *, submit: bool, out=None) -> Path:
    """Plan the stages as `run` would, make every check a local run makes (world size from nodes x
    ranks per node, validation with the batch arithmetic, memory, disk), write DIR/longspec.sbatch,
    and with `submit` hand it to sbatch and record the job in each stage's run record."""
    import shutil
    import subprocess

    from longspec.files.atomic import atomic_write_text
    from longspec.project.manifest import load_manifest
    from longspec.errors import RefusedError, UsageError
    from longspec_cli.launch import argv as A
    from longspec_cli.launch import plan, preflight
    from longspec.machine.opsdir import ops_build_dir

    opts = opts or SlurmOptions()
    console = plan.Console(out)
    manifest = load_manifest(req.project)
    first = manifest.stage(req.stage) if req.stage else manifest.stages[0]
    preflight.check_overrides(first, req.overrides)
    p = req.placement
    if p.hostfile is not None or p.include:
        raise UsageError("--slurm takes its hosts from the allocation; drop --hostfile/--include",
                         hint="use --num-nodes N and --gpus G (per node)")
    lead, sbatch_lines = opts.lead(), opts.sbatch_lines()
    nodes = p.num_nodes if p.num_nodes is not None else manifest.launch.nodes
    if p.gpus is not None and p.gpus < 0:
        raise UsageError("--gpus must be 0 (CPU nodes) or more")
    cpu = opts.cpu or p.gpus == 0
    ranks = (p.gpus or 1) if cpu else (p.gpus or manifest.launch.gpus)
    if nodes < 1 or ranks < 1:
        raise UsageError("--num-nodes and --gpus must be at least 1 (--gpus 0: CPU nodes, one rank each)")
    res = A.Resources(cpu=cpu, ranks_per_node=ranks, nodes=nodes)
    plans = plan.plan_stages(manifest, req, res.world_size)
    todo = [pl for pl in plans if pl.action != "skip"]
    if not todo:
        console.say("nothing to do: every stage is done with an unchanged config")
        return manifest.root / "longspec.sbatch"

    # The preflight of a local run (launch/execute.py run_request), for the job's world size.
    problems = preflight.validation_problems(manifest, plans, res.world_size, overrides=req.overrides,
                                             world_from=preflight.world_label(res))
    errors = preflight.report_problems(problems, console)
    A.deepspeed_command()  # DeepSpeed and torch importable by the Python the job runs, else one sentence
    disk = preflight.disk_reports(manifest, todo, req.overrides, res)
    for pl in todo:
        _, warning = preflight.memory_report(manifest, pl.spec, req.overrides, res, req.gpu_mem_gib)
        if warning:
            console.warn(f"{pl.spec.name}: {warning}")
    disk_warnings = [f"{pl.spec.name}: {w}" for pl, _, w in disk if w]
    for w in disk_warnings:
        console.warn(w)
    preflight.refuse_unless_forced(manifest, errors, disk_warnings, force=req.force, nothing="submitted",
                                   forced="writes the script anyway", flags="--slurm")

    stages = []
    for i, pl in enumerate(todo):
        conf, exp = plan.exp_location(pl.spec)
        nxt = next((q.spec.name for q in todo[i + 1:] if q.spec.draft_from == pl.spec.name), None)
        stages.append(SlurmStage(pl.spec.name, pl.spec.output_dir,
                                 A.trainer_args(conf, exp, pl.spec.output_dir, req.overrides), nxt))
    text = sbatch_script(project=manifest.root, job_name=f"longspec-{manifest.name}", nodes=nodes,
                         gpus_per_node=ranks, stages=stages, master_port=p.master_port, cpu=cpu,
                         extra_sbatch=sbatch_lines, signal_ahead_s=lead,
                         env={"TORCH_EXTENSIONS_DIR": ops_build_dir()},
                         command_line=f"longspec run {manifest.root} --slurm")
    path = manifest.root / "longspec.sbatch"
    atomic_write_text(path, text + "\n")
    path.chmod(0o755)
    where = f"CPU (DS_ACCELERATOR=cpu), {ranks} rank(s) per node" if cpu else f"{ranks} GPU(s) per node"
    console.say(f"wrote {path}: {nodes} node(s) x {where}, world size {res.world_size}, "
                f"stages {', '.join(s.name for s in stages)}; SIGUSR1 {lead} s before the time limit"
                + (f" ({opts.time})" if opts.time else ""))
    for pl in todo:
        if pl.action == "rerun":
            console.say(f"note: {pl.spec.name} is set to re-run ({pl.reason}); move {pl.spec.output_dir} aside "
                        "before the job starts, or it resumes/skips there")
    if not submit:
        console.say(f"submit it with: sbatch {shlex.quote(str(path))}")
        return path
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise RefusedError("sbatch not found on this machine", hint=f"submit {path} from a SLURM login node")
    proc = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True, cwd=manifest.root)
    if proc.returncode != 0:
        raise RefusedError(f"sbatch failed (exit {proc.returncode}): {proc.stderr.strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    from longspec_cli.launch import jobrecord

    jobrecord.record_submission([(s.name, s.output_dir) for s in stages], job_id, nodes=nodes,
                                ranks_per_node=ranks, overrides=req.overrides, script=path)
    console.say(f"submitted job {job_id}: `longspec status {manifest.root}` follows it, "
                f"`longspec stop {manifest.root}` saves and stops it")
    return path
