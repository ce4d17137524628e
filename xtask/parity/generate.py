"""Expected outputs of transformers' apply_chat_template, for rollout-core's parity test.

usage: python generate.py CACHE CASES OUT

Renders every case of CASES (crates/rollout-core/tests/parity/cases.json) with every
template in CACHE/templates/*.jinja and with the tokenizers' own templates
("qwen3-tokenizer", "llama31-tokenizer"), through the real Llama-3.1 tokenizer in
CACHE/llama31 for the families CASES lists as Llama-3 ones and the real Qwen3 tokenizer in
CACHE/qwen3 for the others, and writes the text, the ids, or the error of each to OUT. The clock that templates read
(strftime_now) is frozen at 2026-01-15 12:30:45 so that the output does not depend on the
day it was made; nothing else of transformers is changed.
"""

import datetime
import json
import os
import sys

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jinja2  # noqa: E402
import transformers  # noqa: E402
import transformers.utils.chat_template_utils as chat_template_utils  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402


class FrozenClock(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime.datetime(2026, 1, 15, 12, 30, 45)


chat_template_utils.datetime = FrozenClock


def main():
    cache, cases_path, out_path = sys.argv[1:4]
    with open(cases_path, encoding="utf-8") as f:
        spec = json.load(f)
    tokenizers = {
        "qwen3": AutoTokenizer.from_pretrained(os.path.join(cache, "qwen3")),
        "llama31": AutoTokenizer.from_pretrained(os.path.join(cache, "llama31")),
    }
    llama = set(spec["llama31_families"])
    families = {"qwen3-tokenizer": None, "llama31-tokenizer": None}
    template_dir = os.path.join(cache, "templates")
    for name in sorted(os.listdir(template_dir)):
        if name.endswith(".jinja"):
            with open(os.path.join(template_dir, name), encoding="utf-8") as f:
                families[name] = f.read()
    results = {}
    for family, source in families.items():
        tokenizer = tokenizers["llama31" if family in llama else "qwen3"]
        results[family] = {}
        for case in spec["cases"]:
            kwargs = dict(case.get("kwargs", {}))
            options = dict(
                tools=spec["tools"] if case.get("tools") else None,
                add_generation_prompt=case.get("add_generation_prompt", False),
                continue_final_message=case.get("continue_final_message", False),
                chat_template=source,
            )
            try:
                text = tokenizer.apply_chat_template(case["messages"], tokenize=False, **options, **kwargs)
                ids = tokenizer.apply_chat_template(case["messages"], tokenize=True, return_dict=True, **options, **kwargs)["input_ids"]
                results[family][case["name"]] = {"text": text, "ids": list(ids)}
            except Exception as error:  # the template refused the case: Rust must refuse it too
                results[family][case["name"]] = {"error": f"{type(error).__name__}: {error}"}
    out = {
        "generator": {"transformers": transformers.__version__, "jinja2": jinja2.__version__, "clock": "2026-01-15T12:30:45"},
        "results": results,
    }
    tmp = out_path + ".partial"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1, sort_keys=True)
    os.replace(tmp, out_path)
    print(f"parity: {len(families)} templates x {len(spec['cases'])} cases -> {out_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
