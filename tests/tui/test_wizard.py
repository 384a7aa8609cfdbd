"""The init wizard: live checks, nothing written before confirm, Esc / Ctrl-C write nothing, and
confirmed answers write the very tree that `longspec init` flags write."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from textual.widgets import Checkbox, Input, Select
from typer.testing import CliRunner

from longspec_cli.app import app as cli
from longspec_cli.launch.scaffold import plan_project, write_project
from longspec.project.targets import refusal
from longspec_cli.tui import wizard_checks as W
from longspec_cli.tui.widgets.confirm import ConfirmScreen
from longspec_cli.tui.wizard_app import WizardApp
from tests.tui.pilot_helpers import screen_text, wait_until

SIZE = (130, 50)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _data(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "base": (folder / "slim.jsonl", [{"text": "short text"}, {"text": "more"}]),
        "long": (folder / "long.jsonl", [{"source": "book", "article": "a long document"}]),
        "longcot": (folder / "cot.json", None),
    }
    for stage, (path, rows) in files.items():
        if rows is not None:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    files["longcot"][0].write_text(json.dumps([{"problem": "1+1?", "qwq": "2"}, {"prompt": "p", "response": "r"}]))
    return {s: p for s, (p, _) in files.items()}


async def _fill(pilot, app, values: dict[str, str]) -> None:
    for wid, value in values.items():
        app.query_one(f"#{wid}", Input).value = value
    await pilot.pause(0.05)


async def _plan(pilot, app) -> None:
    await pilot.pause(0.4)  # past the debounce
    await wait_until(pilot, app.plan_shown.is_set, 15, "the plan")


async def test_confirm_writes_the_same_tree_as_the_flag_path(tmp_path):
    data = _data(tmp_path / "data")
    (tmp_path / "hosts").write_text("node-a slots=4\nnode-b slots=4\n")
    proj = tmp_path / "proj"
    app = WizardApp()
    async with app.run_test(size=SIZE) as pilot:
        await _fill(pilot, app, {"project_dir": str(proj), "data-base": str(data["base"]),
                                 "data-long": str(data["long"]), "data-longcot": str(data["longcot"]),
                                 "output_root": str(tmp_path / "runs-out"), "gpus": "4", "nodes": "2",
                                 "hostfile": str(tmp_path / "hosts")})
        app.query_one("#variant", Select).value = "standard"
        app.query_one("#precision", Select).value = "fp16"
        await _plan(pilot, app)
        text = screen_text(app)
        assert "2 records checked: text" in text and "longspec.yaml" in text
        assert not proj.exists()  # the preview and the checks wrote nothing
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
    answers = app.return_value
    assert answers is not None and not proj.exists()  # the wizard itself never writes
    write_project(plan_project(answers))  # what `longspec init` does with the answers
    from_wizard = _tree(proj)
    shutil.rmtree(proj)

    result = CliRunner().invoke(cli, [
        "init", str(proj), "--preset", "qwq-32b-preview", "--variant", "standard",
        "--data", f"base={data['base']}", "--data", f"long={data['long']}", "--data", f"longcot={data['longcot']}",
        "--output-root", str(tmp_path / "runs-out"), "--gpus", "4", "--nodes", "2",
        "--hostfile", str(tmp_path / "hosts"), "--precision", "fp16", "--no-input"])
    assert result.exit_code == 0, result.output
    from_flags = _tree(proj)
    assert sorted(from_wizard) == sorted(from_flags) and len(from_flags) >= 5
    assert from_wizard == from_flags


async def test_fewer_stages_and_target_path(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                    "max_position_embeddings": 262144}))
    proj = tmp_path / "p2"
    app = WizardApp()
    async with app.run_test(size=SIZE) as pilot:
        app.query_one("#preset", Select).value = "-"
        app.query_one("#stage-longcot", Checkbox).value = False
        await _fill(pilot, app, {"project_dir": str(proj), "target": str(target)})
        await _plan(pilot, app)
        text = screen_text(app)
        assert "llama family (llama, 262144 positions)" in text
        assert not app.query_one("#data-longcot", Input).display
        await pilot.press("ctrl+s", "y")
    answers = app.return_value
    assert answers.stages == ("base", "long") and answers.preset is None and answers.target == str(target)
    write_project(plan_project(answers))
    wizard = _tree(proj)
    shutil.rmtree(proj)
    result = CliRunner().invoke(cli, ["init", str(proj), "--target", str(target), "--stages", "base,long",
                                      "--no-input"])
    assert result.exit_code == 0, result.output
    assert wizard == _tree(proj)


async def test_bad_data_file_is_flagged_live(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "no text field"}) + "\n")
    app = WizardApp()
    async with app.run_test(size=SIZE) as pilot:
        await _fill(pilot, app, {"project_dir": str(tmp_path / "p"), "data-base": str(bad)})
        await _plan(pilot, app)
        assert "record 1 has none of text | target (it has: question)" in screen_text(app)
    assert not (tmp_path / "p").exists()


async def test_escape_writes_nothing(tmp_path):
    app = WizardApp()
    async with app.run_test(size=SIZE) as pilot:
        await _fill(pilot, app, {"project_dir": str(tmp_path / "p")})
        await _plan(pilot, app)
        await pilot.press("escape")
    assert app.return_value is None and not (tmp_path / "p").exists()


async def test_ctrl_c_writes_nothing_even_from_the_dialog(tmp_path):
    app = WizardApp()
    async with app.run_test(size=SIZE) as pilot:
        await _fill(pilot, app, {"project_dir": str(tmp_path / "p")})
        await _plan(pilot, app)
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("ctrl+c")
    assert app.return_value is None and not (tmp_path / "p").exists()


async def test_confirm_without_a_folder_is_refused(tmp_path):
    app = WizardApp()
    async with app.run_test(size=SIZE) as pilot:
        await _plan(pilot, app)
        await pilot.press("ctrl+s")
        assert not isinstance(app.screen, ConfirmScreen) and app.is_running
        assert any("cannot write yet: the project folder is not set" in n.message for n in app._notifications)


def test_data_checks(tmp_path):
    good = tmp_path / "g.jsonl"
    good.write_text('{"prompt": "p", "response": "r"}\n{"problem": "q", "qwq": "a"}\n')
    assert W.check_data(str(good), "long_cot").ok
    assert not W.check_data(str(good), "short_text").ok
    half = tmp_path / "h.jsonl"
    half.write_text('{"problem": "q"}\n')
    c = W.check_data(str(half), "long_cot")
    assert not c.ok and "problem+qwq | prompt+response" in c.message
    listed = tmp_path / "l.json"
    listed.write_text(json.dumps([{"messages": [{"role": "user", "content": "hi"}]}] * 3))
    assert W.check_data(str(listed), "long_data").ok
    assert "does not exist" in W.check_data(str(tmp_path / "none.jsonl"), "short_text").message
    assert "folder" in W.check_data(str(tmp_path), "short_text").message
    junk = tmp_path / "j.jsonl"
    junk.write_text("not json at all\n")
    assert "not JSON" in W.check_data(str(junk), "short_text").message
    empty = W.check_data("", "short_text")
    assert not empty.ok and empty.severity == "warning"


def test_first_records_of_a_big_json_list_read_little(tmp_path, monkeypatch):
    big = tmp_path / "big.json"
    big.write_text("[" + ",".join(json.dumps({"text": f"{i}" + "x" * 100}) for i in range(50_000)) + "]")
    read: list[int] = []

    class Spy:  # the file as opened, every read counted
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n=-1):
            data = self.f.read(n)
            read.append(len(data))
            return data

    real_open = open
    monkeypatch.setattr(W, "open", lambda *a, **k: Spy(real_open(*a, **k)), raising=False)
    recs = W.read_first_records(big, n=5)
    assert recs == [{"text": f"{i}" + "x" * 100} for i in range(5)]
    assert 0 < sum(read) <= W.SAMPLE_BYTES < big.stat().st_size // 4   # one megabyte, not the 5 MB file


def test_detect_family(tmp_path):
    q = tmp_path / "q"
    q.mkdir()
    (q / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert W.detect_family(q).ok and "qwen2" in W.detect_family(q).message
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    assert W.detect_family(odd).message.startswith("mistral family")
    unknown = tmp_path / "u"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert not W.detect_family(unknown).ok
    assert W.detect_family(unknown).message == refusal("gpt2", None)      # the sentence init and the trainer use
    (q / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 40960}))
    assert W.detect_family(q).message == "qwen3 family (qwen3, 40960 positions)"
    assert not W.detect_family(tmp_path / "missing").ok
    assert W.detect_family("Qwen/QwQ-32B-Preview").severity == "warning"
