"""Per-GPU utilisation and memory (NVML), else CPU and RAM (psutil), of the monitoring host."""

from __future__ import annotations

from rich.text import Text

from longspec_cli.tui.sysinfo import SysSample, fmt_used
from longspec_cli.tui.widgets.text_panel import TextPanel


def _bar(fraction: float | None, width: int = 10) -> str:
    if fraction is None:
        return " " * width
    n = max(0, min(width, round(fraction * width)))
    return "█" * n + "░" * (width - n)


class SystemPanel(TextPanel):
    def show(self, s: SysSample) -> None:
        self.set_text(render_system(s))


def render_system(s: SysSample) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f"host {s.host}\n", "bold")
    for g in s.gpus:
        mem = g.mem_used / g.mem_total if g.mem_total else None
        util = "-" if g.util_percent is None else f"{g.util_percent:3.0f}%"
        t.append(f"GPU{g.index} {util} {_bar((g.util_percent or 0) / 100, 6)}\n")
        t.append(f"     mem {_bar(mem, 6)} {fmt_used(g.mem_used, g.mem_total)}\n")
    if s.cpu_percent is not None:
        t.append(f"CPU  {s.cpu_percent:5.0f}% {_bar(s.cpu_percent / 100)}\n")
    if s.ram_total:
        t.append(f"RAM  {(s.ram_used or 0) / s.ram_total * 100:5.0f}% {_bar((s.ram_used or 0) / s.ram_total)}\n")
        t.append(f"     {fmt_used(s.ram_used, s.ram_total)}\n")
    if s.note:
        t.append(s.note, "dim")
    return t
