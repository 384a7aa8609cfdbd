"""`longspec run`, the measuring step: evaluate a finished stage, then the quality gate.

    evaluate  (--eval, --gate P, `demo`) per stage, before chaining into the next: `python -m
              longspec.evaluate` on its final draft (the upstream's final draft as the baseline on
              the same prompts), unless its eval.json is current; --gate P then stops the pipeline
              when quality.gate_stage fails (tau at the longest length bucket more than P% below the
              input draft's on the same prompts)
"""

from __future__ import annotations

import time
from pathlib import Path

from longspec.runs import runfolder
from longspec.project.manifest import Manifest, StageSpec, same_file
from longspec.errors import INTERRUPTED, LongspecError, RefusedError, UsageError
from longspec_cli.launch.plan import Console, RunRequest, StageOutcome, composed


GATE_FAILED = "gate failed"


def check_gate(pct: float | None) -> None:
    """--gate P: a percentage in 0..100 (UsageError, exit 2, otherwise)."""
    import math

    if pct is None:
        return
    if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not math.isfinite(pct) or pct < 0 or pct > 100:
        raise UsageError(f"--gate {pct!r}: must be a number >= 0 (a percentage, at most 100)",
                         hint="--gate 10 stops the pipeline when a stage's tau is more than 10% below "
                              "its upstream stage's; --gate 0 demands no drop at all")


def final_sha(spec: StageSpec) -> tuple[Path | None, str | None]:
    """(final weights, their sha256 per stage_complete.json) of a finished stage, else (None, None)."""
    rd = runfolder.RunDir(spec.output_dir)
    complete = rd.stage_complete()
    if complete is None:
        return None, None
    return rd.weights_for(complete), complete.get("sha256")


def current_eval(spec: StageSpec, upstream: StageSpec | None) -> dict | None:
    """The stage's eval.json when it was measured on its final draft (and, for a stage with an
    upstream, with that upstream's final draft as the baseline); None when it must be measured."""
    ev = eval_of(spec, final_sha(spec)[1])
    if ev is None:
        return None
    if upstream is not None:
        base = ev.get("baseline")
        if not isinstance(base, dict) or base.get("draft_sha256") != final_sha(upstream)[1]:
            return None
    return ev


def eval_argv(manifest: Manifest, spec: StageSpec) -> list[str]:
    """`python -m longspec.evaluate` for a stage, as `longspec eval` runs it (default settings)."""
    from longspec.runs import quality
    from longspec_cli.launch.trainer import evaluate_argv

    weights, up_name = quality.baseline_draft(manifest.previous(spec.name), planned=True)
    return evaluate_argv(spec.output_dir, spec.name, baseline_draft=weights, baseline_stage=up_name,
                         methods=("chain", "tree"))


def measure_stage(manifest: Manifest, spec: StageSpec, out: StageOutcome, req: RunRequest, console: Console) -> None:
    """Evaluate a finished stage unless its eval.json is current; then, with --gate, the gate.
    Fills out.tau / out.speedup; raises to stop the pipeline (gate failed, or eval failed under --gate)."""
    from longspec.runs import quality

    up = manifest.stage(spec.draft_from) if spec.draft_from else None
    ev = current_eval(spec, up)
    if ev is not None:
        console.say(f"== {spec.name}: eval.json is current (tau {ev['tau']:.2f}); not measured again")
    else:
        ev = _run_eval(manifest, spec, out, req, console)
        if ev is None:  # --eval only: a warning was printed, the pipeline goes on
            return
    out.take_eval(ev)
    if req.gate is None:
        if ev.get("lossless") is not True:
            console.warn(f"{spec.name}: speculative output differs from greedy output (not lossless); "
                         f"see {spec.output_dir / quality.EVAL_NAME}")
        return
    ok, msg = quality.gate_stage(spec.output_dir, up.output_dir if up else None, req.gate,
                                 cur_sha256=final_sha(spec)[1], prev_sha256=final_sha(up)[1] if up else None)
    console.say(f"== {spec.name}: gate (--gate {req.gate:g}) {'passed' if ok else 'FAILED'}: {msg}")
    if not ok:
        out.result, out.note = GATE_FAILED, f"failed the quality gate (--gate {req.gate:g}): {msg}"
        last = manifest.stages[-1].name == spec.name
        raise RefusedError(f"stage {spec.name} failed the quality gate (--gate {req.gate:g}): {msg}"
                           + ("" if last else "; the next stage was not started"),
                           hint=f"`longspec eval {manifest.root} {spec.name}` shows the figures per prompt")


