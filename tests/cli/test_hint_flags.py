"""Every `--flag` a hint or error message names exists on the verb that prints it.

The walk reads the CLI's source and the library's torch-free groups (ast): the text of every `hint=` and of every error / problem
constructor call (f-strings with their values left blank). A flag after `longspec VERB` in that
text must be an option of VERB; any other flag must be an option of every verb that can print the
module's messages (MODULE_VERBS). Options come from the click command that Typer builds, so a
renamed or removed option fails here. A last check runs the case that once named a flag `run`
does not have: the global-batch error of `run --gpus 2` on CPU.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from longspec_cli.app import app

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "longspec_cli"
# The library's torch-free groups the verbs call (their messages reach the terminal the same way).
GROUND = [ROOT / "longspec" / g for g in ("project", "runs", "files", "formats", "machine")]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
VERB_CALL = re.compile(r"longspec ([a-z][a-z-]*)((?:(?!longspec )[^`\n;])*)")  # up to a backtick
MESSAGE_CALL = re.compile(r"(Error|Failed|Problem|problem)$")
# Flags of other programs that messages quote, each with the program the message names.
FOREIGN = {"--local-dir": "huggingface-cli", "--config-dir": "Hydra", "--qos": "sbatch"}
# Which verbs can print a module's messages (commands/<verb>.py print their own).
MODULE_VERBS = {
    # demo runs the same pipeline (see NOT_FROM_DEMO)
    **{f"launch/{m}.py": ("run", "demo") for m in ("plan", "preflight", "execute", "gate")},
    "launch/": ("run",),
    "longspec/project/validate.py": ("validate",),
    "longspec/project/checks/": ("validate", "run"),
    "launch/chain.py": ("next-stage",),  # run reaches only its project mode, whose hints name their verb
    "launch/scaffold.py": ("init",),
    "launch/vllmcmd.py": ("serve",),
    "launch/evalrun.py": ("eval",),
    "launch/regen.py": ("regenerate",),   # demo reaches only its run_stage and plan, whose messages name no flag
}


# Pipeline messages `demo` cannot reach: it never sets a gate and always runs every stage.
NOT_FROM_DEMO = {"--gate", "--all"}


def verb_options() -> dict[str, set[str]]:
    group = typer.main.get_command(app)
    out = {}
    for name, cmd in group.commands.items():
        flags = set()
        for p in cmd.params:
            flags.update(o for o in (*p.opts, *p.secondary_opts) if o.startswith("--"))
        out[name] = flags | {"--help"}
    return out


def _text(node: ast.AST) -> list[str]:
    """String constants of an expression; an f-string is one text with its values blanked."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["".join(v.value if isinstance(v, ast.Constant) else "X" for v in node.values)]
    out = []
    for child in ast.iter_child_nodes(node):
        out += _text(child)
    return out


def messages(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        parts = [kw.value for kw in node.keywords if kw.arg == "hint"]
        if MESSAGE_CALL.search(name or ""):
            parts += list(node.args) + [kw.value for kw in node.keywords if kw.arg not in ("hint", "exit_code")]
        out += [(node.lineno, t) for part in parts for t in _text(part)]
    return out


def verbs_of(path: Path) -> tuple[str, ...]:
    rel = path.relative_to(ROOT).as_posix().removeprefix("longspec_cli/")
    if rel.startswith("commands/"):
        return (path.stem.replace("_", "-"),)
    keys = [k for k in MODULE_VERBS if rel.startswith(k)]
    return MODULE_VERBS[max(keys, key=len)] if keys else ()     # the most specific entry


def hint_flags() -> list[tuple[str, str, str, str]]:
    """(where, verb, flag, text) for every flag a message names."""
    found = []
    for path in sorted(PKG.rglob("*.py")) + sorted(p for g in GROUND for p in g.rglob("*.py")):
        for line, text in messages(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            claimed = []
            for m in VERB_CALL.finditer(text):
                claimed.append((m.start(), m.end()))
                found += [(where, m.group(1), f, text) for f in FLAG.findall(m.group(2))]
            for m in FLAG.finditer(text):
                if any(a <= m.start() < b for a, b in claimed):
                    continue
                if m.group() in FOREIGN and FOREIGN[m.group()] in text:
                    continue
                found += [(where, verb, m.group(), text) for verb in verbs_of(path)]
    return found


def test_the_walk_sees_the_messages_it_should():
    found = {(v, f) for _, v, f, _ in hint_flags()}
    # A handful that must be seen, so the walk cannot silently find nothing.
    for want in [("run", "--force"), ("run", "--gpus"), ("next-stage", "--no-deep"), ("init", "--preset"),
                 ("run", "--gate"), ("monitor", "--once")]:
        assert want in found, want


def test_every_flag_a_hint_names_exists_on_its_verb():
    options = verb_options()
    wrong = [f"{where}: `longspec {verb}` has no {flag} ({text.strip()[:80]!r})"
             for where, verb, flag, text in hint_flags()
             if (verb not in options or flag not in options[verb])
             and not (verb == "demo" and flag in NOT_FROM_DEMO)]
    assert not wrong, "\n".join(wrong)


def test_run_names_its_own_flags_in_the_global_batch_error(tmp_path):
    root = tmp_path / "p"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "LONGSPEC_GPUS": "none",
           "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-m", "longspec_cli", "init", str(root), "--preset", "qwq-32b-preview",
                    "--no-input"], env=env, check=True, capture_output=True, timeout=120)
    res = subprocess.run([sys.executable, "-m", "longspec_cli", "run", str(root), "base", "--dry-run",
                          "--gpus", "3"], env=env, capture_output=True, text=True, timeout=120)
    text = res.stdout + res.stderr
    assert "global_batch_size is" in text, text[-2000:]
    named = set(FLAG.findall(text[text.index("global_batch_size is"):].split("\n")[0]))
    assert named and named <= verb_options()["run"], named
