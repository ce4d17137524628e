"""Builds a reward model's shape from SmolLM2-135M-Instruct, for the real-server test.

Usage: python build_reward_model.py POLICY_DIR OUT_DIR

Loads the policy's Hugging Face folder as a LlamaForSequenceClassification with one class
(the architecture of most reward models vLLM's pooling runner serves), its score head drawn
from a fixed seed, and saves it with the policy's tokenizer and chat template. The scores it
gives mean nothing; its architecture, template and answers are a real reward model's.
"""

import shutil
import sys


def main():
    source, out = sys.argv[1], sys.argv[2]
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification.from_pretrained(source, num_labels=1, dtype=torch.bfloat16)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    shutil.copy(f"{source}/chat_template.jinja", out)
    print(f"saved {model.config.architectures} with a score head of {tuple(model.score.weight.shape)} to {out}")


if __name__ == "__main__":
    main()
