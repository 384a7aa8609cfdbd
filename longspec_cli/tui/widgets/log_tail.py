"""The last lines of the viewed stage's train.log, appended incrementally."""

from __future__ import annotations

from textual.widgets import Log

from longspec_cli.tui.views import StageView


class LogTail(Log):
    def __init__(self, **kw):
        super().__init__(max_lines=1000, auto_scroll=True, **kw)
        self._shown: tuple[str, int, int] | None = None  # (stage, log_gen, log_seq) on screen

    def show(self, st: StageView) -> None:
        shown = self._shown
        if shown is not None and shown[:2] == (st.name, st.log_gen):
            new = st.log_seq - shown[2]
            if new == 0:
                return
            if 0 < new <= len(st.log):  # the same file, grown: append what is new
                self.write_lines(st.log[-new:])
                self._shown = (st.name, st.log_gen, st.log_seq)
                return
        self.clear()
        if st.log:
            self.write_lines(st.log)
        else:
            self.write_line(f"({st.name}: no train.log yet)")
        self._shown = (st.name, st.log_gen, st.log_seq)
