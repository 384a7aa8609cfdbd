"""One measurement of a stage's draft (`python -m longspec.evaluate`'s body): the models, the
prompts, every method decoded on them (longspec.measure.perprompt), the figures
(longspec.measure.report) and the result file.

`evaluate(args, log, models)`: ``models`` (a Models) keeps the target and its tokenizer between
measurements of one process (`python -m longspec.evaluate --serve`: the stages of one `longspec
run`, which share their target); each measurement loads its own draft. The result's `timings` say
where its wall time went: the process's start and imports (the first measurement of a process
only), the models' load, the prompts, the warm-up, and the decoding of each method.
"""
from __future__ import annotations

import time
from pathlib import Path

from longspec.measure.evalargs import nondefault_settings
from longspec.measure.prompts import PromptError, conf_get as _get
from longspec.measure.runread import EvalError, as_path, read_run, stage_draft
from longspec.project.stageview import StageView


# ----------------------------------------------------------------------------- models

def pick_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise EvalError("--device cuda: no CUDA device here", 2)
    return torch.device(name)


def pick_dtype(name: str, device, precision: str | None):
    """auto: fp32 on CPU (exact comparison), the stage's precision on CUDA."""
    import torch

    table = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name == "auto":
        name = "fp32" if device.type == "cpu" else (precision if precision in table else "bf16")
    return table[name]


class Models:
    """The target (transformers model, tokenizer) this process loaded, by folder, dtype and device,
    kept for the next measurement when ``keep`` and it lives on the CPU (a GPU's memory is not held
    while the next stage trains); a target whose files changed loads again."""

    def __init__(self, keep: bool = False):
        self.keep = keep
        self._targets: dict[tuple, tuple] = {}

    @staticmethod
    def _key(target: Path, dtype, device) -> tuple:
        files = tuple(sorted((f.name, f.stat().st_mtime_ns, f.stat().st_size)
                             for f in Path(target).iterdir() if f.is_file()))
        return str(Path(target).resolve()), str(dtype), str(device), files

    def target(self, target: Path, dtype, device):
        """(hf_model, tokenizer) of ``target``: loaded now, or kept from an earlier measurement."""
        key = self._key(target, dtype, device)
        if key in self._targets:
            return self._targets[key]
        from transformers import AutoTokenizer

        from longspec.model.target import load_target

        try:
            hf = load_target(Path(target), dtype, None)
        except ValueError as e:            # unsupported family
            raise EvalError(str(e), 3) from None
        try:
            tok = AutoTokenizer.from_pretrained(str(target))
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a missing tokenizer
            raise EvalError(f"cannot load the target's tokenizer from {target} ({type(e).__name__}: {e})",
                            3) from None
        hf.to(device)
        hf.eval()
        self._targets = {key: (hf, tok)} if self.keep and getattr(device, "type", device) == "cpu" else {}
        return hf, tok


def load_models(target: Path, draft: Path, sliding_window: int, dtype, device, models: Models | None = None):
    """(hf_model, TargetWrapper, GlideDraft, tokenizer); EvalError 3 for an unusable draft/target."""
    from transformers.utils import logging as hf_logging

    from longspec.model.weights import DraftLoadError
    from longspec.model.glide import build_glide

    if not (target / "config.json").is_file():
        raise EvalError(f"target model folder {target} has no config.json", 3,
                        hint="pass --target PATH, or fix model_name_or_path in the stage config")
    hf_logging.disable_progress_bar()
    hf, tok = (models or Models()).target(target, dtype, device)
    try:
        glide = build_glide(hf, sliding_window=sliding_window, draft_path=draft, dtype=dtype)
    except DraftLoadError as e:
        raise EvalError(str(e), 3) from None
    except ValueError as e:            # a draft that does not match the target
        raise EvalError(str(e), 3) from None
    glide.to(device)
    glide.eval()
    return glide.target.model, glide.target, glide.draft, tok


# ----------------------------------------------------------------------------- main

def check_memory(args, target: Path, max_seq: int, dtype, device) -> None:
    """EvalError 3 before any weight loads when the longest length bucket known now (--lengths, or
    the default buckets of max_seq; --bench's come from its prompts) cannot fit on ``device``
    (longspec.machine.evalmemory: weights + KV cache + prefill; free GPU memory or MemAvailable)."""
    import torch

    from longspec.machine import evalmemory as EM
    from longspec.machine.memory import ModelSize

    lengths = args.lengths or (None if args.bench else EM.default_lengths(max_seq))
    try:
        size = ModelSize.from_config_json(target / "config.json")
    except (OSError, ValueError, TypeError):
        return                                   # load_models says what is wrong with the target
    if not lengths:
        return
    cuda = device.type == "cuda"
    available = torch.cuda.mem_get_info(device)[0] if cuda else EM.cpu_available()
    if available is None:
        return
    refused = EM.refusal(size, lengths, EM.default_max_new(max_seq, args.max_new_tokens), dtype.itemsize, available,
                         "this GPU (free memory)" if cuda else "this machine's CPU memory (MemAvailable)", cuda)
    if refused:
        raise EvalError(refused[0], 1, hint=refused[1])


