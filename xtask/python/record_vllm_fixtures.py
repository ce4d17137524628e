"""Records real vLLM request/response bodies as test fixtures for crates/vllm-client.

Usage: python3 record_vllm_fixtures.py BASE_URL OUT_DIR

Needs a running server from `cargo xtask vllm-cpu` (SmolLM2-135M-Instruct, max_model_len
2048, VLLM_SERVER_DEV_MODE=1). Standard library only. For each exchange it writes
NAME.request.json (the body exactly as sent, when there is one) and NAME.response.json (the
body as received), and an index.json listing method, path and HTTP status of each.
"""

import json
import sys
import threading
import time
import urllib.error
import urllib.request

MODEL = "SmolLM2-135M-Instruct"


def dump(value, indent=0):
    """Pretty JSON, but lists of plain numbers/strings on one line to keep files small."""
    pad = "  " * indent
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f'{pad}  {json.dumps(k)}: {dump(v, indent + 1)}' for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list):
        if all(not isinstance(v, (dict, list)) for v in value):
            return json.dumps(value, ensure_ascii=False)
        items = [f"{pad}  {dump(v, indent + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(value, ensure_ascii=False)


class Recorder:
    def __init__(self, base, out):
        self.base = base.rstrip("/")
        self.out = out
        self.index = []

    def call(self, method, path, body=None, timeout=300):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def record(self, name, method, path, body=None, expect=200):
        status, raw = self.call(method, path, body)
        return self.save(name, method, path, body, status, raw, expect)

    def save(self, name, method, path, body, status, raw, expect):
        if status != expect:
            sys.exit(f"{name}: {method} {path} gave {status}, expected {expect}: {raw[:500]!r}")
        if body is not None:
            self.write(f"{name}.request.json", body)
        parsed = json.loads(raw) if raw.strip() else None
        if parsed is not None:
            self.write(f"{name}.response.json", parsed)
        self.index.append({"name": name, "method": method, "path": path, "status": status,
                           "request": body is not None, "response": parsed is not None})
        print(f"{name}: {method} {path} -> {status}")
        return parsed

    def write(self, filename, value):
        with open(f"{self.out}/{filename}", "w", encoding="utf-8") as file:
            file.write(dump(value) + "\n")


def main():
    base, out = sys.argv[1], sys.argv[2]
    r = Recorder(base, out)

    r.record("health", "GET", "/health")
    r.record("models", "GET", "/v1/models")

    tokens = r.record("tokenize", "POST", "/tokenize", {
        "model": MODEL, "prompt": "The capital of France is", "add_special_tokens": False,
    })["tokens"]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    chat_tokens = r.record("tokenize_chat", "POST", "/tokenize", {
        "model": MODEL, "messages": chat, "add_generation_prompt": True,
    })["tokens"]
    r.record("detokenize", "POST", "/detokenize", {"model": MODEL, "tokens": tokens})

    completion = {
        "model": MODEL, "prompt": tokens, "n": 1, "max_tokens": 8, "temperature": 1.0,
        "top_p": 1.0, "seed": 1234, "logprobs": 0, "return_token_ids": True,
        "add_special_tokens": False,
    }
    r.record("completion_token_ids", "POST", "/v1/completions", completion)
    r.record("completion_tokens_as_token_ids", "POST", "/v1/completions",
             {**completion, "return_tokens_as_token_ids": True})
    r.record("completion_top_logprobs", "POST", "/v1/completions",
             {**completion, "logprobs": 2, "max_tokens": 3})
    r.record("completion_prompt_logprobs", "POST", "/v1/completions",
             {**completion, "prompt_logprobs": 0, "max_tokens": 2})
    # Greedy on the chat-rendered prompt: ends on the model's EOS (finish_reason "stop").
    r.record("completion_stop", "POST", "/v1/completions",
             {**completion, "prompt": chat_tokens, "max_tokens": 32, "temperature": 0.0})

    tool_prompt = r.call("POST", "/tokenize", {
        "model": MODEL, "add_generation_prompt": True, "messages": [
            {"role": "system", "content": "You can call the tool add(a, b). Answer with "
             "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": A, \"b\": B}}</tool_call>."},
            {"role": "user", "content": "What is 3 + 4?"},
        ]})
    tool_tokens = json.loads(tool_prompt[1])["tokens"]
    r.record("completion_structured_tool_call", "POST", "/v1/completions", {
        **completion, "prompt": tool_tokens, "max_tokens": 64, "temperature": 0.0,
        "structured_outputs": {"regex": "<tool_call>\\{\"name\": \"add\", \"arguments\": "
                               "\\{\"a\": [0-9], \"b\": [0-9]\\}\\}</tool_call>"},
    })

    r.record("chat_completion", "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": chat, "max_tokens": 16, "temperature": 0.0, "seed": 1234,
        "logprobs": True, "return_token_ids": True,
    })
    r.record("chat_completion_tokens_as_token_ids", "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": chat, "max_tokens": 4, "temperature": 0.0, "seed": 1234,
        "logprobs": True, "top_logprobs": 1, "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    })

    long_ids = (tokens * 500)
    r.record("completion_prompt_too_long", "POST", "/v1/completions",
             {**completion, "prompt": long_ids[:2049]}, expect=400)
    r.record("completion_prompt_fills_context", "POST", "/v1/completions",
             {**completion, "prompt": long_ids[:2048]}, expect=400)
    r.record("completion_clipped_to_context", "POST", "/v1/completions",
             {**completion, "prompt": long_ids[:2044], "max_tokens": 100})
    r.record("completion_unknown_model", "POST", "/v1/completions",
             {**completion, "model": "no-such-model"}, expect=404)
    r.record("completion_bad_max_tokens", "POST", "/v1/completions",
             {**completion, "max_tokens": -1}, expect=400)

    # /pause?mode=abort while a completion runs: the completion ends with HTTP 200 and
    # finish_reason "abort"; a request sent while paused waits until /resume.
    r.record("is_paused_before", "GET", "/is_paused")
    long_run = {**completion, "max_tokens": 400, "ignore_eos": True}
    result = {}

    def run_long():
        result["status"], result["raw"] = r.call("POST", "/v1/completions", long_run)

    thread = threading.Thread(target=run_long)
    thread.start()
    time.sleep(3.0)
    r.record("pause_abort", "POST", "/pause?mode=abort")
    thread.join(timeout=120)
    if thread.is_alive():
        sys.exit("the in-flight completion did not end after /pause?mode=abort")
    r.save("completion_aborted_by_pause", "POST", "/v1/completions", long_run,
           result["status"], result["raw"], 200)
    r.record("is_paused_while_paused", "GET", "/is_paused")

    waited = {}

    def run_while_paused():
        started = time.monotonic()
        waited["status"], waited["raw"] = r.call("POST", "/v1/completions", completion)
        waited["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=run_while_paused)
    thread.start()
    time.sleep(2.0)
    still_waiting = thread.is_alive()
    r.record("resume", "POST", "/resume")
    thread.join(timeout=120)
    r.save("completion_sent_while_paused", "POST", "/v1/completions", completion,
           waited["status"], waited["raw"], 200)
    print(f"completion sent while paused: still waiting after 2 s: {still_waiting}; "
          f"answered after {waited['seconds']:.1f} s")
    r.record("is_paused_after_resume", "GET", "/is_paused")

    r.write("index.json", r.index)


main()
