"""`python -m longspec.serve.probe [--json]`: is vLLM installed in this Python, which version, does the
plugin's entry point stand there, and is the version one the plugin supports. Package metadata
only (importing vLLM takes seconds); run by `longspec doctor` and `longspec serve` with the
environment's own Python.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata

from longspec.formats.vllmdraft import DISTRIBUTIONS, PLUGIN_GROUP, PLUGIN_NAME, SUPPORTED_VLLM, unsupported_vllm


def probe() -> dict:
    version = dist = None
    for name in DISTRIBUTIONS:
        try:
            version, dist = metadata.version(name), name
            break
        except metadata.PackageNotFoundError:
            continue
    plugin = [ep.value for ep in metadata.entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    return {"python": sys.executable, "vllm": version, "distribution": dist, "plugin": plugin[0] if plugin else None,
            "supported": list(SUPPORTED_VLLM), "problem": unsupported_vllm(version) if version else "vLLM is not installed"}


def main(argv: list[str] | None = None) -> int:
    res = probe()
    if "--json" in (sys.argv[1:] if argv is None else argv):
        print(json.dumps(res))
    else:
        print(f"vLLM {res['vllm'] or 'not installed'}; plugin {res['plugin'] or 'not installed'}"
              + (f"; {res['problem']}" if res["problem"] else ""))
    return 0 if res["vllm"] and res["plugin"] and not res["problem"] else 1


if __name__ == "__main__":
    sys.exit(main())
