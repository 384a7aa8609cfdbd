"""The `longspec init` form: run_wizard(defaults) -> InitAnswers | None.

The form checks as you type (the target's family from its config.json, each stage's data file
against its collator, project.validate on the files that would be written) and previews every
file. Nothing is written here: confirming returns the answers, and `init` writes them with the
same code as the flag path (launch.scaffold), so the same answers give the same files.
Esc or Ctrl-C returns None.
"""

from __future__ import annotations

import threading
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Button, Checkbox, Footer, Header, Input, Select

from longspec.project import presets as P
from longspec_cli.launch.scaffold import InitAnswers
from longspec_cli.tui.widgets.confirm import ConfirmScreen
from longspec_cli.tui.widgets.init_form import InitForm
from longspec_cli.tui.widgets.plan_view import PlanView
from longspec_cli.tui.wizard_checks import Check, Plan, check_data, detect_family, plan_and_validate

DEBOUNCE_S = 0.3


class PlanReady(Message):
    def __init__(self, seq: int, answers: InitAnswers | None, plan: Plan, checks: dict[str, Check | None],
                 notes: list[tuple[str, str]]) -> None:
        super().__init__()
        self.seq, self.answers, self.plan, self.checks, self.notes = seq, answers, plan, checks, notes


class WizardApp(App[InitAnswers | None]):
    CSS_PATH = ["wizard.tcss", "dialog.tcss"]
    TITLE = "longspec init"
    BINDINGS = [
        Binding("escape", "cancel", "cancel (writes nothing)"),
        Binding("ctrl+c", "cancel", "cancel", show=False, priority=True),
        Binding("ctrl+s", "confirm", "write project"),
    ]

    def __init__(self, defaults: InitAnswers | None = None):
        super().__init__()
        self.defaults = defaults
        self.plan: Plan | None = None
        self.answers: InitAnswers | None = None
        self.plan_shown = threading.Event()
        self._timer = None
        self._seq = 0  # a plan computed for older answers (a slower worker) is dropped

    def compose(self) -> ComposeResult:
        yield Header(icon="≡")
        with Horizontal(id="body"):
            yield InitForm(self.defaults, id="form")
            yield PlanView(id="plan")
        with Horizontal(id="buttons"):
            yield Button("Write project (ctrl+s)", variant="primary", id="write")
            yield Button("Cancel (esc)", id="cancel")
        yield Footer()

    def on_mount(self) -> None:
        self.form = self.query_one(InitForm)
        self.plan_view = self.query_one(PlanView)
        self.form.sync_visibility()
        self.query_one("#project_dir", Input).focus()
        self._schedule()

    # -- live checks -----------------------------------------------------------------------

    @on(Input.Changed)
    @on(Select.Changed, "InitForm Select")
    @on(Checkbox.Changed)
    def _changed(self) -> None:
        self.form.sync_visibility()
        self._schedule()

    def _schedule(self) -> None:
        self.plan_shown.clear()
        if self._timer is not None:
            self._timer.stop()
        self._timer = self.set_timer(DEBOUNCE_S, self._refresh_plan)

    def _refresh_plan(self) -> None:
        answers, why = self.form.answers()
        target = self.form.query_one("#target", Input).value.strip()
        self._seq += 1
        self.compute(self._seq, answers, why, target, self.form.data_fields())

    @work(thread=True, exclusive=True, group="plan")
    def compute(self, seq: int, answers: InitAnswers | None, why: str | None, target: str,
                data: dict[str, str]) -> None:
        checks: dict[str, Check | None] = {"target": detect_family(target) if target else None}
        notes: list[tuple[str, str]] = []
        for stage in P.STAGE_ORDER:
            if stage in data:
                collator = P.stage_defaults(stage)["collator"]
                checks[f"data-{stage}"] = c = check_data(data[stage], collator)
                if not c.ok:
                    notes.append((c.severity, f"data for {stage}: {c.message}"))
        if answers is not None and answers.hostfile:
            hf = Path(answers.hostfile).expanduser()
            checks["hostfile"] = Check(hf.is_file(), "found" if hf.is_file() else f"{hf} does not exist")
        else:
            checks["hostfile"] = None
        if answers is None:
            plan = Plan({}, error=why)
        else:
            plan = plan_and_validate(answers)
            existing = [p for p in plan.files if p.exists()]
            if existing:
                notes.append(("error", f"{len(existing)} of these files already exist; init refuses to "
                                       "overwrite them (use `longspec init --force` to do so)"))
        self.post_message(PlanReady(seq, answers, plan, checks, notes))

    def on_plan_ready(self, msg: PlanReady) -> None:
        if msg.seq != self._seq:
            return
        self.answers, self.plan = msg.answers, msg.plan
        for wid, check in msg.checks.items():
            self.form.show_check(wid, check)
        root = Path(msg.answers.project_dir).resolve() if msg.answers else Path.cwd()
        self.plan_view.show(msg.plan, root, msg.notes)
        self.plan_shown.set()

    # -- confirm / cancel ------------------------------------------------------------------

    @on(Button.Pressed, "#write")
    def action_confirm(self) -> None:
        answers, why = self.form.answers()
        if answers is None:
            self.notify(f"cannot write yet: {why}", severity="error")
            return
        plan = self.plan if self.plan is not None and self.answers == answers else plan_and_validate(answers)
        if plan.error:
            self.notify(f"cannot write: {plan.error}", severity="error")
            return
        root = Path(answers.project_dir).resolve()
        errors = sum(p.severity == "error" for p in plan.problems)
        lines = [str(p.relative_to(root)) if p.is_relative_to(root) else str(p) for p in plan.files]
        body = "\n".join(lines)
        if errors:
            body += f"\n\n{errors} validation error(s) remain: `longspec validate` will list them."

        def done(ok: bool | None) -> None:
            if ok:
                self.exit(answers)

        self.push_screen(ConfirmScreen(f"Write {len(plan.files)} files to {root}?", body, yes="Write"), done)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.exit(None)


def run_wizard(defaults: InitAnswers | None = None) -> InitAnswers | None:
    """Show the form; the answers on confirm, None on Esc / Ctrl-C. Writes nothing itself."""
    try:
        return WizardApp(defaults).run()
    except KeyboardInterrupt:
        return None
