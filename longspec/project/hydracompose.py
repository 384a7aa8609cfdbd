"""Compose a stage with Hydra itself, exactly as the trainer does, and say where every key was set.

    compose_stage(conf/exp/long.yaml, overrides) -> Composed(data, origins, problems, ...)

The trainer runs `python -m longspec.train --config-dir DIR/conf +exp=STAGE [overrides]`: Hydra
composes the trainer's primary `longspec/conf/config.yaml` (found on disk, never imported), then
DIR/conf/exp/STAGE.yaml and its defaults list, then the overrides. Here the same search path and
the same `Hydra.compose_config` call produce the same DictConfig. What Hydra does not give is
added on top:

  provenance  each dotted key's file:line, from ruamel positions in the defaults list's files,
              walked in Hydra's merge order (the last one wins; `???` never wins over a value)
  problems    Hydra's own errors as Problems with a file, a line and a hint (project.hydraproblems);
              every leaf resolved on its own, so all are reported at once

An upstream experiment file (the reference trainer's dialect) is composed as its own primary
config with its conf/ folder on the search path, the way the reference trainer reads it.

The result type is project.composed.Composed; project.composecache keeps each composition until a file
Hydra read changes, so a warm command imports no Hydra at all.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from longspec.project import composecache
from longspec.project import hydraproblems as P
from longspec.project import schema as S
from longspec.files import yamlio
from longspec.project.composed import MISSING, Composed, Origin, read_positions
from longspec.project.placeholders import scan_placeholders
from longspec.project.problem import Problem

TRAINER_MODULE = "longspec"
_REF = re.compile(r"\$\{([\w.]+)\}")


# ---------------------------------------------------------------- where things are

def trainer_conf_dir() -> Path:
    """longspec/conf of the installed trainer, located without importing the `longspec` package."""
    env = os.environ.get("LONGSPEC_TRAINER_CONF")
    if env:
        return Path(env)
    spec = importlib.util.find_spec(TRAINER_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return Path(__file__).resolve().parents[1] / "conf"
    return Path(list(spec.submodule_search_locations)[0]) / "conf"


def stage_location(path: Path) -> tuple[Path, str] | None:
    """(conf dir, exp name) for `--config-dir CONF +exp=NAME`, or None when not under an exp/ folder."""
    parts = Path(os.path.abspath(path)).parent.parts
    if "exp" not in parts:
        return None
    i = len(parts) - 1 - parts[::-1].index("exp")
    return Path(*parts[:i]), "/".join(parts[i + 1:] + (Path(path).stem,))


# ---------------------------------------------------------------- Hydra

_HYDRA: dict[tuple, Any] = {}


def _hydra(primary: Path, extra: list[Path]):
    """One Hydra per search path in a process: the stages of a project share it (each compose_config
    reads the files afresh: Hydra's file cache lives for one call)."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra

    key = (str(primary), *map(str, extra))
    if key in _HYDRA:
        if GlobalHydra.instance().hydra is not _HYDRA[key][0]:  # someone else set Hydra up since
            GlobalHydra.instance().clear()
            GlobalHydra.instance().initialize(_HYDRA[key][0])
        return _HYDRA[key]

    search_path = create_config_search_path(str(primary))
    for d in extra:  # what `--config-dir D` does in hydra.main
        search_path.prepend(provider="command-line", path=f"file://{os.path.abspath(d)}",
                            anchor=SearchPathQuery(provider="schema"))
    _HYDRA.clear()
    GlobalHydra.instance().clear()
    _HYDRA[key] = Hydra.create_main_hydra2(task_name="train", config_search_path=search_path), search_path
    return _HYDRA[key]


def hydra_compose(primary: Path, config_name: str, extra: list[Path], overrides: list[str]):
    """(task config without its `hydra` node, defaults list, file search dirs): what the trainer's
    @hydra.main hands its task function. Raises Hydra's exceptions."""
    import warnings

    from hydra.types import RunMode
    from omegaconf import open_dict

    import hydra._internal.config_loader_impl as loader

    h, search_path = _hydra(primary, extra)
    seen: list = []
    original = loader.create_defaults_list

    def observe(*args, **kwargs):  # the defaults list Hydra merges, kept for provenance (not changed)
        result = original(*args, **kwargs)
        seen.append(result)
        return result

    loader.create_defaults_list = observe
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            cfg = h.compose_config(config_name, overrides, run_mode=RunMode.RUN, from_shell=True,
                                   with_log_configuration=False)
    finally:
        loader.create_defaults_list = original
    defaults = seen[-1].defaults
    with open_dict(cfg):
        del cfg["hydra"]
    dirs = [Path(e.path[len("file://"):] if e.path.startswith("file://") else e.path)
            for e in search_path.get_path() if e.path.startswith(("file://", "/"))]
    return cfg, defaults, dirs


# ---------------------------------------------------------------- provenance

def _walk_origins(node: Any, prefix: str, file: Path, kind: str, origins: dict[str, list[Origin]],
                  root: bool) -> None:
    for k, v in node.items():
        key = str(k)
        if root and key == "defaults":
            continue
        dotted = f"{prefix}.{key}" if prefix else key
        leaf = None if isinstance(v, dict) else yamlio.to_plain(v)
        if leaf == MISSING and origins.get(dotted) and origins[dotted][-1].value != MISSING:
            continue  # OmegaConf keeps the earlier value
        origins.setdefault(dotted, []).append(Origin(file, yamlio.key_line(node, k), leaf, kind))
        if isinstance(v, dict):
            _walk_origins(v, dotted, file, kind, origins, False)


def _locate(config_path: str, dirs: list[Path]) -> Path | None:
    for d in dirs:
        p = d / f"{config_path}.yaml"
        if p.is_file():
            return p
    return None


def _provenance(c: Composed, defaults: list, dirs: list[Path], shadow: dict[Path, Path],
                primary: Path | None, overrides: list[str]) -> None:
    for d in defaults:
        pkg = d.package or ""
        if d.config_path is None or pkg == "hydra" or pkg.startswith("hydra.") or d.config_path.startswith("hydra/"):
            continue
        f = _locate(d.config_path, dirs)
        if f is None:
            continue
        real = shadow.get(f, f)
        c.merge_order.append(real)
        if real not in c.files:
            c.files.append(real)
        node, _, _ = read_positions(real)
        if isinstance(node, dict):
            kind = "default" if primary is not None and f == primary / "config.yaml" else "file"
            _walk_origins(node, pkg, real, kind, c.origins, True)
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        c.origins.setdefault(key, []).append(Origin(None, None, value, "override"))


# ---------------------------------------------------------------- resolving leaf by leaf

def _resolve(c: Composed, cfg) -> None:
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    raw = OmegaConf.to_container(cfg, resolve=False)
    keys = _dotted_keys(raw)

    def walk(node, raw_node, prefix: str):
        items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else None
        out: Any = {} if isinstance(node, DictConfig) else []
        pairs = [(k, k) for k, _ in items] if items is not None else list(enumerate(range(len(node))))
        for k, _ in pairs:
            dotted = f"{prefix}.{k}" if prefix else str(k)
            r = raw_node[k] if raw_node is not None else None
            if isinstance(r, str) and "${" in r:
                c.refs[dotted] = _REF.findall(r)
            try:
                v = node[k]
            except MissingMandatoryValue:
                c.missing.append(dotted)
                v = MISSING
            except (OmegaConfBaseException, RecursionError) as e:
                c.problems.append(P.interp_problem(c, dotted, r, e, keys))
                v = r
            if isinstance(v, (DictConfig, ListConfig)):
                v = walk(v, r if isinstance(r, (dict, list)) else None, dotted)
            if isinstance(out, dict):
                out[str(k)] = v
            else:
                out.append(v)
        return out

    c.data = walk(cfg, raw, "")


def _dotted_keys(node: Any, prefix: str = "") -> list[str]:
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            d = f"{prefix}.{k}" if prefix else str(k)
            out.append(d)
            out += _dotted_keys(v, d)
    return out


# ---------------------------------------------------------------- shadow tree for placeholders

def _shadow(conf: Path) -> tuple[Path, dict[Path, Path]]:
    """A copy of `conf` with `[Your Directory]`-style placeholders made parseable (as scan_placeholders
    does), so Hydra can compose a file that still holds them; maps copies back to the originals."""
    tmp = Path(tempfile.mkdtemp(prefix="longspec-conf-"))
    back: dict[Path, Path] = {}
    for src in conf.rglob("*.yaml"):
        dst = tmp / src.relative_to(conf)
        dst.parent.mkdir(parents=True, exist_ok=True)
        _, _, text = read_positions(src)
        dst.write_text(text if text else "", encoding="utf-8")
        back[dst] = src
    return tmp, back


def _needs_shadow(conf: Path) -> bool:
    """Does a file of the tree hold a `[...]` placeholder (text scan only; parsing is for provenance)?"""
    for p in conf.rglob("*.yaml"):
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if "[" in text and "__placeholder" in scan_placeholders(text, p)[0]:
            return True
    return False


# ---------------------------------------------------------------- entry point

_COMPOSED: dict[str, tuple[dict, Composed]] = {}


def compose_stage(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Composed:
    """Compose the stage file at `path` as the trainer would (upstream files as the reference
    trainer would). Never raises for bad input: see Composed.problems. A stage is composed once
    while none of the files Hydra read changes: within a process (status, next-stage and run ask
    several times) and across commands (project.composecache). The result is shared: read it, do not
    change it."""
    path, overrides = Path(path), list(overrides)
    trainer = trainer_conf_dir()
    key = composecache.entry_key(path, overrides, trainer)
    hit = _COMPOSED.get(key)
    if hit is not None and composecache.current(hit[0]):
        return hit[1]
    hit = composecache.lookup(key)
    if hit is None:
        c = _compose_stage(path, overrides)
        stamp = composecache.stamp_of(c, _searched(c, path, trainer), trainer)
        composecache.store(key, stamp, c, overrides)
        hit = (stamp, c)
    _COMPOSED[key] = hit
    return hit[1]


def _searched(c: Composed, path: Path, trainer: Path) -> list[Path]:
    """The folders Hydra searched for `path` (none for a file checked on its own)."""
    loc = stage_location(path)
    if c.dialect == S.UPSTREAM:
        return [loc[0] if loc else path.parent]
    if c.dialect == S.LONGSPEC and loc is not None:
        return [loc[0], trainer]
    return []


def _compose_stage(path: Path, overrides: list[str]) -> Composed:
    node, problems, _ = read_positions(path)
    c = Composed(path=path, ok=False, data={}, origins={}, refs={}, files=[path], problems=list(problems))
    if node is None:
        return c
    raw = yamlio.to_plain(node)
    d = S.dialect_of(raw)
    c.dialect = d
    if d in (S.DEEPSPEED, S.HYDRA):  # a fragment on its own: its ${...} belong to the stage that lists it
        c.ok, c.data = True, raw
        _walk_origins(node, "", path, "file", c.origins, True)
        return c
    loc = stage_location(path)
    if d == S.UPSTREAM:
        conf = loc[0] if loc else path.parent
        primary, name, extra, trainer = path.parent, path.stem, [conf], None
    elif loc is None:
        c.ok, c.data = True, raw
        _walk_origins(node, "", path, "file", c.origins, True)
        c.problems.append(Problem("warning", str(path), None, None,
                                  f"{path.name} is not inside a conf/exp/ folder: the trainer cannot read it "
                                  "(checked on its own, without the trainer's defaults)",
                                  "put it at CONF/exp/NAME.yaml and run --config-dir CONF +exp=NAME"))
        return c
    else:
        conf, name = loc
        trainer = trainer_conf_dir()
        primary, extra = trainer, [conf]
        overrides = [f"+exp={name}"] + overrides
    tmp = None
    shadow: dict[Path, Path] = {}
    if _needs_shadow(conf):
        tmp, shadow = _shadow(conf)
        rel = path.resolve().parent.relative_to(conf.resolve()) if d == S.UPSTREAM else None
        extra = [tmp]
        if d == S.UPSTREAM:
            primary = tmp / rel
    try:
        cfg, defaults, dirs = hydra_compose(primary, "config" if trainer else name, extra, overrides)
        _provenance(c, defaults, dirs, shadow, trainer, [o for o in overrides if not o.startswith("+exp=")])
    except Exception as e:  # Hydra's errors are the user's problems here
        files = {}
        if loc:
            files[f"exp/{loc[1]}"] = path
        dirs = [conf / Path(d).relative_to(tmp) if tmp is not None and Path(d).is_relative_to(tmp) else d
                for d in [primary, *extra]]
        c.problems.append(P.hydra_problem(c, e, files, [x for x in dirs if x != trainer]))
        c.data = raw
        return c
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    c.ok = True
    _resolve(c, cfg)
    if isinstance(c.data.get("exp"), dict) and d == S.LONGSPEC:
        P.header_problem(c)
    P.missing_problems(c)
    return c


# ---------------------------------------------------------------- `longspec config`

def leaf_origins(c: Composed) -> dict[str, str]:
    """dotted leaf key -> where it was set: `file:line`, `trainer default (file:line)` or `override`."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        for k, v in node.items():
            dotted = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                walk(v, dotted)
            else:
                out[dotted] = c.origin(dotted).describe()

    walk(c.data, "")
    return out


def stage_overrides(output_dir: Path | None, overrides: list[str]) -> list[str]:
    """The overrides `longspec run` passes the trainer for a project stage, in its order."""
    return ([f"output_dir={Path(output_dir).resolve()}"] if output_dir is not None else []) + list(overrides)
