"""Build tiny random LoRA adapters for the tiny model the end-to-end suite serves (``tiny_model.py``).

Run with the vLLM environment's Python (it has torch and safetensors):
``python tests/e2e/tiny_lora.py OUT_DIR NAME [NAME ...]``. Each adapter is a rank-8 PEFT LoRA on every
layer's ``q_proj`` and ``v_proj``, seeded by its name (``adapter_config.json`` and
``adapter_model.safetensors``: A is rank x in, B is out x rank), as ``/work/shared/specs/lora-on-vllm-cpu.md``
checked them on vLLM 0.32's CPU build. No peft needed.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

from tiny_model import ATTENTION_HEADS, HIDDEN_SIZE, KV_HEADS, LAYERS

RANK = 8


def build(out_dir: Path, name: str) -> Path:
    import torch
    from safetensors.torch import save_file

    head_dim = HIDDEN_SIZE // ATTENTION_HEADS
    outputs = {"q_proj": ATTENTION_HEADS * head_dim, "v_proj": KV_HEADS * head_dim}
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tensors = {}
    for layer in range(LAYERS):
        for module, out_features in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, HIDDEN_SIZE, generator=generator) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, RANK, generator=generator) * 0.05
    path = out_dir / name
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": list(outputs), "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
        "use_rslora": False, "use_dora": False, "base_model_name_or_path": "tiny"}))
    return path


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: tiny_lora.py OUT_DIR NAME [NAME ...]")
    for adapter in sys.argv[2:]:
        print(build(Path(sys.argv[1]), adapter))
