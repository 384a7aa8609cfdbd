"""`longspec run` / `stop`: process group, run.json, train.log, Ctrl-C, stop, resume, failures.

Fast tests drive process.run_stage_process (the code path `longspec run` uses) with a small
stand-in trainer; slow ones launch through the real DeepSpeed launcher, first with the stand-in
(every launcher process must be gone after Ctrl-C), then with the real trainer on the tiny preset:
Ctrl-C + resume through the CLI, a crashing stage stopping --all, and a two-"node" loopback run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from longspec.machine import liveness
from longspec.runs import runfolder
from longspec.errors import RefusedError
from longspec_cli.launch import argv as A
from longspec_cli.launch import group as G
from longspec_cli.launch import process as P
from longspec.machine.opsdir import ops_build_dir

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
LONGSPEC = [PY, "-m", "longspec_cli"]

# A stand-in trainer: the trainer's argv shape (Hydra-style key=value) and run-folder files, a
# helper child process (like a data-loader worker) that must not outlive the run, resume from the
# newest complete checkpoint, and switches to crash or to ignore SIGINT/SIGTERM.
FAKE_TRAINER = textwrap.dedent('''
    import hashlib, json, os, signal, subprocess, sys, time
    from pathlib import Path

    args = sys.argv[1:]
    opts = dict(a.split("=", 1) for a in args if "=" in a)
    out = Path(opts["output_dir"])
    total, delay = int(opts.get("max_steps", 5)), float(opts.get("step_s", 0.2))
    crash_at, stubborn = int(opts.get("crash_at", 0)), opts.get("stubborn") == "1"
    rank = int(os.environ.get("RANK", "0"))
    if stubborn:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out.mkdir(parents=True, exist_ok=True)
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (out / f"helper-{rank}.pid").write_text(str(helper.pid))

    def record(obj):
        if rank == 0:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(obj) + "\\n")

    done = [int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "checkpoint.json").exists()]
    start = max(done, default=0)
    record({"event": "resume" if start else "start", "step": start, "total_steps": total, "time": time.time()})
    print(f"fake trainer rank {rank}: {'resuming at' if start else 'starting'} step {start}", flush=True)
    for step in range(start + 1, total + 1):
        time.sleep(delay)
        if step == crash_at:
            print("fake trainer: boom (a data file vanished)", flush=True)
            sys.exit(3)
        record({"step": step, "total_steps": total, "loss": 5.0 / step, "llm_loss": 1.0, "lr": 1e-3,
                "tokens_per_s": 1000.0, "elapsed_s": 0.0, "time": time.time()})
        print(f"[fake] step {step}/{total} loss {5.0 / step:.4f}", flush=True)
        if rank == 0:
            (out / f"checkpoint-{step}").mkdir(exist_ok=True)
            (out / f"checkpoint-{step}" / "checkpoint.json").write_text("{}")
    if rank == 0:
        (out / "draft_model_weights.pth").write_bytes(b"weights")
        sha = hashlib.sha256(b"weights").hexdigest()
        (out / "stage_complete.json").write_text(json.dumps({"stage": "base", "steps": total,
                                                             "final_loss": 5.0 / total, "sha256": sha}))
    helper.kill()
''')

DRIVER = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    from longspec_cli.launch import process
    from longspec_cli.launch.argv import LaunchCommand

    spec = json.loads(sys.argv[1])
    cmd = LaunchCommand(argv=spec["argv"], env=spec.get("env", {}))
    r = process.run_stage_process(cmd, Path(spec["out"]), "base", spec.get("overrides", []),
                                  grace_int=spec.get("grace", 5.0), grace_term=spec.get("grace", 5.0))
    print("RESULT", json.dumps({"rc": r.returncode, "interrupted": r.interrupted, "stopped": r.stopped}))
    sys.exit(130 if (r.interrupted or r.stopped) else r.returncode)
''')


@pytest.fixture()
def fake(tmp_path):
    (tmp_path / "fake_trainer.py").write_text(FAKE_TRAINER)
    (tmp_path / "driver.py").write_text(DRIVER)
    return tmp_path


def env_with(path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def fake_argv(fake: Path, out: Path, *extra: str) -> list[str]:
    return [PY, "-u", str(fake / "fake_trainer.py"), f"output_dir={out}", *extra]


def start_driver(fake: Path, argv: list[str], out: Path, grace: float = 5.0, env=None) -> subprocess.Popen:
    spec = {"argv": argv, "out": str(out), "grace": grace, "overrides": ["max_steps=40"], "env": env or {}}
    return subprocess.Popen([PY, str(fake / "driver.py"), json.dumps(spec)], env=env_with(fake),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def last_step(out: Path) -> int:
    rec = runfolder.RunDir(out).last_step_record()
    return rec["step"] if rec else 0


def alive(pid: int) -> bool:
    return liveness.proc_start_time(pid) is not None


# ------------------------------------------------------------------------------------ fast tier

def test_run_json_train_log_and_exit_code(fake, tmp_path):
    out = tmp_path / "runs" / "base"
    cmd = A.LaunchCommand(argv=fake_argv(fake, out, "max_steps=3", "step_s=0.05"))
    import io

    stream = io.StringIO()
    r = P.run_stage_process(cmd, out, "base", ["max_steps=3"], stream=stream)
    assert r.returncode == 0 and not r.interrupted
    info = json.loads((out / "run.json").read_text())
    for key in ("pid", "pgid", "host", "argv", "started_at", "proc_start", "overrides"):
        assert key in info, key
    assert info["pgid"] == info["pid"] and info["host"] == socket.gethostname()
    assert info["argv"] == cmd.argv and info["overrides"] == ["max_steps=3"] and info["returncode"] == 0
    assert isinstance(info["proc_start"], int)
    log = (out / "train.log").read_text()
    assert "[fake] step 3/3" in log and "===== longspec run base" in log
    assert "[fake] step 3/3" in stream.getvalue()  # echoed to the terminal too
    assert "[base] step 3/3 | loss 1.6667 | 1,000 tok/s" in stream.getvalue()  # the progress line


def test_progress_line_from_metrics_records():
    pr = P.Progress("long", since=100.0)
    pr.update({"event": "start", "step": 0, "total_steps": 10, "time": 100.0})
    pr.update({"step": 2, "total_steps": 10, "loss": 2.5, "tokens_per_s": 1234.0, "time": 110.0})
    pr.update({"step": 4, "total_steps": 10, "loss": 2.0, "tokens_per_s": 1500.0, "time": 120.0})
    assert pr.line() == "[long] step 4/10 | loss 2.0000 | 1,500 tok/s | ETA 0:00:30"
    assert P.Progress("base").line() == "[base] starting..."


def test_crashing_child_gives_its_exit_code_and_log_tail(fake, tmp_path):
    out = tmp_path / "out"
    cmd = A.LaunchCommand(argv=fake_argv(fake, out, "max_steps=5", "step_s=0.05", "crash_at=2"))
    r = P.run_stage_process(cmd, out, "base", [], quiet=True, stream=open(os.devnull, "w"))
    assert r.returncode == 3
    assert any("boom" in line for line in r.log_tail)
    assert not (out / "stage_complete.json").exists()


def test_sigint_stops_the_group_exits_130_and_the_next_run_resumes(fake, tmp_path):
    out = tmp_path / "out"
    drv = start_driver(fake, fake_argv(fake, out, "max_steps=40", "step_s=0.2"), out)
    wait_for(lambda: last_step(out) >= 3, 60, "three steps")
    info = json.loads((out / "run.json").read_text())
    helper = int((out / "helper-0.pid").read_text())
    assert alive(helper)
    drv.send_signal(signal.SIGINT)
    text, _ = drv.communicate(timeout=60)
    assert drv.returncode == 130, text
    assert "interrupt: stopping base" in text
    assert liveness.group_members(info["pgid"]) == [] and not alive(helper)
    stopped_at = last_step(out)

    drv = start_driver(fake, fake_argv(fake, out, "max_steps=8", "step_s=0.05"), out)
    text, _ = drv.communicate(timeout=60)
    assert drv.returncode == 0, text
    events = [r for r in runfolder.read_metrics(out / "metrics.jsonl").events]
    assert events[-1]["event"] == "resume" and events[-1]["step"] == stopped_at
    assert last_step(out) == 8 and (out / "stage_complete.json").is_file()


def test_a_child_that_ignores_sigint_and_sigterm_is_killed(fake, tmp_path):
    out = tmp_path / "out"
    drv = start_driver(fake, fake_argv(fake, out, "max_steps=400", "step_s=0.2", "stubborn=1"), out, grace=1.0)
    wait_for(lambda: last_step(out) >= 1, 60, "a step")
    pgid = json.loads((out / "run.json").read_text())["pgid"]
    t0 = time.monotonic()
    drv.send_signal(signal.SIGINT)
    text, _ = drv.communicate(timeout=60)
    assert drv.returncode == 130, text
    assert "SIGKILL" in text and time.monotonic() - t0 < 20
    assert liveness.group_members(pgid) == []


def write_project(tmp_path: Path, out: Path) -> Path:
    proj = tmp_path / "proj"
    (proj / "conf" / "exp").mkdir(parents=True)
    (proj / "conf" / "exp" / "base.yaml").write_text("# @package _global_\nstage: base\n")
    (proj / "longspec.yaml").write_text(textwrap.dedent(f"""\
        name: p
        stages:
          - {{name: base, config: conf/exp/base.yaml, output_dir: {out}, draft_from: null}}
        """))
    return proj


def test_longspec_stop_from_another_terminal(fake, tmp_path):
    out = tmp_path / "out"
    proj = write_project(tmp_path, out)
    drv = start_driver(fake, fake_argv(fake, out, "max_steps=400", "step_s=0.2"), out)
    wait_for(lambda: last_step(out) >= 2, 60, "two steps")
    pgid = json.loads((out / "run.json").read_text())["pgid"]
    stop = subprocess.run([*LONGSPEC, "stop", str(proj), "base", "--timeout", "5"], capture_output=True,
                          text=True, cwd=ROOT, env=env_with(fake), timeout=60)
    assert stop.returncode == 0, stop.stderr
    assert f"stopped base: process group {pgid}" in stop.stdout
    text, _ = drv.communicate(timeout=60)
    assert drv.returncode == 130 and '"stopped": true' in text
    assert liveness.group_members(pgid) == []
    again = subprocess.run([*LONGSPEC, "stop", str(proj)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert again.returncode == 1 and "nothing to stop" in again.stderr


def test_a_stale_run_json_is_never_signalled(tmp_path):
    out = tmp_path / "out"
    proj = write_project(tmp_path, out)
    other = subprocess.Popen([PY, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        real_start = liveness.proc_start_time(other.pid)
        out.mkdir(parents=True)
        info = {"pid": other.pid, "pgid": other.pid, "host": socket.gethostname(), "argv": ["deepspeed"],
                "started_at": "2020-01-01T00:00:00Z", "proc_start": real_start - 1, "overrides": []}
        (out / "run.json").write_text(json.dumps(info))  # the pid was reused by `other`
        assert G.stop_run(out, "base", grace_int=0.5, grace_term=0.5) is None
        res = subprocess.run([*LONGSPEC, "stop", str(proj), "base", "--timeout", "1"], capture_output=True,
                             text=True, cwd=ROOT, timeout=60)
        assert res.returncode == 1 and "stale run.json left alone" in res.stderr
        (out / "run.json").write_text(json.dumps({**info, "proc_start": real_start, "host": "elsewhere"}))
        with pytest.raises(RefusedError, match="host elsewhere"):
            G.stop_run(out, "base", grace_int=0.5, grace_term=0.5)
        time.sleep(0.3)
        assert other.poll() is None and alive(other.pid)
    finally:
        other.kill()
        other.wait()


# ------------------------------------------------------------------------------------ slow tier

@pytest.mark.slow
def test_sigint_through_the_real_deepspeed_launcher_leaves_no_process(fake, tmp_path):
    out = tmp_path / "out"
    placement = A.Placement(gpus=2)
    res = A.resolve_resources(placement, [], env={})
    cmd = A.build_launch(placement, res, tmp_path / "conf", "base", out, ["max_steps=400", "step_s=0.3"],
                         module="fake_trainer")
    drv = start_driver(fake, cmd.argv, out, grace=10.0, env=cmd.env)
    wait_for(lambda: last_step(out) >= 2, 240, "two steps through deepspeed")
    pgid = json.loads((out / "run.json").read_text())["pgid"]
    helpers = [int((out / f"helper-{r}.pid").read_text()) for r in (0, 1)]
    assert len(liveness.group_members(pgid)) >= 5  # runner, launcher, two ranks, their helpers
    drv.send_signal(signal.SIGINT)
    text, _ = drv.communicate(timeout=120)
    assert drv.returncode == 130, text
    assert liveness.group_members(pgid) == [] and not any(alive(h) for h in helpers)
    assert "fake trainer rank 1" in (out / "train.log").read_text()


# ------------------------------------------------------------------------- CLI: plan + dry-run

TINY_CONFIG = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 128, "vocab_size": 768, "max_position_embeddings": 32768,
               "rms_norm_eps": 1e-6, "hidden_act": "silu"}


def scaffold(tmp_path: Path, preset: str = "tiny", name: str = "proj") -> Path:
    """A project as `init` writes it; the tiny preset's assets are stand-ins (config.json + data files)."""
    from longspec_cli.launch.scaffold import InitAnswers, plan_project, write_project

    root = tmp_path / name
    write_project(plan_project(InitAnswers(project_dir=root, preset=preset)))
    if preset == "tiny":
        (root / "assets" / "target").mkdir(parents=True)
        (root / "assets" / "target" / "config.json").write_text(json.dumps(TINY_CONFIG))
        (root / "assets" / "data").mkdir()
        for st in ("base", "long", "longcot"):
            (root / "assets" / "data" / f"{st}.jsonl").write_text('{"text": "a b c"}\n')
    return root


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*LONGSPEC, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=env or {**os.environ})


