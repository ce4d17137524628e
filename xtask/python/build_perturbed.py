"""Builds a second version of a model's weights, for the weight-update test on the real server.

Usage: python build_perturbed.py MODEL_DIR OUT_DIR

Every parameter of MODEL_DIR moved by Gaussian noise of a tenth of its own standard deviation,
drawn from a fixed seed, saved with the model's tokenizer files: what a trainer's step does to
the weights, large enough that each token's logprob under one version tells it from the other.
"""

import shutil
import sys
from pathlib import Path


def main():
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.numel() > 1:
                parameter.add_(torch.randn_like(parameter) * 0.1 * parameter.float().std().to(parameter.dtype))
    model.save_pretrained(out)
    for file in source.iterdir():
        if file.suffix in (".json", ".jinja", ".txt") and not (out / file.name).exists():
            shutil.copy(file, out / file.name)
    print(f"saved the perturbed weights of {source} to {out}")


if __name__ == "__main__":
    main()
