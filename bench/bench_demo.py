"""Wall time of `longspec demo` (tiny preset, three chained stages) by phase, first and second run.

    .venv/bin/python bench/bench_demo.py [--runs 2] [--dir DIR] [--gpus N] [--code CHECKOUT] [--json]
                                         [--quality] [--no-fresh]

Each run goes into a fresh folder (`longspec demo DIR --quiet`, as a new user runs it); the first
run of a machine or environment may also build DeepSpeed's ops and the tiny assets, the second
finds them cached. The phases come from the demo's own output (each line stamped as it arrives)
and the files it writes:

    init + tiny build        scaffold, then the tiny target, tokenizer and data (cached after once)
    preflight                plan, validation, memory and disk estimates
    <stage> chain            the stage's draft_model_name_or_path set from the upstream's final draft
    <stage> prepare          `python -m longspec.prepare` (tokenized once per data and settings)
    <stage> launch           launch to the trainer's first line of code (run.json started_unix ->
                             metrics.jsonl's end event less elapsed_s): interpreters and imports
    <stage> setup            -> the `start` event: process group, DeepSpeed ops, models, engine
    <stage> continuations    the target's continuations for tau while training (first evaluation)
    <stage> tau while training  the trainer's chain walks (simtau records' eval_s)
    <stage> training         steps, checkpoints and the final save (the rest of the trainer's time)
    <stage> exit             the end event -> the launch's last process gone (run.json ended_unix)
    <stage> eval <part>      eval.json's timings: process start (first measurement of its process),
                             model load, prompts, plain (the target's own decoding), chain, tree,
                             input (the input draft's chain), other (warm-up, figures, setup)
    <stage> eval wait        the rest of the evaluating step as the demo saw it (process, transfer)
    other                    what no phase above names (the CLI between steps, the summary)

A phase that appears in both runs is shown with its ratio (second / first). The machine's load
(/proc/loadavg) and the CPU time of the demo's processes are printed with each run: on a busy
machine compare shares and ratios, not seconds. --json prints the same as one object.

--quality adds the tau table (each stage's tau next to its input draft's on the same prompts, from
eval.json); for stage 1, whose input is a fresh draft the demo does not keep, the same fresh
initialisation (the trainer's seed) is rebuilt and decoded on stage 1's prompts (an extra eval,
outside the timed runs; --no-fresh skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("base", "long", "longcot")
EVAL_PARTS = (("process start", ("process_start", "imports")), ("model load", ("model_load",)),
              ("prompts", ("prompts",)), ("plain", ("decode_plain",)), ("chain", ("decode_chain",)),
              ("tree", ("decode_tree",)), ("input", ("decode_baseline",)),
              ("other", ("setup", "decode_warmup", "decode_rows", "figures")))


def run_demo(d: Path, gpus: int | None, code: Path = ROOT) -> dict:
    """One `longspec demo DIR --quiet` of the checkout ``code`` (its folder first on the path): its
    stdout lines with the time each arrived, wall, CPU, load."""
    if d.exists():
        shutil.rmtree(d)
    cmd = [sys.executable, "-m", "longspec_cli", "demo", str(d), "--quiet"] + (["--gpus", str(gpus)] if gpus else [])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    t0 = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(code)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=code, env=env)
    lines = [(time.time(), line.rstrip("\n")) for line in proc.stdout]
    err = proc.stderr.read()
    code = proc.wait()
    t1 = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        print("\n".join(text for _, text in lines[-40:]) + "\n" + err[-3000:])
        sys.exit(f"demo failed with exit code {code}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"dir": str(d), "t0": t0, "t1": t1, "lines": lines, "cpu_s": cpu,
            "load": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def _at(lines, pattern: str, after: float = 0.0) -> float | None:
    rx = re.compile(pattern)
    return next((t for t, text in lines if t >= after and rx.search(text)), None)


def _metrics(run: Path) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def phases(r: dict) -> list[tuple[str, float]]:
    """[(phase, seconds)] of one run, in order; 'other' holds what no phase names."""
    d, lines, t0, t1 = Path(r["dir"]), r["lines"], r["t0"], r["t1"]
    out: list[tuple[str, float]] = []
    t_assets = _at(lines, r"^assets built in") or _at(lines, r"^initialised") or t0
    t_plan = _at(lines, r"^project \S+: \d+ stage") or t_assets
    out += [("init + tiny build", t_assets - t0), ("preflight", t_plan - t_assets)]
    for st in STAGES:
        run = d / "runs" / st
        info = json.loads((run / "run.json").read_text())
        recs = _metrics(run)
        end = next(e for e in recs if e.get("event") == "end")
        start = next(e for e in recs if e.get("event") == "start")
        sims = [x for x in recs if x.get("record") == "simtau"]
        t_chain = _at(lines, rf"^{st}: draft_model_name_or_path")
        if t_chain is not None:
            prev = max(t for t, text in lines if t <= t_chain and not text.startswith(f"{st}:"))
            out.append((f"{st} chain", t_chain - prev))
        t_prep0, t_prep1 = _at(lines, rf"^{st}: preparing data"), _at(lines, rf"^{st}: data prepared")
        if t_prep0 is not None and t_prep1 is not None:
            out.append((f"{st} prepare", t_prep1 - t_prep0))
        code_start = end["time"] - end["elapsed_s"]
        cont = sum(x.get("continuations_s", 0.0) for x in sims)
        walks = sum(x.get("eval_s", 0.0) for x in sims)
        out += [(f"{st} launch", code_start - info["started_unix"]), (f"{st} setup", start["time"] - code_start),
                (f"{st} continuations", cont), (f"{st} tau while training", walks),
                (f"{st} training", end["time"] - start["time"] - cont - walks),
                (f"{st} exit", info["ended_unix"] - end["time"])]
        t_ev0 = _at(lines, rf"^== {st}: evaluating")
        t_ev1 = _at(lines, rf"^== {st}: tau by length", after=t_ev0 or 0) or _at(lines, rf"^== {st}: tau ",
                                                                                  after=t_ev0 or 0)
        ev = json.loads((run / "eval.json").read_text()) if (run / "eval.json").is_file() else {}
        tm = ev.get("timings") or {}
        if t_ev0 is not None and t_ev1 is not None:
            parts = [(f"{st} eval {name}", sum(tm.get(k, 0.0) for k in keys)) for name, keys in EVAL_PARTS]
            out += [p for p in parts if p[1] > 0]
            out.append((f"{st} eval wait", (t_ev1 - t_ev0) - sum(s for _, s in parts)))
    out.append(("other", (t1 - t0) - sum(s for _, s in out)))
    return out


def group(ph: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """The phases summed over the three stages (stage name dropped): the compact table."""
    sums: dict[str, float] = {}
    for name, s in ph:
        key = name.split(" ", 1)[1] if name.split(" ", 1)[0] in STAGES else name
        sums[key] = sums.get(key, 0.0) + s
    return list(sums.items())


def print_table(runs: list[dict], grouped: bool) -> None:
    cols = [dict(group(r["phases"]) if grouped else r["phases"]) for r in runs]
    names = list(dict.fromkeys(n for c in cols for n in c))
    walls = [r["t1"] - r["t0"] for r in runs]
    head = f"{'phase':<28}" + "".join(f"{f'run {i + 1} s':>10}{'share':>7}" for i in range(len(runs)))
    head += f"{'2/1':>7}" if len(runs) > 1 else ""
    print(head)
    for n in names:
        row = f"{n:<28}"
        for c, w in zip(cols, walls):
            row += f"{c[n]:>10.1f}{c[n] / w:>7.1%}" if n in c else f"{'-':>10}{'':>7}"
        if len(runs) > 1 and n in cols[0] and n in cols[1] and cols[0][n] > 0.05:
            row += f"{cols[1][n] / cols[0][n]:>7.2f}"
        print(row)
    print(f"{'wall':<28}" + "".join(f"{w:>10.1f}{'':>7}" for w in walls))
    print(f"{'CPU time of its processes':<28}" + "".join(f"{r['cpu_s']:>10.1f}{'':>7}" for r in runs))
    print(f"{'load average (start, end)':<28}" + "".join(f"{'%.1f, %.1f' % tuple(r['load']):>17}" for r in runs))


def fresh_draft_tau(d: Path) -> float | None:
    """tau of the trainer's fresh initialisation on stage 1's held-out prompts."""
    import torch
    import yaml

    from longspec.model.weights import save_draft
    from longspec.model.glide import DraftConfig, GlideDraft
    from transformers import AutoConfig

    run = d / "runs" / "base"
    conf = yaml.safe_load((run / "training_config.yaml").read_text())
    torch.manual_seed(conf["seed"])                       # as longspec.train builds a fresh draft
    draft = GlideDraft(DraftConfig.from_target_config(AutoConfig.from_pretrained(conf["model_name_or_path"]),
                                                      conf["draft"]["sliding_window"]))
    out = Path(tempfile.mkdtemp(prefix="ls-fresh-"))
    weights = save_draft({k: v.detach().clone() for k, v in draft.state_dict().items()}, out)
    proc = subprocess.run([sys.executable, "-m", "longspec.evaluate", str(run), "--baseline-draft", str(weights),
                           "--no-write", "--json"], capture_output=True, text=True, cwd=ROOT)
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        print(f"(fresh-draft eval failed: {proc.stderr.strip().splitlines()[-1:]})")
        return None
    return json.loads(proc.stdout)["baseline"]["tau"]


def quality_table(d: Path, fresh: bool) -> None:
    rows = []
    for st, source in (("base", "fresh init"), ("long", "base"), ("longcot", "long")):
        path = d / "runs" / st / "eval.json"
        if not path.is_file():
            rows.append((st, None, source, None))
            continue
        ev = json.loads(path.read_text())
        base_tau = (ev.get("baseline") or {}).get("tau")
        if st == "base" and fresh:
            base_tau = fresh_draft_tau(d)
        rows.append((st, ev.get("tau"), source, base_tau))
    print(f"\n{'stage':<9}{'tau':>7}  {'input draft':<12}{'its tau':>8}{'gain':>9}   (same held-out prompts)")
    for st, tau, source, base_tau in rows:
        gain = f"{(tau / base_tau - 1) * 100:+.1f}%" if tau and base_tau else "-"
        print(f"{st:<9}{tau if tau is not None else float('nan'):>7.2f}  {source:<12}"
              f"{base_tau if base_tau is not None else float('nan'):>8.2f}{gain:>9}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="demo runs, each into a fresh folder (default 2)")
    ap.add_argument("--dir", type=Path, help="parent folder of the runs' folders (default: a temporary one)")
    ap.add_argument("--gpus", type=int)
    ap.add_argument("--code", type=Path, default=ROOT,
                    help="another checkout to time (e.g. a worktree of an older commit; same environment)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (phases per run)")
    ap.add_argument("--by-stage", action="store_true", help="one row per stage and phase (default: summed)")
    ap.add_argument("--quality", action="store_true", help="the tau table of the last run")
    ap.add_argument("--no-fresh", action="store_true", help="--quality without stage 1's fresh input draft")
    ap.add_argument("--keep", action="store_true", help="keep the runs' folders")
    a = ap.parse_args()
    parent = a.dir or Path(tempfile.mkdtemp(prefix="ls-demo-"))
    runs = []
    for i in range(a.runs):
        r = run_demo(parent / f"demo-{i + 1}", a.gpus, a.code.resolve())
        r["phases"] = phases(r)
        runs.append(r)
    if a.json:
        print(json.dumps({"runs": [{"wall_s": round(r["t1"] - r["t0"], 2), "cpu_s": round(r["cpu_s"], 2),
                                    "load": r["load"], "phases": {n: round(s, 2) for n, s in r["phases"]}}
                                   for r in runs]}))
    else:
        print_table(runs, grouped=not a.by_stage)
    if a.quality:
        quality_table(Path(runs[-1]["dir"]), fresh=not a.no_fresh)
    if not a.keep and a.dir is None:
        shutil.rmtree(parent, ignore_errors=True)


if __name__ == "__main__":
    main()