def flat(text: str) -> str:
    """Terminal text with the error panel's borders and line wrapping taken out."""
    return " ".join(text.replace("│", " ").split())


def gpu_env(tmp_path: Path, gpus: int, mib: int = 81559) -> dict[str, str]:
    from tests.cli.test_launch_argv import fake_smi

    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return {**env, **fake_smi(tmp_path, gpus, mib)}


def cpu_env() -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def test_dry_run_on_cpu_prints_a_paste_ready_command_and_the_estimate(tmp_path):
    import shlex

    proj = scaffold(tmp_path)
    res = cli("run", str(proj), "base", "--dry-run", "max_steps=3", env=cpu_env())
    assert res.returncode == 0, res.stderr
    # one CPU rank: the trainer itself (a world of one), without DeepSpeed's runner and launcher
    line = next(x for x in res.stdout.splitlines() if "longspec.train" in x and not x.startswith("#"))
    words = shlex.split(line)
    assert words[:2] == ["env", "DS_ACCELERATOR=cpu"] and "deepspeed" not in line
    i = words.index("-m")
    assert words[i - 1:i + 2] == ["-u", "-m", "longspec.train"] and words[i - 2].endswith("python")
    assert words[-5:] == ["--config-dir", str(proj / "conf"), "+exp=base", f"output_dir={proj / 'runs' / 'base'}",
                          "max_steps=3"]
    # two CPU ranks (or a port asked for): DeepSpeed's runner starts them
    for flags in (["--gpus", "2", "global_batch_size=null"], ["--master-port", "29777"]):
        res = cli("run", str(proj), "base", "--dry-run", *flags, env=cpu_env())
        assert res.returncode == 0, res.stderr
        line = next(x for x in res.stdout.splitlines() if "longspec.train" in x and not x.startswith("#"))
        words = shlex.split(line)
        i = next(n for n, w in enumerate(words) if w.endswith("deepspeed") or w == "deepspeed.launcher.runner")
        assert words[i + 1:i + 3] == ["--num_gpus", "2" if "--gpus" in flags else "1"], line
    assert "# per-GPU memory estimate" in res.stdout and "[CPU run: informational]" in res.stdout
    assert not (proj / "runs").exists()  # nothing started, nothing written


