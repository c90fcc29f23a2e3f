"""``moe_config.tuned``: SGLang 0.5.10.post1 ships no Triton fused-MoE tile configs for the Triton it runs with (3.6)
and falls back to configs tuned for Triton 3.2. Where this package ships a config measured on the GPU for the running
Triton (``sglang_mxfp8/sglang/moe_configs/``: a tile sweep of SGLang's block-FP8 fused MoE on the H200; SGLang's own
``tuning_fused_moe_triton.py`` writes such files), it is used instead; a config SGLang ships for the running Triton,
``SGLANG_MOE_CONFIG_DIR``, deterministic inference and launches that are not MXFP8 keep SGLang's choice."""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

from ...compat import served_args
from ..launch import LaunchConfig
from ..patching import replace
from . import MOE_CONFIG

logger = logging.getLogger("sglang_mxfp8")

TUNED_MOE_CONFIGS = Path(__file__).resolve().parents[1] / "moe_configs"


def tuned_moe_config(file_name: str, triton_version: str, sglang_config_dir: str) -> Optional[Path]:
    """Our measured config for SGLang's config ``file_name``, unless SGLang has one for this Triton."""
    version_dir = f"triton_{triton_version.replace('.', '_')}"
    ours = TUNED_MOE_CONFIGS / version_dir / file_name
    if not ours.is_file() or os.path.exists(os.path.join(sglang_config_dir, "configs", version_dir, file_name)):
        return None
    return ours


def with_tuned_moe_configs(original, moe_config: ModuleType):
    """SGLang's ``get_moe_configs`` (of module ``moe_config``), answering from our configs where they apply."""

    @functools.lru_cache
    @functools.wraps(original)
    def get_moe_configs(E, N, dtype, block_n=0, block_k=0, per_channel_quant=False, down_moe=False):
        args = served_args()
        if (args is not None and "SGLANG_MOE_CONFIG_DIR" not in os.environ and not args.enable_deterministic_inference
                and LaunchConfig.from_server_args(args).is_mxfp8()):
            name = moe_config.get_config_file_name(E, N, dtype, [block_n, block_k], per_channel_quant,
                                                   down_moe=down_moe)
            version = moe_config.triton.__version__
            ours = tuned_moe_config(name, version, os.path.dirname(os.path.realpath(moe_config.__file__)))
            if ours is not None:
                logger.info("Using MoE kernel config from %s (measured with Triton %s)", ours, version)
                return {int(m): cfg for m, cfg in json.loads(ours.read_text()).items()}
        return original(E, N, dtype, block_n, block_k, per_channel_quant, down_moe)

    return get_moe_configs


def use_tuned_configs() -> None:
    """Patches the config module once SGLang has imported it (the startup hook runs this then). Importing it here
    instead would run SGLang's MoE package imports in the middle of another of its imports (a circular import on
    0.5.23); a SGLang that keeps it elsewhere uses its own configs."""
    moe_config = next((sys.modules[name] for name in MOE_CONFIG if name in sys.modules), None)
    if moe_config is None:
        return
    replace(moe_config, "get_moe_configs", "moe_config.tuned",
            lambda original: with_tuned_moe_configs(original, moe_config))
