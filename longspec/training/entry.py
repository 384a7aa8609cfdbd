"""What every `python -m longspec.<module>` entry shares: the trainer's Hydra entry and its errors.

    make_hydra_entry(task)   @hydra.main on longspec/conf/config.yaml; task(cfg) -> exit code
    implied_config_dir(argv) `--config-dir conf` when run from a project folder without it
    read_config(cfg)         the composed DictConfig as plain, checked data (ConfigError otherwise)
    TrainError, user_errors() the mistakes a user can fix: one `error:` block (report_error), exit 1
    tool_boundary(...)       the error boundary of a JSON-printing tool (prepare, show)

longspec.train (the training loop) and longspec.prepare (tokenize once) both start here, so they
compose a stage the same way and word a mistake the same way.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from longspec.training import dsconfig
from longspec.training.preempt import EXIT_PREEMPTED

EXIT_ERROR = 1
EXIT_INPUT = 3                # unreadable input: a malformed record (DESIGN.md exit codes)


class TrainError(Exception):
    """A problem the user can fix (bad input): reported as `error: ...` (and `hint: ...`), exit code 1."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message + (f"\nhint: {hint}" if hint else ""))


def report_error(message: str, hint: str | None = None) -> None:
    text = "error: " + message.strip().replace("\n", "\n  ")
    if hint:
        text += f"\n  hint: {hint}"
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):    # stderr is train.log on a full disk: nothing more to do
        pass


def user_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [dsconfig.ConfigError, TrainError]
    from longspec.model.weights import DraftLoadError
    from longspec.training.simtau import HeldoutChanged

    errors += [DraftLoadError, HeldoutChanged]
    try:
        from longspec.data.encoding import DataError

        errors.append(DataError)
    except ImportError:
        pass
    return tuple(errors)


def tool_boundary(run: Callable[[Any], dict], cfg, *, json_out: bool, extra_errors: tuple = (),
                  code_of: Callable[[BaseException], int] = lambda e: EXIT_ERROR) -> tuple[int, dict | None]:
    """(exit code, result) of `run(cfg)` for a tool that prints JSON (`prepare`, `show`): a user's
    mistake becomes one `error:` block (and `{"error", "exit_code"}` with --json), Ctrl-C exit 130;
    anything else is a bug and propagates."""
    from longspec.training.preempt import EXIT_INTERRUPTED

    try:
        return 0, run(cfg)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED, None
    except Exception as e:
        if isinstance(e, dsconfig.ConfigError):
            message = "invalid stage config:\n" + "\n".join(f"- {p}" for p in e.problems)
        elif isinstance(e, (*user_errors(), *extra_errors, OSError)):
            message = str(e)
        else:
            raise
        code = code_of(e)
        if json_out:
            print(json.dumps({"error": message, "exit_code": code}), flush=True)
        report_error(message)
        return code, None


def read_config(cfg) -> dict[str, Any]:
    """The composed DictConfig as plain, resolved data; ConfigError on missing/broken values."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if "exp" in cfg:
        # Hydra reads a file's `# @...` header only up to the first other line, comments included.
        raise dsconfig.ConfigError([
            "the experiment file was not merged at the top level: `# @package _global_` must be its "
            "first line (Hydra stops reading the header at the first other comment)"])
    missing = sorted(OmegaConf.missing_keys(cfg))
    try:
        conf = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise dsconfig.ConfigError([f"the config cannot be resolved: {str(e).splitlines()[0]}"]) from None
    problems = [f"{key} must be set (in the stage file or as {key}=...)" for key in missing]
    problems += [p for p in dsconfig.check_config(conf) if not any(p.startswith(k) for k in missing)]
    if problems:
        raise dsconfig.ConfigError(problems)
    return conf


def implied_config_dir(argv: list[str]) -> list[str]:
    """Run from a project folder, `--config-dir conf` may be left out. (Not a `hydra.searchpath`
    entry in config.yaml: Hydra warns on every launch from a folder without conf/.)"""
    given = any(a in ("--config-dir", "-cd") or a.startswith(("--config-dir=", "-cd=")) for a in argv)
    return argv if given or not Path("conf").is_dir() else ["--config-dir", "conf", *argv]


# The primary config, as an absolute path: the same whether run as a module, a script or imported.
# The front end (longspec.project.hydracompose) composes with this same file and search path.
HYDRA_MAIN = {"config_path": str(Path(__file__).resolve().parents[1] / "conf"), "config_name": "config",
              "version_base": None}


def make_hydra_entry(task):
    """The trainer's @hydra.main entry running `task(cfg)` (an exit code): training, preparing, or a
    test's look at the composed config."""
    import hydra

    @hydra.main(**HYDRA_MAIN)
    def entry(cfg) -> None:
        code = task(cfg)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        if code == EXIT_PREEMPTED:
            # Checkpoint, event and logs are written and closed, the process group is gone. A
            # scheduler's grace period is short: skip the interpreter's teardown of native thread
            # pools (~4 s on the tiny stage on CPU), which saves nothing.
            os._exit(code)
        if code:
            sys.exit(code)

    return entry