def test_dry_run_one_and_several_gpus(tmp_path):
    proj = scaffold(tmp_path)
    res = cli("run", str(proj), "base", "--dry-run", "--master-port", "29777", env=gpu_env(tmp_path, 1))
    assert res.returncode == 0, res.stderr
    assert "--num_gpus 1 --master_port 29777 --no_local_rank --module longspec.train" in res.stdout
    assert "DS_ACCELERATOR" not in res.stdout and "peak" in res.stdout
    res = cli("run", str(proj), "--all", "--dry-run", "--gpus", "4", "--master-port", "29777",
              "global_batch_size=null", "seed=7", env=gpu_env(tmp_path, 8))
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("seed=7") == 3
    assert res.stdout.count("--num_gpus 4 --master_port 29777 --no_local_rank") == 3  # base, long, longcot
    assert "its draft is chained from base first" in res.stdout
    res = cli("run", str(proj), "base", "--dry-run", "--gpus", "2", env=gpu_env(tmp_path, 1))
    assert res.returncode == 1 and "1 GPU(s) visible" in flat(res.stderr)


def test_bad_overrides_and_stage_names_stop_before_anything_starts(tmp_path):
    proj = scaffold(tmp_path)
    for args, words, code in ((("base", "max_steps"), "no '='", 2),
                              (("base", "lerning_rate=1"), "did you mean `learning_rate`", 2),
                              (("base", "draft_model_name_or_path=/x.pth"), "next-stage", 2),
                              (("bsae",), "did you mean 'base'", 2), (("base", "--gpus", "0"), "at least 1", 2),
                              (("base", "save_steps=0"), "save_steps", 1)):  # composed with Hydra in preflight
        res = cli("run", str(proj), *args, env=cpu_env())
        assert res.returncode == code, (args, res.stderr)
        assert words in flat(res.stderr), (args, res.stderr)
        assert "Traceback" not in res.stderr and "UserWarning" not in res.stderr
    assert not (proj / "runs").exists()


