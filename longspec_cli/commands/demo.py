"""`longspec demo [DIR]`: the tiny preset end to end (init, then `run --all`) with a summary table."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from longspec_cli.boundary import run_cli

EPILOG = """Examples:

  longspec demo                 into ./longspec-demo

  longspec demo /tmp/d --gpus 2

Builds a tiny Qwen2-family target, tokenizer and data locally (cached), then trains the three
stages (base -> long -> longcot) on whatever the machine has (CPU without a GPU), evaluates each
stage's draft as it finishes (as `longspec run --eval`: greedy speculative decoding of held-out
prompts) and prints, per stage: steps, first and last loss, tokens/s, wall time, tau (tokens per
target forward), speed-up and the final weights' sha256. Running it again continues where it
stopped; finished stages (and their current measurements) are skipped. On the CPU each rank runs
one thread (OMP_NUM_THREADS=1 unless set): the tiny model's matrices are too small for more.

--regenerate: before training, each stage's data is written again by the tiny target
(`longspec regenerate DIR STAGE --use`: the records training draws plus the held-out ones, a
document's first 32 tokens kept as context), so the stages train on what the target writes."""


def demo(
    project_dir: Path = typer.Argument(Path("longspec-demo"), help="Folder for the demo project."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs (CPU: ranks) to use."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not echo the training logs."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Cap every stage at N steps "
                                            "(a quicker smoke run; passed as max_steps=N save_steps=N)."),
    evaluate: bool = typer.Option(True, "--eval/--no-eval", help="Measure tau and speed-up of each stage."),
    regenerate: bool = typer.Option(False, "--regenerate", help="Train each stage on its data as the target "
                                    "writes it (`longspec regenerate ... --use` before training)."),
) -> None:
    """Scaffold the tiny preset and train all three stages: a whole LongSpec pipeline in minutes."""

    def body() -> None:
        import os
        import time

        from longspec_cli.launch import argv as A
        from longspec_cli.launch import execute, plan

        t0 = time.monotonic()
        # The tiny model's matrices (hidden size 64) are too small for threads: one per CPU rank
        # trains its steps faster, and many times faster on a busy machine (bench/bench_demo.py).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        root = project_dir.resolve()
        console = plan.Console()
        if not (root / "longspec.yaml").is_file():
            from longspec_cli.launch.scaffold import InitAnswers, build_local_assets, plan_project, write_project

            A.deepspeed_command()  # refuse early, before building anything, when the train extra is missing
            write_project(plan_project(InitAnswers(project_dir=root, preset="tiny")))
            console.say(f"initialised {root} (tiny preset); building the tiny target, tokenizer and data ...")
            t1 = time.monotonic()
            build_local_assets(root)
            console.say(f"assets built in {time.monotonic() - t1:.1f} s")
        else:
            console.say(f"reusing the demo project in {root}")
        if max_steps is not None and max_steps < 1:
            from longspec.errors import UsageError

            raise UsageError("--max-steps must be at least 1")
        overrides = [f"max_steps={max_steps}", f"save_steps={max_steps}"] if max_steps else []
        if regenerate:
            from longspec.project.manifest import load_manifest
            from longspec_cli.launch.regen import regenerate_for_demo

            t1 = time.monotonic()
            regenerate_for_demo(load_manifest(root), overrides, console.say)
            console.say(f"data regenerated in {time.monotonic() - t1:.1f} s")
        req = plan.RunRequest(project=root, all=True, placement=A.Placement(gpus=gpus), quiet=quiet,
                                  overrides=overrides, evaluate=evaluate)
        execute.run_request(req, console)
        console.say(f"\ndemo finished in {time.monotonic() - t0:.1f} s; project: {root}")

    run_cli(body)


def register(app: typer.Typer) -> None:
    app.command("demo", epilog=EPILOG)(demo)
