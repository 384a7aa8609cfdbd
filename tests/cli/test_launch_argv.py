"""The DeepSpeed launcher argv of `longspec run`: GPUs, CPU fallback, hostfiles, SLURM, overrides.

The argv is checked against DeepSpeed 0.19.8's own argument parsers (runner and per-node launcher),
so a flag DeepSpeed does not know fails here rather than at launch time.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from longspec.errors import RefusedError, UsageError
from longspec_cli.launch import argv as A
from longspec_cli.launch import slurm as S

ROOT = Path(__file__).resolve().parents[2]


def fake_smi(tmp_path: Path, gpus: int, mib: int = 81559) -> dict[str, str]:
    """A PATH whose nvidia-smi prints `gpus` rows in the format detect_gpus() asks for."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    rows = "".join(f"{i}, GPU-{i:04d}, NVIDIA H100 80GB HBM3, {mib}, {mib - 512 * i}\\n" for i in range(gpus))
    smi = d / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{rows}'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{d}:{os.environ['PATH']}"}


def build(p: A.Placement, gpus: list[A.Gpu], env: dict[str, str] | None = None, manifest_gpus=None, **kw):
    r = A.resolve_resources(p, gpus, manifest_gpus, env=env or {}, **kw)
    cmd = A.build_launch(p, r, Path("/proj/conf"), "base", Path("/proj/runs/base"), ["max_steps=5"],
                         launcher=["deepspeed"], pick_port=False)
    return r, cmd