def test_memory_warning_for_the_qwq_preset_on_small_gpus(tmp_path):
    proj = scaffold(tmp_path, preset="qwq-32b-preview", name="qwq")
    res = cli("run", str(proj), "--all", "--dry-run", "--gpus", "8", "--gpu-mem", "40", env=gpu_env(tmp_path, 8, 40960))
    text = flat(res.stderr)
    assert "warning: base: stage needs ~" in text and "ZeRO-3" in text  # 61 GiB of target per GPU
    assert "long: stage needs" not in text  # ZeRO-3 at 32k fits in 40 GiB per the estimate
    assert "ZeRO-1 + optimizer offload, 1024 tokens x 2, world 8" in res.stdout
    assert "ZeRO-3 + optimizer offload, 32768 tokens x 1, world 8" in res.stdout


def test_slurm_script_written_by_the_cli(tmp_path):
    proj = scaffold(tmp_path)
    # world size 8 (2 nodes x 4 GPUs): the configs' batch arithmetic is for another size, as a dry run says
    res = cli("run", str(proj), "--all", "--slurm", "--num-nodes", "2", "--gpus", "4", env=cpu_env())
    assert res.returncode == 1 and "nothing was submitted" in flat(res.stderr), res.stdout + res.stderr
    assert "x 2 node(s) (--num-nodes)" in flat(res.stderr) and not (proj / "longspec.sbatch").exists()
    res = cli("run", str(proj), "--all", "--slurm", "--num-nodes", "2", "--gpus", "4", "--force", env=cpu_env())
    assert res.returncode == 0, res.stderr
    assert "2 node(s) x 4 GPU(s) per node, world size 8" in flat(res.stdout)
    text = (proj / "longspec.sbatch").read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text
    assert text.count("-m longspec.nodelaunch") == 3 and f"chain {proj} longcot" in text
    assert subprocess.run(["bash", "-n", str(proj / "longspec.sbatch")]).returncode == 0
    # CPU nodes: --gpus 0 is one CPU rank per node, never "1 GPU(s)"
    res = cli("run", str(proj), "--all", "--slurm", "--gpus", "0", "--force", env=cpu_env())
    assert res.returncode == 0 and "1 node(s) x CPU (DS_ACCELERATOR=cpu), 1 rank(s) per node" in flat(res.stdout)
    assert "GPU(s)" not in res.stdout and "--gpus-per-node" not in (proj / "longspec.sbatch").read_text()
    res = cli("run", str(proj), "--all", "--time", "10", env=cpu_env())
    assert res.returncode == 2 and "--time go(es) with --slurm" in flat(res.stderr)


