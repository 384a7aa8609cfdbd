"""`longspec eval`'s memory check of a finished stage before it starts longspec.evaluate: the
device it decodes on and what that device has free; the arithmetic is longspec.machine.evalmemory."""

from __future__ import annotations

from pathlib import Path

from longspec.machine import evalmemory as EM
from longspec.machine.gpus import MIB, detect_gpus
from longspec.machine.memory import PRECISION_BYTES, ModelSize
from longspec.project.stageview import StageView


def gpu_free() -> int | None:
    """Free memory of the first visible GPU (the one `eval` decodes on); None when unknown."""
    gpus = detect_gpus()
    return gpus[0].free_mib * MIB if gpus and gpus[0].free_mib is not None else None


def run_refusal(run_dir: Path, lengths: str | None, max_new_tokens: int | None, device: str,
                bench: bool) -> tuple[str, str] | None:
    """`longspec eval`'s check of one finished stage before it starts longspec.evaluate: the run's
    training_config.yaml (the target, max_seq_length, precision), --lengths or the default buckets
    (--bench without --lengths: its prompts set them, evaluate checks), the device eval decodes on
    ('auto': a GPU when nvidia-smi lists one). None when it fits or cannot be told here."""
    from longspec.files import yamlio

    try:
        view = StageView.of_run(run_dir)
        max_seq = view.max_seq_length
        buckets = EM.parse_lengths(lengths) if lengths else (None if bench else EM.default_lengths(max_seq))
        size = ModelSize.from_config_json(Path(str(view.target)).expanduser() / "config.json")
    except (OSError, ValueError, TypeError, AttributeError, yamlio.YamlError):
        return None                              # evaluate reports what is wrong
    if not buckets:
        return None
    cuda = device == "cuda" or (device == "auto" and bool(detect_gpus()))
    available = gpu_free() if cuda else EM.cpu_available()
    if available is None:
        return None
    nbytes = PRECISION_BYTES[view.precision] if cuda else 4    # eval: fp32 on the CPU
    return EM.refusal(size, buckets, EM.default_max_new(max_seq, max_new_tokens), nbytes, available,
                   "the GPU eval decodes on (free memory)" if cuda else "this machine's CPU memory (MemAvailable)", cuda)