def runner_args(cmd: A.LaunchCommand):
    """Parse our argv with DeepSpeed's own runner parser (imports deepspeed in the test only)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.launcher.runner import parse_args

    return parse_args(cmd.argv[1:])


# ------------------------------------------------------------------------------ GPU detection

def test_detect_gpus_reads_nvidia_smi_and_honours_cuda_visible_devices(tmp_path):
    env = fake_smi(tmp_path, 4)
    assert [g.index for g in A.detect_gpus(env)] == ["0", "1", "2", "3"]
    assert A.detect_gpus(env)[0].memory_mib == 81559
    assert [g.free_mib for g in A.detect_gpus({**env, "CUDA_VISIBLE_DEVICES": "3,1"})] == [81559 - 1536, 81559 - 512]
    assert [g.index for g in A.detect_gpus({**env, "CUDA_VISIBLE_DEVICES": "3,1"})] == ["3", "1"]
    assert [g.index for g in A.detect_gpus({**env, "CUDA_VISIBLE_DEVICES": "GPU-0002"})] == ["2"]
    assert A.detect_gpus({**env, "CUDA_VISIBLE_DEVICES": ""}) == []
    assert A.detect_gpus({"PATH": str(tmp_path / "nothing")}) == []


# ------------------------------------------------------------------------------ one node

def test_one_gpu(tmp_path):
    gpus = A.detect_gpus(fake_smi(tmp_path, 1))
    r, cmd = build(A.Placement(), gpus, manifest_gpus=1)
    assert not r.cpu and r.world_size == 1 and cmd.env == {}
    assert cmd.argv == ["deepspeed", "--num_gpus", "1", "--no_local_rank", "--module", "longspec.train",
                        "--config-dir", "/proj/conf", "+exp=base", "output_dir=/proj/runs/base", "max_steps=5"]
    ns = runner_args(cmd)
    assert (ns.num_gpus, ns.module, ns.no_local_rank, ns.user_script) == (1, True, True, "longspec.train")
    assert ns.user_args == ["--config-dir", "/proj/conf", "+exp=base", "output_dir=/proj/runs/base", "max_steps=5"]


def test_several_gpus_from_the_manifest_and_from_gpus(tmp_path):
    gpus = A.detect_gpus(fake_smi(tmp_path, 8))
    r, cmd = build(A.Placement(), gpus, manifest_gpus=8)
    assert r.world_size == 8 and cmd.argv[1:3] == ["--num_gpus", "8"]
    r, cmd = build(A.Placement(gpus=4), gpus, manifest_gpus=8)
    assert r.world_size == 4 and runner_args(cmd).num_gpus == 4


def test_cuda_visible_devices_becomes_include(tmp_path):
    env = {**fake_smi(tmp_path, 8), "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    r, cmd = build(A.Placement(gpus=2), A.detect_gpus(env), env=env)
    # DeepSpeed ignores CUDA_VISIBLE_DEVICES when --num_gpus is given, so the GPUs are named.
    assert runner_args(cmd).include == "localhost:4,5" and "--num_gpus" not in cmd.argv
    assert r.world_size == 2


def test_more_gpus_than_visible_is_refused_unless_forced(tmp_path):
    gpus = A.detect_gpus(fake_smi(tmp_path, 2))
    with pytest.raises(RefusedError, match="2 GPU"):
        build(A.Placement(), gpus, manifest_gpus=8)
    r, _ = build(A.Placement(), gpus, manifest_gpus=8, force=True)
    assert r.world_size == 8


def test_include(tmp_path):
    r, cmd = build(A.Placement(include="localhost:0,2"), A.detect_gpus(fake_smi(tmp_path, 4)))
    assert r.world_size == 2 and runner_args(cmd).include == "localhost:0,2"
    with pytest.raises(UsageError, match="cannot be combined"):
        build(A.Placement(gpus=2, include="localhost:0"), [])


def test_cpu_fallback_uses_the_cpu_accelerator_and_gpus_ranks():
    r, cmd = build(A.Placement(), [], manifest_gpus=8)
    assert r.cpu and r.world_size == 1 and cmd.env["DS_ACCELERATOR"] == "cpu"
    assert cmd.argv[1:3] == ["--num_gpus", "1"]
    r, cmd = build(A.Placement(gpus=2), [])
    assert r.world_size == 2 and cmd.argv[1:3] == ["--num_gpus", "2"]
    assert int(cmd.env.get("OMP_NUM_THREADS", "1")) >= 1


def test_shell_line_round_trips_through_a_shell_parser():
    p = A.Placement()
    r = A.resolve_resources(p, [], env={})
    cmd = A.build_launch(p, r, Path("/my proj/conf"), "base", Path("/my proj/runs/base"),
                         ["train_file='/data/a b.jsonl'", "adam_betas=[0.9,0.95]"], launcher=["deepspeed"],
                         pick_port=False)
    words = shlex.split(cmd.shell())
    assert words[0] == "env" and words[1] == "DS_ACCELERATOR=cpu"
    assert words[-len(cmd.argv):] == cmd.argv
    assert "--config-dir" in words and "/my proj/conf" in words


def test_busy_default_port_gets_a_free_one():
    import socket

    p = A.Placement()
    r = A.resolve_resources(p, [], env={})
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", A.DEFAULT_MASTER_PORT))
            s.listen()
        except OSError:
            pass  # another process listens there already: the same situation
        flags = A.launcher_flags(p, r)
    port = int(flags[flags.index("--master_port") + 1])
    assert port != A.DEFAULT_MASTER_PORT
    assert A.launcher_flags(A.Placement(master_port=31000), r)[-3:-1] == ["--master_port", "31000"]


# ------------------------------------------------------------------------------ several nodes

def test_hostfile_maps_to_deepspeed_multi_node_flags(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# two nodes\nworker-0 slots=8\nworker-1 slots=8\nworker-2 slots=8\n")
    p = A.Placement(hostfile=hosts, num_nodes=2, master_addr="10.0.0.1", master_port=29600, launcher="openmpi")
    r, cmd = build(p, [])
    assert (r.nodes, r.ranks_per_node, r.world_size) == (2, 8, 16)
    ns = runner_args(cmd)
    assert (ns.hostfile, ns.num_nodes, ns.master_addr, ns.master_port, ns.launcher) == \
        (str(hosts), 2, "10.0.0.1", 29600, "openmpi")
    assert ns.num_gpus == -1  # all slots of each host, as the hostfile says
    r, cmd = build(A.Placement(hostfile=hosts, gpus=4), [])
    assert r.world_size == 12 and runner_args(cmd).num_gpus == 4


def test_bad_hostfiles_and_node_counts_are_usage_errors(tmp_path):
    bad = tmp_path / "bad"
    bad.write_text("worker-0 slots=8\nworker-1 eight slots\n")
    with pytest.raises(UsageError, match=r"bad:2"):
        build(A.Placement(hostfile=bad), [])
    with pytest.raises(UsageError, match="not found"):
        build(A.Placement(hostfile=tmp_path / "missing"), [])
    with pytest.raises(UsageError, match="needs a hostfile"):
        build(A.Placement(num_nodes=2), [])
    good = tmp_path / "good"
    good.write_text("a slots=1\n")
    with pytest.raises(UsageError, match="lists 1 host"):
        build(A.Placement(hostfile=good, num_nodes=3), [])
    with pytest.raises(UsageError, match="unknown launcher"):
        build(A.Placement(hostfile=good, launcher="ssh"), [])


# ------------------------------------------------------------------------------ SLURM

def test_world_info_encoding_matches_deepspeed():
    from deepspeed.launcher.runner import encode_world_info

    world = {"node-a": [0, 1, 2, 3], "node-b": [0, 1, 2, 3]}
    assert S.encode_world_info(world) == encode_world_info(world)


def test_node_launch_argv_is_accepted_by_deepspeeds_per_node_launcher(monkeypatch):
    from deepspeed.launcher import launch

    argv = S.node_launch_argv({"a": [0], "b": [0]}, 1, "127.0.0.1", 29511,
                              A.trainer_args(Path("/p/conf"), "base", Path("/p/runs/base"), ["seed=1"]))
    assert argv[1:4] == ["-u", "-m", "longspec.nodelaunch"]  # DeepSpeed's launcher, patient with signals
    monkeypatch.setattr(sys, "argv", ["launch", *argv[4:]])
    ns = launch.parse_args()
    assert (ns.node_rank, ns.master_port, ns.module, ns.no_local_rank, ns.training_script) == \
        (1, 29511, True, True, "longspec.train")
    assert json.loads(base64.urlsafe_b64decode(ns.world_info)) == {"a": [0], "b": [0]}
    assert ns.training_script_args[-1] == "seed=1"


def test_sbatch_script(tmp_path):
    stages = [S.SlurmStage("base", tmp_path / "runs" / "base",
                           A.trainer_args(tmp_path / "conf", "base", tmp_path / "runs" / "base", ["max_steps=7"]),
                           "long"),
              S.SlurmStage("long", tmp_path / "runs" / "long",
                           A.trainer_args(tmp_path / "conf", "long", tmp_path / "runs" / "long", []), None)]
    text = S.sbatch_script(project=tmp_path, job_name="longspec-x", nodes=4, gpus_per_node=8, stages=stages,
                           master_port=29555, python="/venv/bin/python", extra_sbatch=["--time=2:00:00"])
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for want in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --time=2:00:00"):
        assert want in lines
    # the traps come before any command (the #SBATCH block ends at the first command)
    first_cmd = next(i for i, x in enumerate(lines) if x and not x.startswith("#"))
    assert lines[first_cmd].startswith("STOP=") and "trap 'on_stop USR1' USR1" in lines[first_cmd:first_cmd + 20]
    assert text.count("srun --nodes=4 --ntasks-per-node=1") == 2
    assert '--node_rank="$SLURM_NODEID"' in text and "-m longspec.nodelaunch" in text
    assert "#SBATCH --signal=B:USR1@300" in lines and "#SBATCH --requeue" in lines
    assert 'forward_signal() { scancel --signal="$1" "$SLURM_JOB_ID"; }' in text  # the steps, not the shell
    assert text.count("stage_end ") == 2 and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert '"--world_info=$WORLD_INFO" "--master_addr=$MASTER_ADDR" "--master_port=$MASTER_PORT"' in text
    assert "FIXED_PORT=29555" in text and "DS_ACCELERATOR" not in text
    assert "+exp=base" in text and "max_steps=7" in text
    assert f"chain {tmp_path} long" in text and "next-stage" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0

    # The world-info line, run as SLURM would run it, gives DeepSpeed's encoding over the job's hosts.
    line = next(x for x in lines if x.startswith("WORLD_INFO="))
    snippet = shlex.split(line.split("| ", 1)[1].rstrip(')"'))
    out = subprocess.run([sys.executable, *snippet[1:]], input="nid001\nnid002\n", capture_output=True,
                         text=True, check=True).stdout.strip()
    assert json.loads(base64.urlsafe_b64decode(out)) == {"nid001": list(range(8)), "nid002": list(range(8))}

    # CPU nodes: no GPU request, the CPU accelerator; one node: the launcher runs in the batch script.
    text = S.sbatch_script(project=tmp_path, job_name="x", nodes=1, gpus_per_node=2, stages=stages, cpu=True)
    assert "--gpus" not in text and "export DS_ACCELERATOR=cpu" in text and "srun" not in text
    assert 'forward_signal() { kill -s "$1" "$STEP" 2>/dev/null; }' in text


@pytest.mark.parametrize("limit, seconds", [("90", 5400), ("1:30", 90), ("2:00:00", 7200), ("1-0", 86400),
                                            ("1-2:30", 95400), ("0-0:0:45", 45)])
def test_slurm_time_limits(limit, seconds):
    assert S.time_limit_s(limit) == seconds


def test_slurm_options_refuse_what_cannot_work():
    with pytest.raises(UsageError, match="not shorter than --time"):
        S.SlurmOptions(time="5").lead()  # 300 s ahead of a 5-minute limit
    assert S.SlurmOptions(time="5", signal_lead_s=120).lead() == 120
    with pytest.raises(UsageError, match="not a SLURM time limit"):
        S.SlurmOptions(time="ten minutes").lead()
    with pytest.raises(UsageError, match="one sbatch option"):
        S.SlurmOptions(extra=["qos=high"]).sbatch_lines()
    assert S.SlurmOptions(time="10", partition="cpu", account="a b", extra=["--qos=high"]).sbatch_lines() == \
        ["--time=10", "--partition=cpu", "--account=a b", "--qos=high"]


# ------------------------------------------------------------------------------ overrides

@pytest.mark.parametrize("good", [
    "max_steps=5", "data.max_seq_length=2048", "+new_key=1", "++seed=3", "~data.on_bad_record",
    "hydra.run.dir=.", "learning_rate=1e-4", "ds_cfg.optimizer.params.betas=[0.9,0.95]", "seed=''",
])
def test_overrides_hydra_accepts_pass(good):
    assert A.check_overrides([good]) == [good]


@pytest.mark.parametrize("bad, why", [
    ("max_steps", "no '='"), ("=5", "no key"), ("max steps=5", "token recognition error"),
    ("data.max_seq_length=[1,2", "no viable alternative"), ("seed=1,2", "a sweep"),
    ("output_dir=/elsewhere", "longspec.yaml"), ("draft_model_name_or_path=/x.pth", "next-stage"),
])
def test_overrides_hydra_would_reject_are_usage_errors(bad, why):
    """Hydra's own override parser decides; the keys longspec owns are refused too."""
    with pytest.raises(UsageError) as e:
        A.check_overrides([bad])
    assert why in e.value.message and e.value.exit_code == 2


def test_deepspeed_missing_is_one_sentence_about_the_train_extra(tmp_path):
    # A Python without deepspeed (-S drops site-packages) asks for the extra, with no traceback.
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from longspec.errors import LongspecError\n"
            "from longspec_cli.launch import argv\n"
            "try:\n    argv.deepspeed_command()\nexcept LongspecError as e:\n"
            "    print(e.message); print(e.hint)\n") % str(ROOT)
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True).stdout
    assert "not installed" in out and "pip install 'longspec[train]'" in out