def pick_prompts(args, conf: dict, complete: dict | None, tok, max_seq: int, limit: int):
    """(prompts, info, lengths) of this measurement (longspec.measure.prompts / longspec.measure.benchfiles), each
    prompt with its new-token limit and length bucket; info["prompts_over_longest"] counts those left out."""
    from longspec.measure import benchfiles, prompts as P
    from longspec.measure.report import default_lengths

    if args.bench is not None:
        kind, where = benchfiles.parse_bench(args.bench)
        if kind == "longbench":
            hi = args.max_prompt_tokens or max(1, limit - benchfiles.LIMIT_MARGIN)
            lo = benchfiles.MIN_PROMPT_TOKENS if args.min_prompt_tokens is None else args.min_prompt_tokens
            prompts, info = benchfiles.longbench_prompts(where, tok, min_tokens=lo, max_tokens=hi, n=args.num_prompts)
        else:
            prompts, info = benchfiles.aime_prompts(where, tok, n=args.num_prompts)
        lengths = args.lengths or default_lengths(max(max_seq, max(len(p.ids) for p in prompts)))
        prompts, info["prompts_over_longest"] = P.measured_prompts(prompts, lengths, args.max_new_tokens, max_seq)
        return prompts, info, lengths
    if args.prompts is not None:
        lengths = args.lengths or default_lengths(max_seq)
        prompts, info = P.file_prompts(args.prompts, tok, lengths=lengths, n=args.num_prompts)
        prompts, info["prompts_over_longest"] = P.measured_prompts(prompts, lengths, args.max_new_tokens, max_seq)
        return prompts, info, lengths
    data = args.data or as_path(_get(conf, "train_file"))
    if data is None:
        raise EvalError(f"{args.run_dir}: no train_file recorded", 2, hint="pass --prompts FILE or --data FILE")
    trained_on = as_path(_get(conf, "train_file"))
    same_data = trained_on is not None and Path(data).resolve() == trained_on.resolve()
    # a draft of this run (its final one, a checkpoint, best/) was trained on the records the run drew
    ours = args.draft is None or Path(args.run_dir).resolve() in Path(args.draft).resolve().parents
    steps = (complete or {}).get("steps") if ours and same_data else None
    prompts, info, lengths = P.default_prompts(Path(data), tok, conf, steps, lengths=args.lengths,
                                               num_prompts=args.num_prompts, max_new=args.max_new_tokens)
    if not same_data:
        info["heldout_check"] = "another file than the stage's train_file"
    return prompts, info, lengths


_FIRST = [True]            # the process's first measurement pays its start and imports


def process_age() -> float | None:
    """Seconds since this process started: since LONGSPEC_STARTED_AT (the time its starter set), else
    since the start the system records (to a second or so); None when neither says."""
    import os

    try:
        return max(0.0, time.time() - float(os.environ["LONGSPEC_STARTED_AT"]))
    except (KeyError, ValueError):
        pass
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - a figure for the timings only
        return None


def deterministic(torch) -> None:
    """torch's deterministic algorithms (warn only). torch.use_deterministic_algorithms also sets
    the flag of its compiler, importing it (seconds at every start); eval compiles nothing, so the
    operators' own flag is set alone where torch has it."""
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        setter(True, warn_only=True)


