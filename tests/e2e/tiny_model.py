"""Build the tiny random-weight Llama the end-to-end suite serves with real vLLM.

Run with the vLLM environment's Python (it has torch and transformers):
``python tests/e2e/tiny_model.py TOKENIZER_DIR OUT_DIR``. The tokenizer is the one bundled for the
simulated pods, copied as is, so the gateway's local tokenizer and the engine's are the same files. The
weights are seeded: the same torch version builds the same model. Output is written to a temporary
directory and renamed into place, so an interrupted build never leaves a half model behind.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

# head_dim must be 64 or more: the CPU attention kernel rejects 16.
HIDDEN_SIZE = 256
ATTENTION_HEADS = 4
KV_HEADS = 2
LAYERS = 2
MAX_POSITIONS = 4096
SEED = 20261122


def build(tokenizer_dir: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(tokenizer_dir / name, tmp / name)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=HIDDEN_SIZE, intermediate_size=4 * HIDDEN_SIZE,
            num_hidden_layers=LAYERS, num_attention_heads=ATTENTION_HEADS, num_key_value_heads=KV_HEADS,
            max_position_embeddings=MAX_POSITIONS, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
        )
        torch.manual_seed(SEED)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: tiny_model.py TOKENIZER_DIR OUT_DIR")
    build(Path(sys.argv[1]), Path(sys.argv[2]))
