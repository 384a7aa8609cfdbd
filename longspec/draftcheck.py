"""Deep check of a draft, run ONLY as a subprocess: `python -m longspec.draftcheck DRAFT [--target DIR]`.

It imports torch (and longspec's checkpoint/model code) here, never in the CLI process. Prints one
JSON line:
    {"draft", "loadable", "tensors", "parameters", "target_checked", "problems": [...], "error", "note"}
Exit: 0 usable, 1 does not fit the target, 3 cannot be loaded with weights_only=True, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace


def _load(draft: Path):
    """(state dict, load error) using longspec.model.weights when present, else torch.load(weights_only=True)."""
    try:
        from longspec.model.weights import DraftLoadError, load_draft_state
    except ImportError:
        return _load_plain(draft)
    try:
        return load_draft_state(draft), None
    except DraftLoadError as e:
        return None, str(e)


def _load_plain(draft: Path):
    import torch

    if draft.is_dir():
        return None, f"{draft} is a folder; checking folders needs longspec.model.weights"
    try:
        if draft.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(draft), device="cpu")
        else:
            state = torch.load(draft, map_location="cpu", weights_only=True)
    except Exception as e:  # any failure to load is the report, not a crash
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    if not isinstance(state, dict) or not state or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        return None, "not a non-empty dict of tensors"
    return state, None


def _target_problems(state, target: Path) -> tuple[bool, list[str], str | None]:
    """(checked, problems, note): key/shape check against a draft built (on the meta device) for the target."""
    cfg_file = target / "config.json"
    if not cfg_file.is_file():
        return False, [], f"target {target} has no config.json; key/shape check skipped"
    try:
        import torch

        from longspec.model.weights import DraftLoadError, check_draft_state
        from longspec.model.glide import DraftConfig, GlideDraft
    except ImportError as e:
        return False, [], f"key/shape check skipped ({e})"
    try:
        hf = SimpleNamespace(**json.loads(cfg_file.read_text(encoding="utf-8")))
        cfg = DraftConfig.from_target_config(hf)
        with torch.device("meta"):
            module = GlideDraft(cfg)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        return False, [], f"key/shape check skipped: cannot build a draft for {target} ({e})"
    try:
        check_draft_state(state, module)
    except DraftLoadError as e:
        return True, [str(e)], None
    return True, [], None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m longspec.draftcheck")
    ap.add_argument("draft", type=Path)
    ap.add_argument("--target", type=Path, default=None)
    args = ap.parse_args(argv)
    report = {"draft": str(args.draft), "loadable": False, "tensors": 0, "parameters": 0,
              "target_checked": False, "problems": [], "error": None, "note": None}
    state, error = _load(args.draft)
    if state is None:
        report["error"] = error
        print(json.dumps(report))
        return 3
    report.update(loadable=True, tensors=len(state), parameters=int(sum(t.numel() for t in state.values())))
    if args.target is not None:
        checked, problems, note = _target_problems(state, args.target)
        report.update(target_checked=checked, problems=problems, note=note)
    print(json.dumps(report))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
