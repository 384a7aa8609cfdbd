"""`longspec run DIR [STAGE] [key=value ...]`: launch stages with DeepSpeed, one process group each."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from longspec_cli.boundary import run_cli

EPILOG = """Examples:

  longspec run demo --all                      every remaining stage, chained

  longspec run demo base --dry-run             print the deepspeed command and the memory estimate

  longspec run demo long --gpus 4 max_steps=100 learning_rate=1e-5

  longspec run demo --all --hostfile hosts --num-nodes 2 --master-addr node0

  longspec run demo --all --slurm --gpus 8 --num-nodes 4 --time 24:00:00 --submit

  longspec run demo --all --slurm --gpus 0 --num-nodes 2 --partition cpu --submit   (CPU nodes)

  longspec run demo --all --gate 10            stop when a stage's tau drops more than 10%

Without STAGE and --all: the next stage that is not done. A finished stage whose config and
input draft are unchanged is skipped; an interrupted one resumes from its newest checkpoint.
Without a visible GPU the run uses DeepSpeed's CPU accelerator (--gpus ranks, default 1).
Before launching, the checkpoints (save_total_limit + 1 at the peak) and final weights of each
stage are estimated against the free space of its output_dir's disk: too little refuses the
run unless --force (--dry-run prints the figure).
Ctrl-C (or SIGTERM to `longspec run`): the ranks finish their optimizer step, save a checkpoint
and stop; a second Ctrl-C stops at once, without saving. With --hostfile the same holds on every
node (each node is started over ssh; a node that fails ends the run in seconds, naming it).
Exit codes: 0 done, 1 refused (validation errors, stage running, too little disk space), 2 usage
(bad flag or override), 4 a stage failed (a full disk included), 5 preempted (a stop signal from
outside saved a checkpoint; rerun to resume), 130 interrupted (no process is left behind).

--slurm writes DIR/longspec.sbatch after the checks a local run makes (validation at the job's
world size, memory, disk); --submit hands it to sbatch. SIGUSR1 reaches the batch script
--signal-lead seconds before --time; the running stage saves at its step and the job requeues
itself, as on `scancel --signal=USR1|TERM JOB` or a preempting scheduler's SIGTERM; the requeued
job resumes where it stopped.

