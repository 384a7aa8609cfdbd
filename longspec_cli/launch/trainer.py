"""Every trainer module's command line, built and started here: the one owner of `python -m longspec.<module>`.

The CLI never imports torch: it starts the trainer's modules as processes. The builders below write
each module's argv (train's Hydra arguments behind DeepSpeed's launcher, prepare, show, evaluate,
export, regenerate, doctor, draftcheck); `run_module` starts one, echoes its progress (stderr) when
asked and reads its result from the last JSON line of its stdout; `run_trainer_json` adds the
CLI's errors (the module's own error object, a crash).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from longspec.files.tail import last_json
from longspec.errors import LongspecError, RefusedError, UsageError

TRAINER_MODULE = "longspec.train"


# ----------------------------------------------------------------------------- the command lines

def module_argv(module: str, *args: str) -> list[str]:
    """`python -m <module> <args>` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def exp_location(spec) -> tuple[Path, str]:
    """(conf dir, exp name) for `--config-dir CONF +exp=NAME`: the config must be CONF/exp/NAME.yaml."""
    from longspec.project.hydracompose import stage_location

    loc = stage_location(spec.config)
    if loc is None:
        raise UsageError(f"stage {spec.name}: {spec.config} is not inside a conf/exp/ folder",
                         hint="Hydra reads a stage as --config-dir CONF +exp=NAME from CONF/exp/NAME.yaml")
    return loc


def _stage_argv(module: str, spec, *args: str) -> list[str]:
    conf, exp = exp_location(spec)
    return module_argv(module, "--config-dir", str(conf), f"+exp={exp}", *args)


def trainer_args(conf_dir: str | os.PathLike, stage: str, output_dir: str | os.PathLike,
                 overrides: Sequence[str] = (), module: str = TRAINER_MODULE) -> list[str]:
    """train: what follows DeepSpeed's launcher flags, the module and its Hydra arguments."""
    return ["--module", module, "--config-dir", str(conf_dir), f"+exp={stage}", f"output_dir={output_dir}",
            *overrides]


def deepspeed_line(gpus: int, conf_dir: str | os.PathLike, stage: str, output_dir: str | os.PathLike) -> str:
    """train on one node as a user types it (shell-quoted; the comment atop every stage file)."""
    return shlex.join(["deepspeed", f"--num_gpus={gpus}", *trainer_args(conf_dir, stage, output_dir)])


def prepare_argv(spec, overrides: Sequence[str], world: int, workers: int | None) -> list[str]:
    """prepare: tokenize the stage's data into its cache."""
    argv = _stage_argv("longspec.prepare", spec, *overrides, "--world", str(world), "--json")
    return argv + (["--workers", str(workers)] if workers else [])


def show_argv(spec, overrides: Sequence[str], count: int) -> list[str]:
    """show: the stage's first `count` records as the trainer encodes them."""
    return _stage_argv("longspec.show", spec, *overrides, "--show", str(count), "--json")


def regenerate_argv(spec, out: str | os.PathLike, flags: Sequence[str], rerun: str) -> list[str]:
    """regenerate: the stage's data answered again by its target into `out`; `rerun` is the command
    its messages and manifest name to go on."""
    return _stage_argv("longspec.regenerate", spec, "--out", str(out), *flags, "--rerun", rerun, "--json")


def export_argv(run_dir: str | os.PathLike, stage: str, fmt: str, out: Path | None, force: bool) -> list[str]:
    """export: the stage's draft as an HF folder or one .safetensors file."""
    argv = module_argv("longspec.export", str(run_dir), "--stage", stage, "--format", fmt)
    if out is not None:
        argv += ["--out", str(Path(out).expanduser().absolute())]
    return argv + (["--force"] if force else [])


def tiny_argv(out: str | os.PathLike) -> list[str]:
    """tiny: the tiny preset's target, tokenizer and data built into OUT."""
    return module_argv("longspec.tiny", "build", str(out), "--json")


def doctor_argv(where: Path | None) -> list[str]:
    """doctor: what this machine can run (the disk check under `where`, default here)."""
    return module_argv("longspec.doctor", "--dir", str((where or Path.cwd()).expanduser().absolute()))


def draftcheck_argv(draft: str | os.PathLike, target: str | os.PathLike | None) -> list[str]:
    """draftcheck: load a draft with weights_only=True and check it against the target."""
    return module_argv("longspec.draftcheck", str(draft), *(["--target", str(target)] if target is not None else []))


