"""Strict CPU stand-ins for the two GPU libraries longspec calls (flash-attn, liger-kernel), and
``install``: what the ``fused_standins`` fixture (tests/trainer/conftest.py) does.

``install`` puts the stand-ins in ``sys.modules`` under the libraries' own names and counts CPU
tensors as fused-capable in ``longspec.model.kernels.fused_device`` -- the one device predicate of the
dispatch -- so the project's own dispatch takes its CUDA path on a CPU. Nothing in ``longspec``
knows about the stand-ins; users' runs never see them.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

LONGSPEC = Path(__file__).resolve().parents[2] / "longspec"


def record_caller(callers: list) -> None:
    """Append the longspec frames that led to this call, innermost first, as a tuple of
    (file under longspec/ as a relative path, function); ``callers[i][0]`` is the call site itself."""
    chain = []
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if LONGSPEC in path.parents:
            chain.append((path.relative_to(LONGSPEC).as_posix(), frame.f_code.co_name))
        frame = frame.f_back
    callers.append(tuple(chain) or (("<outside longspec>", ""),))


def sites(callers: list) -> set:
    """The call sites (innermost longspec function) the stand-in was reached from."""
    return {chain[0] for chain in callers}


def reached_from(callers: list, file: str) -> bool:
    """Whether some call came through a function of longspec/``file``."""
    return any(f == file for chain in callers for f, _ in chain)


def install(monkeypatch) -> types.SimpleNamespace:
    """Stand-ins in place for the test's duration; returns their modules (``.flash``, ``.liger``)."""
    import importlib.machinery

    from longspec.model import kernels
    from tests.standins import flash_attn_standin as flash
    from tests.standins import liger_standin as liger

    flash_pkg = types.ModuleType("flash_attn")
    flash_pkg.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    flash_pkg.flash_attn_func = flash.flash_attn_func
    flash_pkg.__version__ = flash.__version__
    liger_pkg = types.ModuleType("liger_kernel")
    liger_pkg.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None, is_package=True)
    liger_pkg.__path__ = []
    liger_tf = types.ModuleType("liger_kernel.transformers")
    liger_tf.__spec__ = importlib.machinery.ModuleSpec("liger_kernel.transformers", None)
    liger_tf.LigerFusedLinearCrossEntropyLoss = liger.LigerFusedLinearCrossEntropyLoss
    liger_pkg.transformers = liger_tf
    for name, mod in (("flash_attn", flash_pkg), ("liger_kernel", liger_pkg), ("liger_kernel.transformers", liger_tf)):
        monkeypatch.setitem(sys.modules, name, mod)
    real = kernels.fused_device
    monkeypatch.setattr(kernels, "fused_device", lambda device: real(device) or str(device).startswith("cpu"))
    kernels._flash_attn_func.cache_clear()
    kernels._liger_loss_cls.cache_clear()
    flash.CALLERS.clear()
    liger.CALLERS.clear()
    return types.SimpleNamespace(flash=flash, liger=liger)


def uninstall() -> None:
    """Forget the stand-ins the dispatch cached (monkeypatch restores sys.modules and the predicate)."""
    from longspec.model import kernels

    kernels._flash_attn_func.cache_clear()
    kernels._liger_loss_cls.cache_clear()