def _run_eval(manifest: Manifest, spec: StageSpec, out: StageOutcome, req: RunRequest,
              console: Console) -> dict | None:
    """Run the evaluator (as `longspec eval`); the result, or None after a warning (--eval only)."""
    from longspec.runs import quality
    from longspec_cli.launch.trainer import run_trainer_json

    argv = eval_argv(manifest, spec)
    console.say(f"\n== {spec.name}: evaluating\n$ {' '.join(argv)}")
    t0 = time.monotonic()
    try:
        ev = run_trainer_json(argv, show_progress=not req.quiet, allow_codes=(1,))  # 1: not lossless
    except KeyboardInterrupt:
        raise LongspecError(f"stage {spec.name}: evaluation interrupted", exit_code=INTERRUPTED) from None
    except LongspecError as e:
        if e.exit_code == INTERRUPTED:
            raise
        cause = [line.strip() for line in e.message.splitlines()[1:] if line.strip()][-1:]   # a crash's last line
        out.note = f"evaluation failed: {e.message.splitlines()[0]}" + (f" {cause[0]}" if cause else "")
        if req.gate is not None:  # no figures, no gate: refused (exit 1), whatever the evaluator's own code
            raise RefusedError(f"stage {spec.name}: evaluation failed, so the gate cannot pass: {e.message}",
                               hint=f"run it alone: `longspec eval {manifest.root} {spec.name}`"
                                    + (f" (the evaluator's hint: {e.hint})" if e.hint else "")) from None
        console.warn(f"{spec.name}: {out.note}")
        return None
    base = ev.get("baseline") if isinstance(ev.get("baseline"), dict) else None
    tree = quality.method_figures(ev, "tree")
    console.say(f"== {spec.name}: tau {ev['tau']:.2f}" + (f" (input draft {base['tau']:.2f})" if base else "")
                + (f", tree tau {tree['tau']:.2f}" if tree else "")
                + f", speed-up x{ev.get('speedup', 0):.2f}, lossless {'yes' if ev.get('lossless') else 'NO'}"
                + f" ({time.monotonic() - t0:.1f} s)")
    by_len = quality.length_rows(ev)
    if by_len:
        console.say(f"== {spec.name}: tau by length " + ", ".join(
            f"{r['label']}: {r['tau']:.2f}" + (f" (input draft {r['baseline_tau']:.2f})" if r["baseline_tau"] is not None
                                                else "") for r in by_len))
    return ev


def draft_measured(manifest: Manifest, spec: StageSpec) -> bool:
    """True when the upstream's final draft was just loaded against this stage's target by the
    evaluator (a current eval.json): the chain's separate load check (a torch subprocess) would
    repeat it."""
    up = manifest.stage(spec.draft_from)
    ev = eval_of(up, final_sha(up)[1])
    if ev is None or not isinstance(ev.get("target"), str):
        return False
    c = composed(spec.config)
    target = c.data.get("model_name_or_path") if c.ok and isinstance(c.data, dict) else None
    return isinstance(target, str) and "${" not in target and same_file(target, ev["target"], manifest.root)


def eval_of(spec: StageSpec, sha256: str | None) -> dict | None:
    """The stage's eval.json when it was measured on the draft with this sha256, else None."""
    from longspec.runs import quality

    try:
        ev = quality.read_eval(spec.output_dir)
    except quality.EvalFileError:
        return None
    return ev if ev is not None and quality.eval_is_current(ev, sha256) else None