def evaluate_argv(output_dir: str | os.PathLike, stage: str, *, gamma: int = 4, max_new_tokens: int | None = None,
                  num_prompts: int | None = None, prompts: str | os.PathLike | None = None, device: str = "auto",
                  baseline_draft: str | os.PathLike | None = None, baseline_stage: str | None = None,
                  methods: tuple[str, ...] = ("chain",), tree_shape: tuple[int, ...] | None = None,
                  temperature: float = 0.0, lengths: str | None = None, bench: str | None = None,
                  prompt_tokens: tuple[int | None, int | None] = (None, None)) -> list[str]:
    """evaluate (`python -m longspec.evaluate RUN ... --json`): it writes RUN/eval.json (the stage's
    default measurement) or RUN/eval-<what>.json (--prompts, --bench, other settings) and prints the
    same object as its last stdout line; exit 0 ok, 1 not lossless or no finished draft, 2 usage,
    3 unreadable input. ``baseline_draft``: the input draft (the draft_from stage's final one),
    decoded on the same prompts (`baseline`, what runs.quality.gate_stage compares)."""
    argv = module_argv("longspec.evaluate", str(output_dir), "--stage", stage, "--gamma", str(gamma),
                       "--device", device, "--json")
    if max_new_tokens is not None:
        argv += ["--max-new-tokens", str(max_new_tokens)]
    if lengths:
        argv += ["--lengths", lengths]
    if bench:
        argv += ["--bench", bench]
    for flag, value in zip(("--min-prompt-tokens", "--max-prompt-tokens"), prompt_tokens):
        if value is not None:
            argv += [flag, str(value)]
    for m in methods:
        argv += ["--method", m]
    if tree_shape:
        argv += ["--tree-shape", *map(str, tree_shape)]
    if temperature:
        argv += ["--temperature", repr(float(temperature))]
    if num_prompts is not None:  # else the evaluator picks by prompt length (8 to 32)
        argv += ["--num-prompts", str(num_prompts)]
    if prompts is not None:
        argv += ["--prompts", str(prompts)]
    if baseline_draft is not None:
        argv += ["--baseline-draft", str(baseline_draft)]
        if baseline_stage:
            argv += ["--baseline-stage", baseline_stage]
    return argv


# ----------------------------------------------------------------------------- starting them

@dataclass
class ModuleRun:
    code: int
    result: dict | None  # the last JSON object on stdout
    tail: list[str] = field(default_factory=list)  # the last stderr lines (for a crash message)
    timed_out: bool = False


def trainer_available() -> bool:
    """The trainer's packages are installed (so `python -m longspec...` can run)."""
    return importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


def trainer_root() -> Path:
    """The folder holding `longspec/`: the tree (or site-packages) this CLI runs from holds the trainer too."""
    return Path(__file__).resolve().parents[2]


def run_module(argv: list[str], *, show_progress: bool = False, timeout: float | None = None) -> ModuleRun:
    """Run `argv` (a `module_argv`); stderr lines are echoed as they come when show_progress."""
    import subprocess
    import threading

    module = _module(argv)
    env = dict(os.environ)
    root = str(trainer_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    tail: deque[str] = deque(maxlen=12)
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
    except OSError as e:
        raise RefusedError(f"cannot start {module}: {e}") from None
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()  # stdout drains on its own: a big result never blocks the child
    expired = threading.Event()
    timer = threading.Timer(timeout, lambda: (expired.set(), proc.kill())) if timeout else None
    if timer:
        timer.start()
    forward = forward_sigterm(proc)
    try:
        for line in proc.stderr:
            line = line.rstrip("\n")
            tail.append(line)
            if show_progress and line and not _noise(line):
                print(f"  {line}", file=sys.stderr, flush=True)
        code = proc.wait()
        reader.join()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        raise
    finally:
        if timer:
            timer.cancel()
        forward()
    return ModuleRun(code, last_json("".join(chunks)), list(tail), expired.is_set())


def forward_sigterm(proc):
    """While the module runs, a SIGTERM to this process goes to it (it stops its own way, writes
    what it has done and exits; this process then reads its result): no module is left running
    on its own. Returns the function that puts the previous handler back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.poll() is None and proc.send_signal(signum))
    return lambda: signal.signal(signal.SIGTERM, previous)


def run_trainer_json(argv: list[str], *, show_progress: bool, allow_codes=()) -> dict:
    """Run `python -m longspec.<module> ... --json`; its last stdout line is the JSON result (or an
    error object). Exit codes in allow_codes still return the result."""
    module = _module(argv)
    if not trainer_available():
        raise RefusedError(f"`{module}` needs the trainer's packages (torch, transformers)",
                           hint="pip install 'longspec[train]'")
    run = run_module(argv if "--json" in argv else [*argv, "--json"], show_progress=show_progress)
    result, code = run.result, run.code
    if isinstance(result, dict) and "error" in result and code != 0:
        raise LongspecError(str(result["error"]), hint=result.get("hint"), exit_code=int(result.get("exit_code") or 1))
    if result is None or (code != 0 and code not in allow_codes):
        detail = "\n".join(line for line in run.tail if line.strip())
        raise LongspecError(f"{module} failed (exit {code})" + (f":\n{detail}" if detail else ""), exit_code=1)
    return result


def _module(argv: list[str]) -> str:
    return argv[2] if len(argv) > 2 and argv[1] == "-m" else argv[0]


def _noise(line: str) -> bool:
    return "FutureWarning" in line or "return forward_call" in line or line.lstrip().startswith("warnings.warn")
