"""Compositions kept between commands: a stage is composed once, until a file Hydra read changes.

    key = entry_key(path, overrides, trainer_conf)    which composition (not yet whether it is current)
    hit = lookup(key)                                 (stamp, Composed) when every file is unchanged
    stamp = stamp_of(c, folders, trainer_conf)        what the composition rests on
    store(key, stamp, c, overrides)                   keep it (in <cache root>/compose/<key>.json)

The key hashes what is not a file: the stage path (as given, absolute, and the working folder when
relative), the overrides, the trainer's conf folder, the Hydra and OmegaConf versions and the bytes
of the composing code itself (an upgrade never reads an older result). The stamp holds the content
hash of every file Hydra read (the stage file, each file of its defaults list, the trainer's primary
config; when Hydra could not compose, every YAML file of the folders it searched) and the names
of the YAML files in those folders: the conf tree and the trainer's conf folder (a new file can
change what a search finds). A file checked on its own (a DeepSpeed fragment) rests on itself.
An edit of one stage file therefore recomposes that stage only.

Not kept: a composition whose files or overrides call a resolver (`${oc.env:...}`, `${now:...}`:
the value depends on more than files), or one that would not come back from JSON exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from longspec.files import atomic
from longspec.project.composed import Composed

FOLDER = "compose"
KEEP = 512
FORMAT = 1
# the modules whose code decides what a composition holds
_CODE = ("project/composed.py", "project/composecache.py", "project/hydracompose.py", "project/hydraproblems.py",
         "project/placeholders.py", "project/problem.py", "project/schema.py", "files/yamlio.py")
_RESOLVER = re.compile(r"\$\{\s*[\w.]+\s*:")
_VERSION = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.M)
_SALT: list[str] = []


def _salt() -> str:
    """Hydra's and OmegaConf's versions (read from their source, nothing imported) and the code's hash."""
    if not _SALT:
        h = hashlib.blake2b(f"format {FORMAT}".encode(), digest_size=16)
        for name, file in (("hydra", "__init__.py"), ("omegaconf", "version.py")):
            spec = find_spec(name)
            text = ""
            if spec is not None and spec.origin:
                try:
                    text = (Path(spec.origin).parent / file).read_text(encoding="utf-8")
                except OSError:
                    pass
            m = _VERSION.search(text)
            h.update(f"{name} {m.group(1) if m else '?'};".encode())
        here = Path(__file__).parents[1]     # longspec/
        for name in _CODE:
            h.update((here / name).read_bytes())
        _SALT.append(h.hexdigest())
    return _SALT[0]


def entry_key(path: Path, overrides: list[str], trainer_conf: Path) -> str:
    relative = "" if os.path.isabs(path) else os.getcwd()
    parts = [_salt(), str(path), os.path.abspath(path), relative, str(trainer_conf), *overrides]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _digest(path: Path) -> str | None:
    try:
        return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
    except OSError:
        return None


def _names(folder: Path) -> str:
    return hashlib.blake2b("\0".join(sorted(str(p.relative_to(folder)) for p in folder.rglob("*.yaml"))).encode(),
                           digest_size=16).hexdigest()


def stamp_of(c: Composed, folders: list[Path], trainer_conf: Path) -> dict[str, Any]:
    """What `c` rests on; `folders` are the ones Hydra searched (their YAML names are listed)."""
    read = [c.path, *c.files, *c.merge_order, trainer_conf / "config.yaml"]
    if not c.ok:  # Hydra stopped somewhere: any file of the searched folders may be the one
        read += [f for d in folders for f in sorted(d.rglob("*.yaml"))]
    files = list(dict.fromkeys(str(f) for f in read))
    return {"files": [[f, _digest(Path(f))] for f in files],
            "folders": [[str(d), _names(d)] for d in dict.fromkeys(folders)]}


def current(stamp: dict[str, Any]) -> bool:
    """Does every file (and folder listing) still hash as it did?"""
    try:
        return (all(_digest(Path(f)) == h for f, h in stamp["files"])
                and all(_names(Path(d)) == h for d, h in stamp["folders"]))
    except (KeyError, TypeError, ValueError):
        return False


def lookup(key: str) -> tuple[dict[str, Any], Composed] | None:
    entry = atomic.entry_get(FOLDER, key)
    if not isinstance(entry, dict) or not current(entry.get("stamp")):
        return None
    try:
        return entry["stamp"], Composed.from_json(entry["composed"])
    except (KeyError, TypeError, ValueError):
        return None


def store(key: str, stamp: dict[str, Any], c: Composed, overrides: list[str]) -> None:
    if any(_RESOLVER.search(o) for o in overrides):
        return
    for f, _ in stamp["files"]:
        try:
            if _RESOLVER.search(Path(f).read_text(encoding="utf-8", errors="replace")):
                return
        except OSError:
            pass
    try:
        value = json.loads(json.dumps(c.to_json()))
    except (TypeError, ValueError):
        return
    if Composed.from_json(value) != c:
        return
    atomic.entry_put(FOLDER, key, {"stamp": stamp, "composed": value}, KEEP)