def test_the_cli_never_imports_torch_or_deepspeed(tmp_path):
    proj = scaffold(tmp_path)
    code = ("import sys\nfrom longspec_cli.launch import execute, plan, argv\n"
            f"execute.run_request(plan.RunRequest(project={str(proj)!r}, all=True, dry_run=True))\n"
            "bad = sorted(m for m in ('torch', 'deepspeed', 'transformers', 'textual')"
            " if m in sys.modules)\nprint('IMPORTED', bad)\n")
    res = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=ROOT, env=cpu_env())
    assert "IMPORTED []" in res.stdout, res.stdout + res.stderr


# --------------------------------------------------------------------- plan: skip, stale, rerun

def finish(spec, overrides=(), draft_sha=None, payload=b"w") -> str:
    """Make `spec`'s run folder look like a finished stage (the trainer's stage_complete.json)."""
    import hashlib

    spec.output_dir.mkdir(parents=True, exist_ok=True)
    (spec.output_dir / "draft_model_weights.pth").write_bytes(payload + spec.name.encode())
    sha = hashlib.sha256(payload + spec.name.encode()).hexdigest()
    (spec.output_dir / "stage_complete.json").write_text(json.dumps({
        "stage": spec.name, "steps": 3, "final_loss": 1.0, "sha256": sha, "draft_sha256": draft_sha,
        "config_sha256": runfolder.config_fingerprint(spec.config, list(overrides))}))
    (spec.output_dir / "run.json").write_text(json.dumps({"pid": 0, "overrides": list(overrides),
                                                          "host": socket.gethostname(), "returncode": 0}))
    return sha


