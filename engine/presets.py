"""The model presets' shapes as plain numbers, and the hidden size of the model a config names.

    PRESETS["150m"]["hidden_size"]          # 1024
    hidden_size(cfg.model)                  # the preset's, or a local folder's config.json (model.path)

No torch and no transformers here: engine/model.py builds its transformers config from this table, and the
console's `python -m console.recipes deepspeed` sizes DeepSpeed's buckets from `hidden_size()` without importing
either (docs/architecture.md: the console never imports torch-side engine code).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.config import ModelConfig

PRESETS: dict[str, dict[str, Any]] = {
    "debug": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4),
    "15m": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                num_key_value_heads=6),
    "150m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                 num_key_value_heads=16),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4),
}
# the names transformers configs give the model's width (LlamaConfig: hidden_size; GPT-2: n_embd; T5: d_model)
HIDDEN_SIZE_KEYS = ("hidden_size", "n_embd", "d_model")


def config_json(path: str) -> Path:
    """The config.json of a local transformers folder (model.path), or a ValueError that names what is missing."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"model.path: {folder} has no config.json (expected a local transformers folder)")
    return folder / "config.json"


def hidden_size(cfg: ModelConfig) -> int | None:
    """The model's hidden size: the preset's, or what the folder's config.json says (None where it names none)."""
    if cfg.path is None:
        return PRESETS[cfg.preset]["hidden_size"]
    raw = json.loads(config_json(cfg.path).read_text())
    return next((raw[k] for k in HIDDEN_SIZE_KEYS if isinstance(raw.get(k), int)), None)
