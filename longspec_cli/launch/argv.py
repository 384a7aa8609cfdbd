"""The DeepSpeed launcher command line of one stage, built as an argv list (never a shell string).

    deepspeed [--num_gpus N | --include SPEC] [--hostfile F --num_nodes N --master_addr A
              --launcher L] [--master_port P] --no_local_rank --module longspec.train
              --config-dir DIR/conf +exp=STAGE output_dir=/abs/run/folder [key=value ...]

`--no_local_rank`: the launcher would otherwise append `--local_rank=N`, which Hydra rejects; each
rank reads LOCAL_RANK from its environment instead. Without a visible GPU the command runs on CPU
(env DS_ACCELERATOR=cpu) with `--gpus` ranks, or 1.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

from longspec_cli.launch import trainer
from longspec.machine.gpus import Gpu, detect_gpus  # noqa: F401  (the launch's GPUs)
from longspec_cli.launch.trainer import TRAINER_MODULE
from longspec.errors import RefusedError, UsageError

LAUNCHERS = ("pdsh", "openmpi", "mvapich", "slurm")
DEFAULT_MASTER_PORT = 29500  # DeepSpeed's own default (TORCH_DISTRIBUTED_DEFAULT_PORT)
INSTALL_HINT = "install the training extra: pip install 'longspec[train]'"
# Keys that the launcher sets itself; an override of them would silently move the run folder.
RESERVED_KEYS = {"output_dir": "the run folder comes from longspec.yaml (stages[].output_dir)",
                 "draft_model_name_or_path": "the chain owns the draft: `longspec next-stage` sets it in the stage "
                                             "file from the upstream stage's final draft"}


def encode_world_info(world: dict[str, list[int]]) -> str:
    """DeepSpeed's --world_info value: urlsafe base64 of the JSON {host: [slots]} mapping."""
    return base64.urlsafe_b64encode(json.dumps(world).encode("utf-8")).decode("utf-8")


@dataclass(frozen=True)
class Placement:
    """Where the ranks go, as the user asked (None = not given)."""

    gpus: int | None = None  # per node
    include: str | None = None
    hostfile: Path | None = None
    num_nodes: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str | None = None

    @property
    def multi_node(self) -> bool:
        return self.hostfile is not None


@dataclass(frozen=True)
class Resources:
    """What the launch will use: CPU or GPU, ranks per node, nodes."""

    cpu: bool
    ranks_per_node: int
    nodes: int
    gpus: tuple[Gpu, ...] = ()
    pinned: bool = False  # CUDA_VISIBLE_DEVICES names the GPUs: launch on those, by --include
    hosts: tuple[tuple[str, tuple[int, ...]], ...] = ()  # several nodes: (host, its slots) in node order

    @property
    def world_size(self) -> int:
        return sum(len(s) for _, s in self.hosts) if self.hosts else self.ranks_per_node * self.nodes

    def where(self) -> str:
        """Where the ranks run, as the plan and the summary say it."""
        kind = "CPU (DS_ACCELERATOR=cpu)" if self.cpu else ("GPUs" if self.hosts else f"{len(self.gpus)} GPU(s)")
        if not self.hosts:
            return kind
        slots = ", ".join(f"{h}: {len(s)} slot{'s' if len(s) != 1 else ''}" for h, s in self.hosts)
        return f"{len(self.hosts)} node(s) ({slots}), {kind}"


@dataclass(frozen=True)
class LaunchCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the inherited environment
    world_size: int = 1
    cpu: bool = False
    hosts: tuple[str, ...] = ()  # a launch over ssh on these nodes (launch/nodes.py)
    run_id: str | None = None  # LONGSPEC_RUN_ID of every process of that launch, on every node
    comments: tuple[str, ...] = ()  # what the plan prints under the command (each node's own command)

    def shell(self) -> str:
        """The command as one line a user can paste into a POSIX shell."""
        prefix = ["env", *(f"{k}={v}" for k, v in self.env.items())] if self.env else []
        return shlex.join(prefix + self.argv)


# ------------------------------------------------------------------------------- hostfile

_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


