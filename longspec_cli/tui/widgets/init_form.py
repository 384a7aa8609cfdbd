"""The init wizard's form: one field per InitAnswers field, with a check line under the paths."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Checkbox, Input, Label, Select, Static

from longspec.project import presets as P
from longspec_cli.launch.scaffold import InitAnswers
from longspec_cli.tui.wizard_checks import Check

NO_PRESET = "-"
PRESET_DEFAULT = "-"


def _field(label: str, widget, note: str | None = None) -> list:
    out = [Label(label, classes="field-label", id=f"{widget.id}-label"), widget]
    if note is not None:
        out.append(Static(note, classes="field-check", id=f"{widget.id}-check"))
    return out


class InitForm(VerticalScroll):
    """Fields are pre-filled from `defaults`; answers() reads them back (None + reason if unusable)."""

    def __init__(self, defaults: InitAnswers | None = None, **kw):
        super().__init__(**kw)
        self.defaults = defaults

    def compose(self) -> ComposeResult:
        d = self.defaults
        presets = [(f"{n}  ({P.get_preset(n).target})", n) for n in P.preset_names()]
        yield from _field("Project folder", Input(str(d.project_dir) if d else "", placeholder="e.g. ./my-proj",
                                                  id="project_dir"))
        yield from _field("Preset", Select([*presets, ("none: give a target path below", NO_PRESET)],
                                           value=(d.preset if d and d.preset else NO_PRESET) if d else "qwq-32b-preview",
                                           allow_blank=False, id="preset"))
        yield from _field("Target model folder (overrides the preset's)",
                          Input((d.target or "") if d else "", placeholder="/models/QwQ-32B-Preview", id="target"), "")
        yield from _field("Variant", Select([("sinkpi-slicing: LongSpec's three-stage family", "sinkpi-slicing"),
                                             ("standard: LongSpec's standard family", "standard")],
                                            value=d.variant if d else "sinkpi-slicing", allow_blank=False, id="variant"))
        yield Label("Stages", classes="field-label")
        chosen = set(d.stages) if d else set(P.STAGE_ORDER)
        with Horizontal(id="stages"):
            for s in P.STAGE_ORDER:
                yield Checkbox(s, value=s in chosen, id=f"stage-{s}")
        for s in P.STAGE_ORDER:
            hint = P.stage_defaults(s)["data_hint"]
            yield from _field(f"Data for {s}: {hint}",
                              Input((d.data.get(s, "") if d else ""), placeholder="/data/train.jsonl", id=f"data-{s}"), "")
        yield from _field("Output root for the run folders (default: DIR/runs)",
                          Input((d.output_root or "") if d else "", id="output_root"))
        with Horizontal(id="sizes"):
            yield from _field("GPUs per node", Input(str(d.gpus) if d and d.gpus else "", type="integer",
                                                     placeholder="preset", id="gpus"))
            yield from _field("Nodes", Input(str(d.nodes) if d else "1", type="integer", id="nodes"))
        yield from _field("Hostfile (several nodes)", Input((d.hostfile or "") if d else "", id="hostfile"), "")
        yield from _field("Precision", Select([("the preset's", PRESET_DEFAULT), ("bf16", "bf16"), ("fp16", "fp16"),
                                               ("fp32", "fp32")],
                                              value=(d.precision or PRESET_DEFAULT) if d else PRESET_DEFAULT,
                                              allow_blank=False, id="precision"))

    def _text(self, wid: str) -> str:
        return self.query_one(f"#{wid}", Input).value.strip()

    def stages(self) -> tuple[str, ...]:
        return tuple(s for s in P.STAGE_ORDER if self.query_one(f"#stage-{s}", Checkbox).value)

    def data_fields(self) -> dict[str, str]:
        """Stage -> the data path as typed, for the selected stages."""
        return {s: self._text(f"data-{s}") for s in self.stages()}

    def answers(self) -> tuple[InitAnswers | None, str | None]:
        """The answers as `longspec init` flags would give them, or (None, why not)."""
        folder = self._text("project_dir")
        if not folder:
            return None, "the project folder is not set"
        stages = self.stages()
        if not stages:
            return None, "choose at least one stage"
        try:
            gpus = int(self._text("gpus")) if self._text("gpus") else None
            nodes = int(self._text("nodes") or "1")
        except ValueError:
            return None, "GPUs and nodes must be whole numbers"
        preset = self.query_one("#preset", Select).value
        precision = self.query_one("#precision", Select).value
        data = {s: str(Path(p).expanduser().resolve()) for s, p in self.data_fields().items() if p}
        return InitAnswers(
            project_dir=Path(folder).expanduser(),
            preset=None if preset == NO_PRESET else str(preset),
            target=self._text("target") or None,
            variant=str(self.query_one("#variant", Select).value),
            data=data,
            stages=stages,
            output_root=self._text("output_root") or None,
            gpus=gpus,
            nodes=nodes,
            hostfile=self._text("hostfile") or None,
            precision=None if precision == PRESET_DEFAULT else str(precision),
            name=self.defaults.name if self.defaults else None,  # no field: `init` has no --name flag
        ), None

    def show_check(self, wid: str, check: Check | None) -> None:
        note = self.query_one(f"#{wid}-check", Static)
        if check is None:
            note.update("")
            return
        style = "green" if check.ok else ("yellow" if check.severity == "warning" else "bold red")
        mark = "✔ " if check.ok else ("▲ " if check.severity == "warning" else "✖ ")
        note.update(Text(mark + check.message, style))

    def sync_visibility(self) -> None:
        """Data fields only for chosen stages; the hostfile only for several nodes."""
        chosen = set(self.stages())
        try:
            several = int(self._text("nodes") or "1") > 1
        except ValueError:
            several = False
        shown = {f"data-{s}": s in chosen for s in P.STAGE_ORDER} | {"hostfile": several}
        for wid, visible in shown.items():
            for part in ("", "-label", "-check"):
                self.query_one(f"#{wid}{part}").display = visible