def actions(proj: Path, **kw) -> dict[str, str]:
    from longspec.project.manifest import load_manifest
    from longspec_cli.launch import plan

    m = load_manifest(proj)
    return {p.spec.name: p.action for p in plan.plan_stages(m, plan.RunRequest(project=proj, all=True, **kw))}


def test_plan_skips_done_stages_and_reruns_everything_downstream_of_a_change(tmp_path):
    from longspec.project.manifest import load_manifest

    proj = scaffold(tmp_path)
    base, long, longcot = load_manifest(proj).stages
    assert actions(proj) == {"base": "start", "long": "start", "longcot": "start"}
    sha_base = finish(base)
    assert actions(proj) == {"base": "skip", "long": "start", "longcot": "start"}
    sha_long = finish(long, draft_sha=sha_base)
    finish(longcot, draft_sha=sha_long)
    assert actions(proj) == {"base": "skip", "long": "skip", "longcot": "skip"}
    # an override changes the fingerprint of every stage it applies to
    assert actions(proj, overrides=["seed=7"]) == {"base": "rerun", "long": "rerun", "longcot": "rerun"}
    assert actions(proj, overrides=["force=true"])["base"] == "skip"  # not part of config_sha256
    # an edit to long's config: base stays, long and everything after it run again
    long.config.write_text(long.config.read_text() + "\n# edited\n")
    assert actions(proj) == {"base": "skip", "long": "rerun", "longcot": "rerun"}
    # status shows the stale stages too
    from longspec.runs.status import project_status

    states = {s.name: s.state for s in project_status(load_manifest(proj))}
    assert states["long"] == "stale" and states["base"] == "done"


