"""Altered copies of HF-format checkpoints, for tests of what a loader must refuse or accept."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["copy_checkpoint"]


def copy_checkpoint(src: Path, dst: Path,
                    mutate_cfg: Callable[[dict[str, Any]], None] | None = None,
                    mutate_state: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Copy the checkpoint directory ``src`` (config.json + model.safetensors) to a new ``dst``,
    with ``mutate_cfg`` applied to the config dict and ``mutate_state`` to the tensor dict on the
    way; returns ``dst``."""
    from safetensors import torch as safetensors_torch

    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if mutate_cfg:
        mutate_cfg(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    state = safetensors_torch.load_file(src / "model.safetensors")
    if mutate_state:
        mutate_state(state)
    safetensors_torch.save_file(state, str(dst / "model.safetensors"))
    return dst
