"""What the real-server tests add to vLLM 0.32 on CPU, loaded from PYTHONPATH.

- `WeightReload`, a worker extension (`--worker-extension-cls async_grpo_vllm_ext.WeightReload`):
  `POST /collective_rpc {"method": "reload_weights_exactly", "kwargs": {"weights_path": DIR}}`
  loads DIR's weights in place, as vLLM's own `reload_weights` does, then packs the output
  layer again. On CPU vLLM keeps a packed copy of `lm_head` for its GEMM; a model that ties
  `lm_head` to the embeddings has no `lm_head` tensor in its checkpoint, so `reload_weights`
  leaves that copy at the old weights and the server then answers with a mix of both.
"""


class WeightReload:
    def reload_weights_exactly(self, weights_path):
        self.reload_weights(weights_path=weights_path)
        head = getattr(self.model_runner.get_model(), "lm_head", None)
        method = getattr(head, "quant_method", None)
        if method is None:
            return "reloaded"
        method.process_weights_after_loading(head)
        return "reloaded; lm_head packed again"
