"""``processing_class`` as the engine takes it: the folder of a path, or a tokenizer object's
parts as they are in memory (its ``tokenizer.json``, special tokens and chat template), so
that a tokenizer loaded from the Hub cache or with an edited ``chat_template`` renders as
its own ``apply_chat_template`` does."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# The special tokens transformers passes to chat templates (its ``special_tokens_map``).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def tokenizer_source(processing_class: Any) -> str | tuple[str, str]:
    """What ``Engine(tokenizer=...)`` loads: a folder path (a ``str``), or
    ``(tokenizer_json, config_json)`` for a tokenizer object, whatever its ``name_or_path``.

    - a path: the folder, which must hold a ``tokenizer.json``;
    - a transformers tokenizer: its ``backend_tokenizer`` (a fast tokenizer), its special
      tokens and its current ``chat_template`` (a string, or a dict of named templates);
    - a processor (an object with a ``.tokenizer`` and no ``backend_tokenizer``): its
      tokenizer, with the processor's own ``chat_template`` when it has one (the one its
      ``apply_chat_template`` renders), else the tokenizer's.
    """
    if processing_class is None:
        raise ValueError("processing_class: give the tokenizer (or the folder it was saved to)")
    if isinstance(processing_class, (str, os.PathLike)):
        return _folder(Path(processing_class))
    tokenizer, template = processing_class, None
    if getattr(processing_class, "backend_tokenizer", None) is None and hasattr(processing_class, "tokenizer"):
        tokenizer, template = processing_class.tokenizer, getattr(processing_class, "chat_template", None)
    name = getattr(tokenizer, "name_or_path", None)
    folder = Path(name) if isinstance(name, str) and name and (Path(name) / "tokenizer.json").is_file() else None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    is_transformers = hasattr(tokenizer, "chat_template")
    if backend is not None:
        tokenizer_json = backend.to_str()
    elif folder is not None and not is_transformers:
        return str(folder)  # an object naming its folder, nothing else in memory to honour
    elif folder is not None:
        # A slow tokenizer saved with its fast tokenizer.json beside it.
        tokenizer_json = (folder / "tokenizer.json").read_text(encoding="utf-8")
    elif is_transformers:
        raise TypeError(
            f"processing_class: {type(tokenizer).__name__} is a slow tokenizer (it has no backend_tokenizer); "
            "the engine needs a fast one: load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
        )
    else:
        raise TypeError(
            "processing_class must be a transformers tokenizer, a processor with a .tokenizer, or the folder a "
            f"tokenizer was saved to, got {type(processing_class).__name__}"
        )
    config: dict[str, Any] = _special_tokens(tokenizer)
    config["chat_template"] = _template(template if template is not None else tokenizer.chat_template)
    return tokenizer_json, json.dumps(config)


def _folder(path: Path) -> str:
    if not (path / "tokenizer.json").is_file():
        raise ValueError(
            f"processing_class: {str(path)!r} is not a folder with a tokenizer.json; pass the tokenizer itself, "
            "or the folder it was saved to with save_pretrained(folder)"
        )
    return str(path)


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    """The special tokens the template sees, as ``special_tokens_map`` has them."""
    special = getattr(tokenizer, "special_tokens_map", None)
    if not isinstance(special, dict):
        special = {key: getattr(tokenizer, key, None) for key in _SPECIAL_TOKENS}
    # An AddedToken (older transformers) by its text.
    return {
        key: str(getattr(token, "content", token))
        for key, token in special.items()
        if key in _SPECIAL_TOKENS and token is not None
    }


def _template(template: Any) -> str | list[dict[str, str]]:
    """The chat template as ``tokenizer_config.json`` stores it: a string, or a list of named ones."""
    if isinstance(template, str) and template:
        return template
    if isinstance(template, dict) and template and all(isinstance(t, str) for t in template.values()):
        return [{"name": str(name), "template": t} for name, t in template.items()]
    if not template:
        raise ValueError(
            "processing_class: the tokenizer has no chat_template; set tokenizer.chat_template (the engine renders "
            "every prompt with it)"
        )
    raise TypeError(
        f"processing_class: chat_template must be a string or a dict of named templates, got {type(template).__name__}"
    )