def parse_hostfile(path: Path) -> dict[str, int]:
    """host -> slots, from an MPI-style hostfile (`worker-0 slots=8`), as DeepSpeed reads it."""
    if not path.is_file():
        raise UsageError(f"hostfile {path} not found", hint="pass --hostfile PATH to an existing file")
    hosts: dict[str, int] = {}
    for n, raw in enumerate(path.read_text(errors="replace").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _HOST_LINE.match(line)
        if not m:
            raise UsageError(f"{path}:{n}: bad hostfile line {line!r}",
                             hint="each line is `HOSTNAME slots=N`, e.g. `worker-0 slots=8`")
        if m.group(1) in hosts:
            raise UsageError(f"{path}:{n}: host {m.group(1)!r} listed twice")
        hosts[m.group(1)] = int(m.group(2))
    if not hosts:
        raise UsageError(f"hostfile {path} lists no host", hint="add lines like `worker-0 slots=8`")
    return hosts


def _include_slots(include: str) -> dict[str, int | None]:
    """`host:0,1@host2` -> {host: 2, host2: None (all slots)}."""
    return {h: None if ids is None else len(ids) for h, ids in _include_ids(include).items()}


def is_this_host(host: str) -> bool:
    """Does `host` (a hostfile name) name this machine?"""
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    try:
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return host in names


def _include_ids(include: str) -> dict[str, list[int] | None]:
    """`host:0,1@host2` -> {host: [0, 1], host2: None (all slots)}."""
    out: dict[str, list[int] | None] = {}
    for spec in include.split("@"):
        if not spec:
            raise UsageError(f"bad --include {include!r}",
                             hint="NAME[:SLOT[,SLOT...]][@NAME...], e.g. localhost:0,1")
        host, _, slots = spec.partition(":")
        if slots:
            try:
                ids = sorted({int(s) for s in slots.split(",")})
            except ValueError:
                raise UsageError(f"bad --include {include!r}: slots must be integers") from None
            out[host] = ids
        else:
            out[host] = None
    return out


# ------------------------------------------------------------------------------ resources

def resolve_resources(p: Placement, gpus: list[Gpu], manifest_gpus: int | None = None,
                      force: bool = False, env: dict[str, str] | None = None) -> Resources:
    """Decide CPU or GPU and how many ranks, refusing combinations DeepSpeed would reject."""
    env = os.environ if env is None else env
    if p.gpus is not None and p.gpus < 1:
        raise UsageError("--gpus must be at least 1")
    if p.gpus is not None and p.include:
        raise UsageError("--gpus and --include cannot be combined", hint="DeepSpeed accepts one of them")
    if p.num_nodes is not None and p.num_nodes < 1:
        raise UsageError("--num-nodes must be at least 1")
    if p.launcher is not None and p.launcher not in LAUNCHERS:
        raise UsageError(f"unknown launcher {p.launcher!r}", hint="one of " + ", ".join(LAUNCHERS))
    if p.master_port is not None and not 0 < p.master_port < 65536:
        raise UsageError(f"--master-port {p.master_port} is not a TCP port")
    if not p.multi_node and (p.num_nodes or 1) > 1:
        raise UsageError(f"--num-nodes {p.num_nodes} needs a hostfile",
                         hint="pass --hostfile PATH (lines `HOST slots=N`), or use --slurm")

    if p.multi_node:
        hosts = parse_hostfile(p.hostfile)
        if p.include:
            chosen = _include_slots(p.include)
            unknown = [h for h in chosen if h not in hosts]
            if unknown:
                raise UsageError(f"--include names host(s) not in the hostfile: {', '.join(unknown)}")
            slots = {h: tuple(ids) if ids is not None else tuple(range(hosts[h]))
                     for h, ids in _include_ids(p.include).items()}
        else:
            names = list(hosts)[: p.num_nodes] if p.num_nodes else list(hosts)
            if p.num_nodes and p.num_nodes > len(hosts):
                raise UsageError(f"--num-nodes {p.num_nodes} but the hostfile lists {len(hosts)} host(s)")
            slots = {h: tuple(range(p.gpus or hosts[h])) for h in names}
        # DeepSpeed needs no uniform slot count, but the memory estimate uses the smallest node.
        # The GPUs are on the hosts, not necessarily here (a login node): CPU only when asked for
        # (DS_ACCELERATOR=cpu), or when this machine, one of the hosts, has no GPU.
        cpu = env.get("DS_ACCELERATOR") == "cpu" or (not gpus and any(is_this_host(h) for h in slots))
        return Resources(cpu=cpu, ranks_per_node=min(len(s) for s in slots.values()), nodes=len(slots),
                         gpus=tuple(gpus), hosts=tuple(slots.items()))

    if p.include:
        chosen = _include_slots(p.include)
        if len(chosen) != 1:
            raise UsageError("--include with several hosts needs --hostfile")
        (n,) = chosen.values()
        ranks = n if n is not None else max(len(gpus), 1)
    else:
        ranks = p.gpus or (1 if not gpus else (manifest_gpus or len(gpus)))
    if gpus and ranks > len(gpus) and not force:
        raise RefusedError(
            f"{ranks} GPU rank(s) asked for but {len(gpus)} GPU(s) visible on this machine",
            hint=f"pass --gpus {len(gpus)} (or set launch.gpus in longspec.yaml), or --force; "
                 "`longspec doctor` lists what this machine can use",
        )
    pinned = bool(gpus) and bool(env.get("CUDA_VISIBLE_DEVICES", "").strip()) and not p.include
    return Resources(cpu=not gpus, ranks_per_node=ranks, nodes=1, gpus=tuple(gpus), pinned=pinned)


# --------------------------------------------------------------------------------- command

def deepspeed_command() -> list[str]:
    """The `deepspeed` runner of this Python environment, or a clear refusal if it is missing."""
    missing = [m for m in ("deepspeed", "torch") if find_spec(m) is None]
    if missing:
        raise RefusedError(f"{' and '.join(missing)} not installed in {sys.prefix}, so longspec "
                           "cannot start training", hint=INSTALL_HINT)
    beside = Path(sys.executable).parent / "deepspeed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    # The `deepspeed` script is the runner's main(); running it with this interpreter keeps the
    # ranks in the same environment as longspec itself.
    return [sys.executable, "-m", "deepspeed.launcher.runner"]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_args(conf_dir: Path, stage: str, output_dir: Path, overrides: list[str],
                 module: str = TRAINER_MODULE) -> list[str]:
    """What follows the launcher flags (launch.trainer's builder), with the paths made absolute."""
    return trainer.trainer_args(Path(conf_dir).resolve(), stage, Path(output_dir).resolve(), overrides, module)


def launcher_flags(p: Placement, r: Resources, *, pick_port: bool = True) -> list[str]:
    """DeepSpeed runner flags for the placement (flag names as in deepspeed/launcher/runner.py)."""
    flags: list[str] = []
    if p.multi_node:
        flags += ["--hostfile", str(Path(p.hostfile).resolve())]
        if p.num_nodes:
            flags += ["--num_nodes", str(p.num_nodes)]
    if p.include:
        flags += ["--include", p.include]
    elif r.pinned and not p.multi_node:
        # DeepSpeed drops CUDA_VISIBLE_DEVICES when --num_gpus is given; name the GPUs instead.
        flags += ["--include", "localhost:" + ",".join(g.index for g in r.gpus[: r.ranks_per_node])]
    elif p.gpus is not None or not p.multi_node:
        flags += ["--num_gpus", str(r.ranks_per_node)]
    if p.master_addr:
        flags += ["--master_addr", p.master_addr]
    port = p.master_port
    if port is None and pick_port and not p.multi_node:
        # One node: any free port will do, and DeepSpeed's fixed default collides with every
        # other job on a shared machine (checking it first would still race with them).
        port = free_port()
    if port is not None:
        flags += ["--master_port", str(port)]
    if p.launcher:
        flags += ["--launcher", p.launcher]
    return flags + ["--no_local_rank"]


def cpu_env(r: Resources, inherited: dict[str, str] | None = None) -> dict[str, str]:
    """Environment added for a CPU run: the CPU accelerator, and cores split between the ranks."""
    if not r.cpu:
        return {}
    inherited = os.environ if inherited is None else inherited
    env = {"DS_ACCELERATOR": "cpu"}
    if "OMP_NUM_THREADS" not in inherited:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, cores // r.ranks_per_node))
    return env


def build_launch(p: Placement, r: Resources, conf_dir: Path, stage: str, output_dir: Path,
                 overrides: list[str], *, launcher: list[str] | None = None,
                 pick_port: bool = True, module: str = TRAINER_MODULE) -> LaunchCommand:
    argv = (launcher or deepspeed_command()) + launcher_flags(p, r, pick_port=pick_port) \
        + trainer_args(conf_dir, stage, output_dir, overrides, module)
    return LaunchCommand(argv=argv, env=cpu_env(r), world_size=r.world_size, cpu=r.cpu)


# ------------------------------------------------------------------------------- overrides

def check_overrides(overrides: list[str]) -> list[str]:
    """Refuse (exit 2) what Hydra's own override parser rejects, and the keys longspec owns, before
    anything starts; returns them unchanged. Whether a key exists and its value fits is decided by
    composing the stage with them (launch/preflight.py)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    bad: list[str] = []
    for item in overrides:
        try:
            parsed = parser.parse_override(item)
        except HydraException as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else "not an override"
            if "=" not in item and not item.startswith("~"):
                reason = "no '=' (overrides are key=value)"
            bad.append(f"{item!r}: {reason}")
            continue
        bare = parsed.key_or_group.split("@")[0]
        if not bare:
            bad.append(f"{item!r}: no key before '='")
        elif bare in RESERVED_KEYS:
            bad.append(f"{item!r}: {RESERVED_KEYS[bare]}")
        elif parsed.is_sweep_override():
            bad.append(f"{item!r}: a sweep (several values); longspec runs one config per stage")
    if bad:
        raise UsageError("bad override(s): " + "; ".join(bad),
                         hint="write overrides as key=value with a key of the stage config, "
                              "e.g. learning_rate=1e-4 data.max_seq_length=2048")
    return overrides
