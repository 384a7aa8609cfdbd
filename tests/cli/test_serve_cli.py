"""`longspec serve`'s pieces that need no vLLM: the command line, the supported versions, where the
vLLM environment is found and what a probe says of a Python without it (tests/serve run the real one)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from longspec.formats.vllmdraft import SUPPORTED_VLLM, unsupported_vllm, vllm_config
from longspec.machine import vllmenv
from longspec_cli.launch import vllmcmd


def test_the_command_names_the_draft_gamma_and_the_flags_glide_needs():
    argv = vllmcmd.serve_argv("/env/bin/python", "/m/target", "/runs/base/export/base-vllm", gamma=5,
                              host="0.0.0.0", port=8001, extra=["--max-model-len", "4096"])
    assert argv[:5] == ["/env/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/target"]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "draft_model", "model": "/runs/base/export/base-vllm", "num_speculative_tokens": 5}
    assert "--disable-hybrid-kv-cache-manager" in argv and "--enforce-eager" in argv
    assert argv[-2:] == ["--max-model-len", "4096"]
    assert vllmcmd.api_url("0.0.0.0", 8001) == "http://127.0.0.1:8001/v1"


def test_only_the_tried_vllm_versions_pass():
    assert unsupported_vllm(SUPPORTED_VLLM[0]) is None
    assert unsupported_vllm(SUPPORTED_VLLM[0] + "+cpu") is None
    msg = unsupported_vllm("0.33.0")
    assert msg.startswith(f"longspec's GLIDE plugin runs on vLLM {SUPPORTED_VLLM[0]}; this is vLLM 0.33.0.")


def test_the_vllm_config_clears_the_family_window_and_names_the_architecture():
    cfg = vllm_config({"architectures": ["Qwen2GlideDecoderLayer"], "sliding_window": 512,
                       "use_sliding_window": False, "longspec": {"draft_config": {"sliding_window": 512}}}, 28)
    assert cfg["architectures"] == ["LongSpecGlideForCausalLM"] and cfg["sliding_window"] is None
    assert cfg["target_num_hidden_layers"] == 28 and cfg["longspec"]["draft_config"]["sliding_window"] == 512


def test_the_vllm_python_comes_from_the_flag_then_the_variable_then_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "env" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("vllm", "python"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(vllmenv.ENV, raising=False)
    assert vllmenv.find_python() == (bin_dir / "python", "beside `vllm` on PATH")
    monkeypatch.setenv(vllmenv.ENV, "/opt/vllm/bin/python")
    assert vllmenv.find_python() == (Path("/opt/vllm/bin/python"), "$LONGSPEC_VLLM_PYTHON")
    assert vllmenv.find_python("/x/python") == (Path("/x/python"), "--vllm-python")


def test_a_python_without_vllm_is_reported_not_used(tmp_path):
    found = vllmenv.probe(Path(sys.executable))       # this environment: longspec without vLLM
    assert found["vllm"] is None and found["problem"] == "vLLM is not installed"
    assert vllmenv.probe(tmp_path / "none")["problem"].endswith("does not exist")


def test_serve_and_its_pieces_import_neither_torch_nor_vllm():
    import subprocess

    code = ("import sys, longspec_cli.commands.serve, longspec_cli.launch.vllmcmd, longspec.machine.vllmenv, "
            "longspec.formats.vllmdraft, longspec.serve.probe; "
            "bad = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