--gate P evaluates each stage when it finishes (as `longspec eval`: its draft and its upstream
stage's draft on the same held-out prompts) and stops before the next stage, exit 1, when its
tau is more than P percent below the input draft's, or when its decoding is not lossless.
--eval measures the same way without stopping. A stage whose eval.json was measured on its
current draft is not measured again. Without either flag `run` evaluates nothing."""


def split_args(args: list[str]) -> tuple[Optional[str], list[str]]:
    """[STAGE] key=value ... -> (stage or None, overrides). Only the first word may be a stage."""
    if args and "=" not in args[0] and not args[0].startswith(("+", "~")):
        return args[0], list(args[1:])
    return None, list(args)


def run(
    project_dir: Path = typer.Argument(..., help="Project folder (or its longspec.yaml).", show_default=False),
    args: Optional[List[str]] = typer.Argument(None, help="[STAGE] then Hydra overrides key=value.",
                                               show_default=False, metavar="[STAGE] [KEY=VALUE]..."),
    all_: bool = typer.Option(False, "--all", help="Run the remaining stages in order, chaining each draft."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the commands and memory estimates; start nothing."),
    force: bool = typer.Option(False, "--force", help="Launch despite validation errors or too little disk "
                               "space; re-run a finished STAGE."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs (CPU: ranks) per node."),
    include: Optional[str] = typer.Option(None, "--include", help="DeepSpeed resource filter, e.g. localhost:0,2."),
    hostfile: Optional[Path] = typer.Option(None, "--hostfile", help="DeepSpeed hostfile (`HOST slots=N` lines)."),
    num_nodes: Optional[int] = typer.Option(None, "--num-nodes", help="Use the first N hosts of the hostfile."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Address of node 0."),
    master_port: Optional[int] = typer.Option(None, "--master-port", help="Rendezvous port (default: a free "
                                              "one, picked on node 0 and told to every node)."),
    launcher: Optional[str] = typer.Option(None, "--launcher", help="Multi-node backend: pdsh (default: longspec "
                                           "starts each node over ssh), openmpi, mvapich, slurm (DeepSpeed's runner)."),
    gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", help="GPU memory in GiB for the estimate "
                                            "(default: what nvidia-smi reports)."),
    slurm: bool = typer.Option(False, "--slurm", help="Write an sbatch script (DIR/longspec.sbatch) instead of launching."),
    submit: bool = typer.Option(False, "--submit", help="With --slurm: submit it with sbatch."),
    cpu: bool = typer.Option(False, "--cpu", help="With --slurm: CPU nodes (no GPU request, DeepSpeed's CPU "
                             "accelerator); --gpus counts ranks per node (default 1). Same as --gpus 0."),
    time_limit: Optional[str] = typer.Option(None, "--time", help="With --slurm: the job's time limit (sbatch "
                                             "--time, e.g. 24:00:00)."),
    signal_lead: Optional[int] = typer.Option(None, "--signal-lead", metavar="SECONDS",
                                              help="With --slurm: SIGUSR1 this long before the time limit "
                                                   "(time for one step and a save; default 300)."),
    partition: Optional[str] = typer.Option(None, "--partition", help="With --slurm: sbatch --partition."),
    account: Optional[str] = typer.Option(None, "--account", help="With --slurm: sbatch --account."),
    sbatch_args: Optional[List[str]] = typer.Option(None, "--sbatch-arg", metavar="OPTION",
                                                    help="With --slurm: one more sbatch option, e.g. "
                                                         "--sbatch-arg=--qos=high (repeatable)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not echo the training log (progress line only)."),
    gate: Optional[float] = typer.Option(None, "--gate", metavar="P",
                                         help="Evaluate each stage as it finishes; stop (exit 1) when its tau is "
                                              "more than P percent below its upstream stage's draft."),
    evaluate: bool = typer.Option(False, "--eval", help="Evaluate each stage as it finishes (tau, speed-up); "
                                                        "never stops the pipeline."),
) -> None:
    """Launch training stages with DeepSpeed (progress line, train.log, Ctrl-C saves a checkpoint, then stops every rank)."""

    def body() -> None:
        from longspec.errors import UsageError
        from longspec_cli.launch import argv as A
        from longspec_cli.launch import execute, plan
        from longspec_cli.launch.gate import check_gate

        stage, overrides = split_args(list(args or []))
        slurm_only = {"--submit": submit, "--cpu": cpu, "--time": time_limit, "--signal-lead": signal_lead,
                      "--partition": partition, "--account": account, "--sbatch-arg": sbatch_args}
        given = [flag for flag, v in slurm_only.items() if v]
        if given and not slurm:
            raise UsageError(f"{', '.join(given)} go(es) with --slurm")
        check_gate(gate)
        if slurm and (gate is not None or evaluate):
            raise UsageError("--gate and --eval do not go with --slurm (the batch script only trains)",
                             hint="after the job: `longspec eval DIR`, or `longspec run DIR --all --gate P` "
                                  "(finished stages are skipped and only measured)")
        placement = A.Placement(gpus=gpus, include=include, hostfile=hostfile, num_nodes=num_nodes,
                                master_addr=master_addr, master_port=master_port, launcher=launcher)
        req = plan.RunRequest(project=project_dir, stage=stage, all=all_, dry_run=dry_run, force=force,
                                  overrides=overrides, placement=placement, gpu_mem_gib=gpu_mem, quiet=quiet,
                                  gate=gate, evaluate=evaluate)
        if slurm:
            from longspec_cli.launch.slurm import SlurmOptions, write_slurm

            opts = SlurmOptions(time=time_limit, signal_lead_s=signal_lead, partition=partition, account=account,
                                extra=list(sbatch_args or []), cpu=cpu)
            write_slurm(req, opts, submit=submit)
            return
        execute.run_request(req)

    run_cli(body)


def register(app: typer.Typer) -> None:
    app.command("run", epilog=EPILOG, context_settings={"allow_interspersed_args": True})(run)
