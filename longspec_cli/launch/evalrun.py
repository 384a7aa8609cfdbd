"""`longspec eval`'s work: its options checked, the stages chosen (runs.stagedraft), each stage's
memory checked on the device it decodes on (launch.evalcheck) before anything starts, then
`python -m longspec.evaluate` per stage (launch.trainer). commands/eval.py parses and renders.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from longspec.errors import RefusedError, UsageError

METHODS = ("chain", "tree")
DEVICES = ("auto", "cpu", "cuda")
BENCHES = ("longbench", "aime")


@dataclass(frozen=True)
class EvalRequest:
    project_dir: Path
    stages: tuple[str, ...] = ()
    prompts: Path | None = None
    methods: tuple[str, ...] = METHODS
    gamma: int = 4
    tree_shape: str | None = None      # --tree-shape's first value (the others arrive as stages)
    temperature: float = 0.0
    max_new_tokens: int | None = None
    num_prompts: int | None = None
    lengths: str | None = None
    bench: str | None = None
    prompt_tokens: tuple[int | None, int | None] = (None, None)
    device: str = "auto"
    baseline: bool = True


@dataclass
class EvalOutcome:
    project: Path
    results: list[dict]
    skipped: list[dict]
    lossless: bool | None      # None: sampled (no token-for-token check)


def parse_shape(values: list[str]) -> tuple[int, ...]:
    """`--tree-shape` values ("4 16 16", "4,16,16" or separate arguments) -> (4, 16, 16)."""
    parts = [p for v in values for p in v.replace(",", " ").split()]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise UsageError(f"--tree-shape {' '.join(values)!r}: give the nodes per level as whole numbers >= 1",
                         hint="e.g. --tree-shape 4 16 16 16 16")
    if sum(int(p) for p in parts) > 1024:
        raise UsageError(f"--tree-shape {' '.join(parts)}: {sum(int(p) for p in parts)} nodes, at most 1024")
    return tuple(int(p) for p in parts)


def bench_arg(bench: str | None) -> str | None:
    """--bench KIND:WHERE with WHERE made absolute; UsageError for another kind or no WHERE."""
    if bench is None:
        return None
    kind, _, where = bench.partition(":")
    if kind not in BENCHES or not where:
        raise UsageError(f"--bench {bench!r}: give longbench:FOLDER or aime:FILE")
    return f"{kind}:{Path(where).expanduser().resolve()}"


def check_options(req: EvalRequest) -> None:
    """UsageError (exit 2) for options that cannot go together or name nothing."""
    if req.prompts is not None and not req.prompts.is_file():
        raise UsageError(f"--prompts {req.prompts}: no such file")
    if req.prompts is not None and req.bench is not None:
        raise UsageError("--prompts and --bench: give one of them")
    bench_arg(req.bench)
    if req.device not in DEVICES:
        raise UsageError(f"--device {req.device!r}: choose auto, cpu or cuda")
    bad = [m for m in req.methods if m not in METHODS]
    if bad:
        raise UsageError(f"--method {bad[0]!r}: choose chain or tree")


def memory_refusal(req: EvalRequest, todo) -> None:
    """The longest length bucket on the device eval decodes on, per stage: before anything starts."""
    from longspec_cli.launch.evalcheck import run_refusal

    for st in todo:
        refused = run_refusal(st.output_dir, req.lengths, req.max_new_tokens, req.device, req.bench is not None)
        if refused:
            raise RefusedError(f"stage {st.name}: {refused[0]}", hint=refused[1])


def evaluate(req: EvalRequest, say=None) -> EvalOutcome:
    """Measure each chosen stage's draft (`say(stage)` before each, when given); exit-1 refusals for a
    stage without a finished draft or a bucket that does not fit, before any measurement starts."""
    from longspec.project.manifest import load_manifest
    from longspec.runs.quality import baseline_draft
    from longspec.runs.stagedraft import stage_drafts
    from longspec_cli.launch.trainer import evaluate_argv, run_trainer_json

    check_options(req)
    manifest = load_manifest(req.project_dir)
    names, shape = list(req.stages), None
    if req.tree_shape is not None:   # `--tree-shape 4 16 16`: the values after the first arrive as stages
        extra = [a for a in names if a.isdigit() and a not in manifest.stage_names]
        names = [a for a in names if a not in extra]
        shape = parse_shape([req.tree_shape, *extra])
    todo, skipped = stage_drafts(manifest, names, shown=str(req.project_dir))
    memory_refusal(req, todo)
    results = []
    for st in todo:
        if say is not None:
            say(st.name)
        up_draft, up_name = baseline_draft(manifest.previous(st.name) if req.baseline else None)
        argv = evaluate_argv(st.output_dir, st.name, gamma=req.gamma, max_new_tokens=req.max_new_tokens,
                             num_prompts=req.num_prompts, prompts=req.prompts.resolve() if req.prompts else None,
                             device=req.device, baseline_draft=up_draft, baseline_stage=up_name, methods=req.methods,
                             tree_shape=shape, temperature=req.temperature, lengths=req.lengths,
                             bench=bench_arg(req.bench), prompt_tokens=req.prompt_tokens)
        res = run_trainer_json(argv, show_progress=say is not None, allow_codes=(1,))
        res["state"] = st.state
        results.append(res)
    # sampling has no token-for-token check: null, never a refusal
    lossless = None if req.temperature > 0 else all(r.get("lossless") is True for r in results)
    return EvalOutcome(manifest.root, results, skipped, lossless)


def not_lossless(outcome: EvalOutcome) -> None:
    """RefusedError (exit 1) naming the stages whose speculative output differed from greedy."""
    if outcome.lossless is False:
        bad = ", ".join(r["stage"] for r in outcome.results if r.get("lossless") is not True)
        raise RefusedError(f"speculative output differs from plain greedy output for: {bad}",
                           hint="see first_mismatch per prompt in the stage's eval.json")