def evaluate(args, log=None, models: Models | None = None) -> dict:
    """One measurement of ``args`` (longspec.measure.evalargs.parse_args); the result object."""
    timings: dict[str, float] = {}
    if _FIRST[0]:
        _FIRST[0] = False
        age = process_age()
        if age is not None:
            timings["process_start"] = age
    clock = [time.perf_counter()]

    def lap(part: str) -> None:
        now = time.perf_counter()
        timings[part] = timings.get(part, 0.0) + now - clock[0]
        clock[0] = now

    import torch

    from longspec.measure import perprompt, report
    from longspec.model.weights import DraftLoadError
    from longspec.files.atomic import sha256_file

    lap("imports")

    run_dir = args.run_dir
    conf, complete = read_run(run_dir)
    stage, draft, target, window = stage_draft(run_dir, conf, complete, args)
    max_seq = StageView.of(conf).max_seq_length

    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = pick_dtype(args.dtype, device, _get(conf, "precision"))
    deterministic(torch)
    check_memory(args, target, max_seq, dtype, device)
    lap("setup")
    model, tw, gdraft, tok = load_models(target, draft, window, dtype, device, models)
    lap("model_load")
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
    try:
        prompts, pinfo, lengths = pick_prompts(args, conf, complete, tok, max_seq, limit)
    except PromptError as e:
        raise EvalError(e.message, e.code, e.hint) from None
    lap("prompts")
    over = pinfo.pop("prompts_over_longest")
    if log and pinfo.get("short_documents"):
        log(f"[{stage}] note: {pinfo['short_documents']} (--lengths sets the lengths)")
    if not prompts:
        raise EvalError(f"every prompt is longer than the longest length ({lengths[-1]} tokens)", 3,
                        hint="--lengths sets the buckets")
    if log:
        drawn = pinfo.get("prompts_drawn_in_training")
        counts = {n: sum(1 for p in prompts if p.bucket == n) for n in lengths}
        log(f"[{stage}] {len(prompts)} prompts from {pinfo['prompt_source']}"
            + (f" ({drawn} of them drawn in training)" if drawn else "")
            + (f", {over} longer than {lengths[-1]} tokens left out" if over else "")
            + ", by length " + ", ".join(f"{report.label(n)}: {c}" for n, c in counts.items())
            + f"; {' + '.join(args.method)} (gamma {args.gamma}, tree {list(args.tree_shape)}, "
            + f"temperature {args.temperature:g}), {device.type} {str(dtype).replace('torch.', '')}")
    baseline = None
    if args.baseline_draft is not None:
        if not args.baseline_draft.exists():
            raise EvalError(f"input draft not found: {args.baseline_draft}", 2)
        try:
            baseline = perprompt.load_baseline(args.baseline_draft, gdraft, dtype, device)
        except DraftLoadError as e:
            raise EvalError(f"input draft: {e}", 3) from None
    lap("model_load")
    from longspec.model import kernels   # what each attention runs on, for eval.json's `backend`
    from longspec.decode import tree_attn
    backend = {"draft_attention": kernels.backend(device, dtype)["attention"],
               "tree_verify": tree_attn.setup_verify(model, device, dtype) if "tree" in args.method else None}
    methods = tuple(args.method)
    lap("setup")
    decoding: dict[str, float] = {}
    rows = perprompt.measure(model, tw, gdraft, prompts, gamma=args.gamma, device=device, log=log,
                             baseline=baseline, methods=methods, tree_shape=args.tree_shape,
                             temperature=args.temperature, seed=args.seed, no_stop=args.no_eos, seconds=decoding)
    lap("decoding")
    figs = report.figures(rows, methods)
    per_method = {}
    for m in methods:
        same = [r["lossless" if m == methods[0] else f"{m}_lossless"] for r in rows]
        per_method[m] = {"method": m, **figs[m], "lossless": None if args.temperature > 0 else all(same),
                         "temperature": args.temperature, "gamma": args.gamma if m == "chain" else len(args.tree_shape),
                         "tree_shape": list(args.tree_shape) if m == "tree" else None,
                         "max_tau": (args.gamma if m == "chain" else len(args.tree_shape)) + 1}
    first = per_method[methods[0]]
    lens = [len(p.ids) for p in prompts]
    result = {
        "stage": str(stage),
        **{k: first[k] for k in ("tau", "spec_tokens_per_s", "target_tokens_per_s", "speedup")},
        "method": methods[0], "gamma": args.gamma,
        "tree_shape": list(args.tree_shape) if methods[0] == "tree" else None,
        "temperature": args.temperature,
        "methods": per_method,
        "prompts": len(prompts),
        "lengths": lengths,
        "prompts_over_longest": over,
        "max_new_tokens": max(p.max_new for p in prompts),
        "context_tokens": round(sum(lens) / len(lens)),
        "context_tokens_max": max(lens),
        "lossless": None if args.temperature > 0 else all(pm["lossless"] for pm in per_method.values()),
        "draft_sha256": sha256_file(draft) if draft.is_file() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "draft": str(draft), "target": str(target),
        **pinfo,
        "device": device.type, "dtype": str(dtype).replace("torch.", ""), "sliding_window": window,
        "backend": backend,
        "generated_tokens": int(sum(r["new_tokens"] for r in rows)),
        "target_forwards": first["target_forwards"],
        "by_length": report.by_length(rows, lengths, methods),
    }
    if args.bench is None and args.prompts is None and args.data is None:      # the stage's own prompts
        from longspec.measure.chainwalk import same_as_training

        result["continuations"] = same_as_training(run_dir, target, prompts, rows)
    if args.bench is not None:
        result["by_task"] = report.by_task(rows, lengths, methods)
    if baseline is not None:
        bpath = args.baseline_draft
        result["baseline"] = {**figs["baseline"], "method": methods[0],
                              "lossless": None if args.temperature > 0 else all(r["baseline_lossless"] for r in rows),
                              "stage": args.baseline_stage, "draft": str(bpath),
                              "draft_sha256": sha256_file(bpath) if bpath.is_file() else None}
    result["per_prompt"] = [{k: v for k, v in r.items() if k != "_raw"} for r in rows]
    lap("figures")
    parts = {**timings, "decoding": None, **{f"decode_{k}": v for k, v in decoding.items()}}
    result["timings"] = {k: round(v, 3) for k, v in parts.items() if v is not None}
    result["timings"]["measurement"] = round(sum(timings.values()) - timings.get("process_start", 0.0), 3)
    if not args.no_write:
        from longspec.files.atomic import atomic_write_json

        name = report.result_name(prompts=str(args.prompts) if args.prompts else None, bench=args.bench,
                                      nondefault=nondefault_settings(args))
        result["eval_json"] = str(run_dir / name)
        atomic_write_json(run_dir / name, result)
    return result
