"""The system panel's data on this host (no GPU here: the psutil fallback)."""

from __future__ import annotations

import importlib.util

import pytest

from longspec_cli.tui.sysinfo import Sampler, fmt_used
from longspec_cli.tui.widgets.system_panel import render_system


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="NVML importable: GPU path")
def test_without_nvml_cpu_and_ram_from_psutil():
    s = Sampler()
    a = s.sample()
    assert a.source == "psutil" and a.gpus == ()
    assert 0 <= a.cpu_percent <= 100 and 0 < a.ram_used <= a.ram_total
    assert "nvidia-ml-py is not installed" in a.note
    text = render_system(a).plain
    assert "CPU" in text and "RAM" in text and "GiB" in text
    s.close()


def test_fmt_used_uses_the_unit_of_the_total():
    assert fmt_used(8 << 30, 32 << 30) == "8.0/32.0 GiB"
    assert fmt_used(512 << 20, 2 << 30) == "0.5/2.0 GiB"
    assert fmt_used(None, 10) == "-"
