"""DeepSeek-V3.2 for cpkv's context-parallel prefill: HF checkpoint loading and the per-layer math.

See docs/models.md. The attention core (indexer scoring, top-k, sparse MLA) is the driver's; this package
gives it the inputs (:class:`AttentionInputs`) and takes its output back.
"""

from .config import DeepseekV32Config, RopeConfig
from .deepseek_v4 import DeepseekV4
from .deepseek_v32 import AttentionInputs, DeepseekV32
from .errors import ModelLoadError
from .tiny import TINY_DEFAULTS, load_model, resolve_checkpoint, write_tiny_checkpoint
from .v4_config import DeepseekV4Config
from .v4_weights import read_v4_config

__all__ = [
    "TINY_DEFAULTS",
    "AttentionInputs",
    "DeepseekV4",
    "DeepseekV4Config",
    "DeepseekV32",
    "DeepseekV32Config",
    "ModelLoadError",
    "RopeConfig",
    "load_model",
    "read_v4_config",
    "resolve_checkpoint",
    "write_tiny_checkpoint",
]