def test_plan_resumes_an_interrupted_stage_and_refuses_a_running_one(tmp_path):
    from longspec.project.manifest import load_manifest
    from longspec_cli.launch import plan

    proj = scaffold(tmp_path)
    base = load_manifest(proj).stages[0]
    ck = base.output_dir / "checkpoint-20"
    ck.mkdir(parents=True)
    (ck / "checkpoint.json").write_text("{}")
    assert actions(proj)["base"] == "resume"
    me = os.getpid()
    (base.output_dir / "run.json").write_text(json.dumps({
        "pid": me, "pgid": me, "host": socket.gethostname(), "proc_start": liveness.proc_start_time(me)}))
    with pytest.raises(RefusedError, match="stage base is running"):
        plan.plan_stages(load_manifest(proj), plan.RunRequest(project=proj, all=True))


# ------------------------------------------------------------------ slow tier: the real trainer

def tiny_project(tmp_path: Path, name: str = "tiny") -> Path:
    root = tmp_path / name
    res = cli("init", str(root), "--preset", "tiny", "--no-input", timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    return root


@pytest.mark.slow
def test_ctrl_c_on_longspec_run_then_the_next_run_resumes_to_the_planned_step(tmp_path):
    proj = tiny_project(tmp_path)
    out = proj / "runs" / "base"
    # steps take ~0.1 s here: leave room so the stop lands well before the last step
    args = [*LONGSPEC, "run", str(proj), "base", "max_steps=60", "save_steps=4"]
    env = cpu_env()
    run = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: last_step(out) >= 5 or run.poll() is not None, 600, "step 5 of the tiny base stage")
    assert run.poll() is None, run.stdout.read()
    pgid = json.loads((out / "run.json").read_text())["pgid"]
    run.send_signal(signal.SIGINT)
    text, _ = run.communicate(timeout=120)
    assert run.returncode == 130, text
    assert liveness.group_members(pgid) == []  # not one rank, launcher or helper left
    assert not (out / "stage_complete.json").exists()
    saved = max(c.step for c in runfolder.RunDir(out).checkpoints())
    assert saved >= 4
    # A build of an op killed midway leaves its lock in the ops folder: the next run removes it.
    stale = Path(env.get("TORCH_EXTENSIONS_DIR") or ops_build_dir()) / f"longspec_test_op_{os.getpid()}" / "lock"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.touch()

    res = subprocess.run(args + ["--quiet"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert not stale.exists() and f"removed {stale}" in " ".join(res.stderr.split())
    stale.parent.rmdir()
    events = runfolder.RunDir(out).events()
    resume = [e for e in events if e.get("event") == "resume"]
    assert resume and resume[-1]["step"] == saved
    assert json.loads((out / "stage_complete.json").read_text())["steps"] == 60
    assert "resume" in res.stdout  # the plan said so


@pytest.mark.slow
def test_a_crashing_stage_stops_all_with_the_log_tail(tmp_path):
    proj = tiny_project(tmp_path)
    (proj / "assets" / "data" / "long.jsonl").unlink()  # validation would refuse: --force lets it crash
    res = subprocess.run([*LONGSPEC, "run", str(proj), "--all", "--force", "--quiet", "max_steps=2", "save_steps=2"],
                         cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=1200)
    assert res.returncode == 4, res.stdout[-3000:] + res.stderr[-3000:]
    assert (proj / "runs" / "base" / "stage_complete.json").is_file()
    assert not (proj / "runs" / "long" / "stage_complete.json").exists()
    assert not (proj / "runs" / "longcot").exists()  # never started
    err = flat(res.stderr)
    assert "stage long failed" in err and "the next stage was not started" in err
    assert "last lines of" in res.stderr and "long.jsonl" in res.stderr  # the trainer's own message
    summary = [line.split()[:3] for line in res.stdout.splitlines() if line.split()[:1] in (["base"], ["long"], ["longcot"])]
    assert ["long", "start", "failed"] in summary and ["longcot", "start", "not"] in summary


