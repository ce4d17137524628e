"""Builds a tiny mixture-of-experts model with random weights, for routing replay's real-server test.

Usage: python build_moe.py TOKENIZER_DIR OUT_DIR

A Qwen3-MoE of 2 layers, each with 8 experts of which the router picks 2, head_dim 64 (vLLM's
CPU attention needs it) and Qwen3's vocabulary, its weights drawn from a fixed seed and saved
in float32 (a router whose logits tie under bf16 rounding would choose differently in a
batched decode and a re-score), with Qwen3's tokenizer and chat template from TOKENIZER_DIR.
Its answers are noise; its routing is a real router's.
"""

import shutil
import sys
from pathlib import Path


def main():
    tokenizer_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        # Larger than the default init, so that the router's logits are far apart.
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.05)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    experts = config.num_experts
    print(f"saved a {config.num_hidden_layers}-layer Qwen3-MoE (top {config.num_experts_per_tok} of {experts}) to {out}")


if __name__ == "__main__":
    main()
