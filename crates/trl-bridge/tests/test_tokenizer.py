"""``processing_class`` as TRL users pass it: a tokenizer from the Hub cache, one whose chat
template was edited in memory, a processor; the engine renders prompts as the object's own
``apply_chat_template`` does. What cannot be used is refused at construction."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from conftest import take

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def prompt_ids(sample: Any) -> list[int]:
    """The ids before the first sampled one: the rendered prompt of a one-turn rollout."""
    mask = sample.completion_mask.tolist()
    assert 1 in mask, "the sample has sampled ids"
    return sample.input_ids[: mask.index(1)].tolist()


def expected_ids(tokenizer: Any, sample: Any, **options: Any) -> list[int]:
    return tokenizer.apply_chat_template(
        sample.prompt, tokenize=True, add_generation_prompt=True, return_dict=False, **options
    )


def rolled_out(simulator, make_worker, processing_class: Any) -> list[Any]:
    worker = make_worker(simulator(), processing_class=processing_class, epochs=1, dataset=[
        {"prompt": "What is 2 + 3?"},
        {"prompt": "Name a prime larger than 10."},
    ])
    worker.start()
    return take(worker, 8)


@pytest.fixture
def hub_tokenizer(tokenizer_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fixture Qwen3 tokenizer as `AutoTokenizer.from_pretrained("Org/Name")` loads it from
    a Hugging Face cache: `name_or_path` is the Hub id, no folder."""
    cache = tmp_path / "hub"
    repo = cache / "models--Org--Name"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, snapshot / name)
    # AutoTokenizer reads the model's config.json first, as a Hub repository has one.
    (snapshot / "config.json").write_text('{"model_type": "qwen3"}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    # cache_dir= rather than HF_HUB_CACHE, which huggingface_hub reads once at import.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained("Org/Name", cache_dir=cache, local_files_only=True)
    assert tokenizer.name_or_path == "Org/Name" and not Path("Org/Name").exists()
    return tokenizer


def test_a_tokenizer_loaded_by_hub_id_renders_prompts_as_it_does(simulator, make_worker, hub_tokenizer) -> None:
    samples = rolled_out(simulator, make_worker, hub_tokenizer)
    assert {s.prompt[0]["content"] for s in samples} == {"What is 2 + 3?", "Name a prime larger than 10."}
    for sample in samples:
        assert prompt_ids(sample) == expected_ids(hub_tokenizer, sample)


def test_a_chat_template_edited_in_memory_is_the_one_the_engine_renders(
    simulator, make_worker, tokenizer_dir
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    # An expression: Qwen3's template starts with `{%-`, which would trim a leading text.
    tokenizer.chat_template = "{{ 'EDITED IN MEMORY ' }}" + tokenizer.chat_template
    samples = rolled_out(simulator, make_worker, tokenizer)
    for sample in samples:
        ids = prompt_ids(sample)
        assert ids == expected_ids(tokenizer, sample)
        assert tokenizer.decode(ids).startswith("EDITED IN MEMORY <|im_start|>user\n")


def test_named_templates_and_special_tokens_in_memory_are_used(simulator, make_worker, tokenizer_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    default = "{{ 'NAMED ' + pad_token + eos_token }}" + tokenizer.chat_template
    tokenizer.chat_template = {"default": default, "rag": "unused"}
    samples = rolled_out(simulator, make_worker, tokenizer)
    for sample in samples:
        assert prompt_ids(sample) == expected_ids(tokenizer, sample)
        assert tokenizer.decode(prompt_ids(sample)).startswith("NAMED <|endoftext|><|im_end|><|im_start|>")


class Processor:
    """What the worker reads of a transformers processor: its tokenizer and its own template."""

    def __init__(self, tokenizer: Any, chat_template: str | None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template


def test_a_processor_s_tokenizer_is_used_with_the_processor_s_template(simulator, make_worker, tokenizer_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    template = "{{ 'PROCESSOR ' }}" + tokenizer.chat_template
    samples = rolled_out(simulator, make_worker, Processor(tokenizer, template))
    for sample in samples:
        # transformers' ProcessorMixin.apply_chat_template renders the processor's template.
        assert prompt_ids(sample) == expected_ids(tokenizer, sample, chat_template=template)


def test_a_processor_without_a_template_of_its_own_uses_its_tokenizer_s(
    simulator, make_worker, hub_tokenizer
) -> None:
    samples = rolled_out(simulator, make_worker, Processor(hub_tokenizer, None))
    for sample in samples:
        assert prompt_ids(sample) == expected_ids(hub_tokenizer, sample)


class SlowTokenizer:
    """A transformers tokenizer without a fast backend, loaded by Hub id."""

    name_or_path = "Org/Name"
    chat_template = "{{ messages }}"


def no_template(tokenizer_dir: str) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = None
    return tokenizer


BAD_PROCESSING_CLASSES = [
    ("object", lambda d, t: object(), TypeError, "processing_class must be a transformers tokenizer"),
    ("processor of nothing", lambda d, t: Processor(42, None), TypeError, "processing_class must be"),
    ("slow", lambda d, t: SlowTokenizer(), TypeError, r"slow tokenizer .*use_fast=True"),
    ("no template", lambda d, t: no_template(d), ValueError, "processing_class: the tokenizer has no chat_template"),
    ("template of a number", lambda d, t: Processor(AutoTokenizer.from_pretrained(d), 42), TypeError,
     "processing_class: chat_template must be"),
    ("folder without tokenizer.json", lambda d, t: t, ValueError, "is not a folder with a tokenizer.json"),
    ("None", lambda d, t: None, ValueError, "processing_class: give the tokenizer"),
]


@pytest.mark.parametrize(("make", "error", "message"), [b[1:] for b in BAD_PROCESSING_CLASSES],
                         ids=[b[0] for b in BAD_PROCESSING_CLASSES])
def test_a_processing_class_that_cannot_be_used_is_refused_naming_it(
    simulator, make_worker, tokenizer_dir, tmp_path, make, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        make_worker(simulator(), processing_class=make(tokenizer_dir, tmp_path))
