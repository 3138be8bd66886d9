"""Our light tokenizer (tokenizers + Jinja) against transformers', which clients no longer import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from chatapp.engine import launch
from chatapp.engine import tokenizer as tokenizer_module
from chatapp.engine.tokenizer import (
    ChatFormatError,
    TextTokenizer,
    Tokenizer,
    clients_build_tokenizer,
    gguf_tokenizer_cache,
    load_hf_tokenizer,
    prepare_tokenizer_files,
    start_tokenizer_build,
)
from chatapp.store import bundled_gguf_path

TEXTS = [
    "Hello there!",
    "  leading spaces and trailing  ",
    "Ünïcödé — 漢字 and 🎉 emoji",
    "def f(x):\n\treturn x ** 2\n",
    "It's a test , isn't it ? Yes !",
    "<|im_start|>user\nliteral specials<|im_end|>",
    "",
    "a" * 300,
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": "Rayleigh scattering."},
        {"role": "user", "content": "And sunsets?"},
    ],
    [{"role": "user", "content": "Ünïcödé 🎉\nsecond line"}],
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Ours and transformers' tokenizer of the bundled GGUF file."""
    return TextTokenizer(prepare_tokenizer_files(bundled_gguf_path())), load_hf_tokenizer(bundled_gguf_path())


def tokenizer_with_template(hf, directory: Path, template: str) -> Path:  # noqa: ANN001
    """The bundled tokenizer's files in ``directory``, with ``template`` as its chat template."""
    hf.save_pretrained(str(directory))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    return directory


def test_encode_decode_and_length_match_transformers(pair) -> None:
    ours, hf = pair
    assert len(ours) == len(hf)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    ids = ours.encode("<|im_start|>assistant\nok<|im_end|>")
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True) == "assistant\nok"


def test_chat_template_renders_as_transformers_does(pair) -> None:
    ours, hf = pair
    for messages in CONVERSATIONS:
        for add in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=add) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add
            )


def test_template_features_hub_templates_use(pair, tmp_path: Path) -> None:
    """tojson keeps non-ASCII, loop controls, raise_exception, the generation tag, special tokens, tools."""
    _, hf = pair
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}"
        "{% generation %}[{{ m.role }}] {{ m.content | tojson }}{% endgeneration %}\n{% endfor %}"
        "{% if tools is defined and tools is not none %}TOOLS{% endif %}"
        "{% if add_generation_prompt %}[assistant]{{ eos_token }}{% endif %}"
    )
    directory = tokenizer_with_template(hf, tmp_path / "tok", template)
    ours = TextTokenizer(directory)
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(directory))
    messages = [
        {"role": "system", "content": "skip"},
        {"role": "user", "content": 'naïve "quote" 🎉'},
        {"role": "assistant", "content": "ok"},
    ]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert "naïve" in ours.apply_chat_template(messages)
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_a_client_tokenizer_imports_neither_torch_nor_transformers() -> None:
    prepare_tokenizer_files(bundled_gguf_path())  # what the engine does while it loads
    code = (
        "import sys\nfrom chatapp.engine.tokenizer import Tokenizer\nfrom chatapp.store import bundled_gguf_path\n"
        "t = Tokenizer(bundled_gguf_path())\nids = t.render_chat([{'role': 'user', 'content': 'Hi'}])\n"
        "assert t.decode(ids) and ids\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _no_second_build(path: Path, cache: Path) -> None:
    raise AssertionError(f"{path}'s tokenizer files were built a second time")


def test_the_engine_launch_builds_a_gguf_tokenizer_in_a_process_of_its_own(tmp_path: Path, monkeypatch) -> None:
    """launch.py starts a build that transformers makes (~1.2 s) before the engine loads; the loader then
    finds the files."""
    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(tmp_path / "cache"))
    gguf = _tokenizer_only_gguf(tmp_path / "other-split.gguf", pre="deepseek-llm")  # not ours to build
    cache = gguf_tokenizer_cache(gguf)
    before = set(tokenizer_module._builders)
    launch._start_tokenizer_build(["--config", json.dumps({"model": str(gguf)}), "--runtime-dir", str(tmp_path)])
    started = [b for b in tokenizer_module._builders if b not in before]
    assert len(started) == 1, "the launch started no build"
    assert started[0].wait(timeout=300) == 0
    assert (cache / "tokenizer.json").exists() and (cache / "tokenizer_config.json").exists()
    build = tokenizer_module._build_tokenizer_files
    monkeypatch.setattr(tokenizer_module, "_build_tokenizer_files", _no_second_build)
    assert prepare_tokenizer_files(gguf) == cache  # the loader's call: found, not built again
    assert start_tokenizer_build(gguf) is None  # nothing left to build
    # That process read the metadata through our reader (no torch); the files are the ones this process
    # builds through transformers' own reader, byte for byte.
    monkeypatch.setattr(tokenizer_module, "_build_tokenizer_files", build)
    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(tmp_path / "in-process"))
    here = prepare_tokenizer_files(gguf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (cache / name).read_bytes() == (here / name).read_bytes(), name


def test_a_byte_level_gguf_tokenizer_gets_no_build_process(tmp_path: Path, monkeypatch) -> None:
    """Ours builds it in ~0.2 s where a client first asks: a process of its own would only add a Python start
    beside the weights' load. The first Tokenizer builds it once, in memory, and writes the files from that
    build only when asked (save_files: clients ask as they close, off their start's path); they read back as
    the same tokenizer."""
    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(tmp_path / "cache"))
    gguf = bundled_gguf_path()
    cache = gguf_tokenizer_cache(gguf)
    before = set(tokenizer_module._builders)
    assert start_tokenizer_build(gguf) is None
    launch._start_tokenizer_build(["--config", json.dumps({"model": str(gguf)}), "--runtime-dir", str(tmp_path)])
    assert set(tokenizer_module._builders) == before and not cache.exists()

    read_back = TextTokenizer.__init__

    def no_reading_back(self, directory: Path) -> None:  # noqa: ANN001
        raise AssertionError(f"the build read {directory} back")

    monkeypatch.setattr(TextTokenizer, "__init__", no_reading_back)
    fresh = Tokenizer(gguf)
    monkeypatch.setattr(TextTokenizer, "__init__", read_back)
    assert not cache.exists(), "the build wrote its files on the start's path"
    fresh.save_files()
    assert (cache / "tokenizer.json").exists()
    monkeypatch.setattr(tokenizer_module, "save_built_tokenizer", lambda *_: pytest.fail("saved twice"))
    fresh.save_files()  # once done, a no-op
    files = TextTokenizer(cache)
    assert fresh.hf.backend.to_str() == files.backend.to_str()
    assert (fresh.hf.chat_template, fresh.hf.special_tokens) == (files.chat_template, files.special_tokens)
    for text in TEXTS:
        assert fresh.encode(text) == files.encode(text), text
    for conversation in CONVERSATIONS:
        assert fresh.render_chat(conversation) == Tokenizer(gguf).render_chat(conversation)


def test_the_tokenizer_build_process_imports_no_numpy(tmp_path: Path) -> None:
    """The build runs beside the engine's first load: numpy's import and its OpenBLAS threads (they spin
    between calls) cost that load's cores ~0.15 s of CPU and the build needs none of it."""
    code = (
        "import runpy, sys\n"
        "try:\n"
        "    runpy.run_module('chatapp.engine.tokenizer', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        "print(sorted(m for m in ('numpy', 'torch', 'transformers') if m in sys.modules))"
    )
    env = {**os.environ, "CHATAPP_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code, str(bundled_gguf_path())], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    assert list(tmp_path.glob("tokenizers/*/tokenizer.json")), "the build wrote no tokenizer.json"


def test_a_tokenizer_build_waits_for_the_one_under_way(tmp_path: Path, monkeypatch) -> None:
    """The loader's prepare_tokenizer_files waits for another process's build (the lock), then uses its files."""
    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(tmp_path / "cache"))
    gguf = bundled_gguf_path()
    cache = gguf_tokenizer_cache(gguf)
    build = tokenizer_module._build_tokenizer_files
    holding, release = threading.Event(), threading.Event()

    def the_other_build() -> None:  # as the early build does, holding the lock until it is done
        with tokenizer_module._build_lock(cache):
            holding.set()
            release.wait(60)
            build(gguf, cache)

    results: list[object] = []
    other = threading.Thread(target=the_other_build)
    other.start()
    assert holding.wait(60)
    monkeypatch.setattr(tokenizer_module, "_build_tokenizer_files", _no_second_build)

    def loader() -> None:
        try:
            results.append(prepare_tokenizer_files(gguf))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            results.append(exc)

    waiting = threading.Thread(target=loader)
    waiting.start()
    try:
        time.sleep(0.5)  # without the lock, the loader would have found no files and built them by now
        assert results == [], results
    finally:
        release.set()
        other.join(120)
        waiting.join(120)
    assert results == [cache]


def test_render_chat_matches_transformers_ids(pair) -> None:
    _, hf = pair
    tokenizer = Tokenizer(bundled_gguf_path())
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(expected, dict) or hasattr(expected, "keys"):  # transformers 5 returns a BatchEncoding
            expected = expected["input_ids"]
        assert tokenizer.render_chat(messages) == list(expected)


def test_decode_cleans_up_spaces_as_transformers_does_for_a_non_bpe_model(tmp_path: Path) -> None:
    """clean_up_tokenization_spaces applies to WordPiece-style models (transformers skips it for BPE)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, ",": 2, "world": 3, ".": 4, "isn": 5, "'": 6, "t": 7, "it": 8}
    backend = Backend(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    reference = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    reference.save_pretrained(str(tmp_path))
    ours = TextTokenizer(tmp_path)
    ids = ours.encode("hello, world. it isn't", add_special_tokens=False)
    assert ids == reference.encode("hello, world. it isn't", add_special_tokens=False)
    assert ours.decode(ids) == reference.decode(ids) == "hello, world. it isn't"


def test_continue_final_message_renders_the_answer_open(pair) -> None:
    """vLLM's continue_final_message: the last assistant text with no end of turn and no new turn."""
    ours, hf = pair
    tokenizer = Tokenizer(bundled_gguf_path())
    partial = "Rayleigh scattering makes"
    messages = [{"role": "user", "content": "Why is the sky blue?"}, {"role": "assistant", "content": partial}]
    closed = ours.apply_chat_template(messages, add_generation_prompt=False)
    open_text = closed[: closed.rindex(partial) + len(partial)]
    assert open_text.endswith(partial) and closed != open_text  # the template closes the turn; we do not
    ids = tokenizer.render_chat(messages, continue_final_message=True)
    assert ids == ours.encode(open_text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == open_text
    with pytest.raises(ChatFormatError, match="end with an assistant"):
        tokenizer.render_chat(messages[:1], continue_final_message=True)
    # A short answer is found where its turn starts, not inside the end-of-turn marker ("<|im_end|>").
    short = tokenizer.render_chat([messages[0], {"role": "assistant", "content": "im"}], continue_final_message=True)
    assert tokenizer.decode(short, skip_special_tokens=False).endswith("<|im_start|>assistant\nim")
    # The answer's own trailing space is where the model goes on from.
    spaced = tokenizer.render_chat(
        [messages[0], {"role": "assistant", "content": "Rayleigh "}], continue_final_message=True
    )
    assert tokenizer.decode(spaced, skip_special_tokens=False).endswith("assistant\nRayleigh ")


QWEN3_STYLE_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_an_answer_whose_think_block_the_template_moves_is_continued_as_written(pair, tmp_path: Path) -> None:
    """Qwen3's template drops a think block from an answer's content, so the answer as written is not in
    the rendered conversation: continuing it opens the turn after the generation prompt with the text
    exactly as the model wrote it (think block and all), where it once failed."""
    _, hf = pair
    tokenizer = Tokenizer(tokenizer_with_template(hf, tmp_path / "qwen3-style", QWEN3_STYLE_TEMPLATE))
    question = {"role": "user", "content": "Why is the sky blue?"}
    written = "<think>\nShort answer wanted.\n</think>\n\nRayleigh scattering makes"
    ids = tokenizer.render_chat([question, {"role": "assistant", "content": written}], continue_final_message=True)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text == "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n" + written
    # An answer the template leaves as it is still opens where the template puts it.
    plain = tokenizer.render_chat([question, {"role": "assistant", "content": "Rayleigh"}], continue_final_message=True)
    assert tokenizer.decode(plain, skip_special_tokens=False).endswith("<|im_start|>assistant\nRayleigh")


# DeepSeek-R1's way: the generation prompt opens the think block, and past answers lose theirs.
R1_STYLE_TEMPLATE = QWEN3_STYLE_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\\n' }}{%- endif %}", "{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("opener", ["<think>\n", ""])
def test_a_think_block_the_prompt_opened_is_not_opened_twice_when_continued(pair, tmp_path: Path, opener: str) -> None:
    """Where the generation prompt already opens the think block, an answer kept with its opener (as
    the model's reasoning is shown) goes on after the prompt's opener, not after a second one."""
    _, hf = pair
    tokenizer = Tokenizer(tokenizer_with_template(hf, tmp_path / "r1-style", R1_STYLE_TEMPLATE))
    question = {"role": "user", "content": "Why is the sky blue?"}
    written = opener + "Short answer wanted.\n</think>\n\nRayleigh scattering makes"
    ids = tokenizer.render_chat([question, {"role": "assistant", "content": written}], continue_final_message=True)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text == (
        "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n<think>\n"
        "Short answer wanted.\n</think>\n\nRayleigh scattering makes"
    )


# -- byte-level GGUF tokenizers written without transformers (gguf_tokenizer.py) ---------------------


def _tokenizer_only_gguf(path: Path, **changes: object) -> Path:
    """A GGUF file with the bundled tokenizer's metadata (and no tensors), some fields changed:
    ``pre``, ``add_bos``/``add_eos``, ``types`` ({token id: llama.cpp token type}), ``drop`` (keys), ``raw_token``
    ((id, text): a token spelled in plain UTF-8), ``model`` (the tokenizer kind)."""
    from gguf import GGUFValueType, GGUFWriter

    from tests.gguf_models import bundled_tokenizer_fields

    fields = dict(bundled_tokenizer_fields())
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    for key, (value, main, sub) in fields.items():
        if key in changes.get("drop", ()):  # type: ignore[operator]
            continue
        if key == "tokenizer.ggml.pre" and "pre" in changes:
            value = changes["pre"]
        if key == "tokenizer.ggml.model" and "model" in changes:
            value = changes["model"]
        if key == "tokenizer.ggml.add_bos_token" and "add_bos" in changes:
            value = changes["add_bos"]
        if key == "tokenizer.ggml.token_type" and "types" in changes:
            value = list(value)
            for index, kind in changes["types"].items():  # type: ignore[attr-defined]
                value[index] = kind
        if key == "tokenizer.ggml.tokens" and "raw_token" in changes:
            index, text = changes["raw_token"]  # type: ignore[misc]
            value = list(value)
            value[index] = text
        writer.add_key_value(key, value, main, sub_type=sub)
    if "add_eos" in changes:
        writer.add_key_value("tokenizer.ggml.add_eos_token", changes["add_eos"], GGUFValueType.BOOL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


VARIANTS = {
    "bundled": {},
    "llama3-split-with-bos": {"pre": "llama-bpe", "add_bos": True},
    "qwen2-split-with-eos": {"pre": "qwen2", "add_eos": True},
    "bos-and-eos": {"add_bos": True, "add_eos": True},
    "user-defined-token": {"types": {5000: 4}},
    "control-token-in-plain-utf8": {"raw_token": (16, "→ arrow")},  # a mislabel: not made special
    # Neither control nor named: made special anyway, as transformers does.
    "endoftext-as-a-normal-token": {"types": {0: 1}, "drop": ("tokenizer.ggml.unknown_token_id",)},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_byte_level_gguf_tokenizer_files_match_transformers_build(variant: str, tmp_path: Path) -> None:
    from chatapp.engine.gguf_tokenizer import write_byte_level_tokenizer

    gguf = _tokenizer_only_gguf(tmp_path / f"{variant}.gguf", **VARIANTS[variant])
    assert write_byte_level_tokenizer(gguf, tmp_path / "ours")
    tokenizer_module._gguf_tokenizer_quickly(gguf).save_pretrained(str(tmp_path / "theirs"))
    ours, theirs = (json.loads((tmp_path / d / "tokenizer.json").read_text()) for d in ("ours", "theirs"))
    assert ours == theirs
    assert (tmp_path / "ours" / "chat_template.jinja").read_text() == (
        tmp_path / "theirs" / "chat_template.jinja"
    ).read_text()
    a, b = TextTokenizer(tmp_path / "ours"), TextTokenizer(tmp_path / "theirs")
    assert a.special_tokens == b.special_tokens
    hf = load_hf_tokenizer(gguf)
    for text in TEXTS + ["12345678 digits, 'LL and 'S", "→ arrow x", "nowhere\r\n\r\n  \tend"]:
        assert a.encode(text) == hf.encode(text), text
        assert a.decode(a.encode(text)) == hf.decode(hf.encode(text))
    for conversation in CONVERSATIONS:
        assert a.apply_chat_template(conversation) == hf.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )


@pytest.mark.parametrize(
    ("changes", "byte_level"),
    [
        ({}, True),
        ({"model": "llama"}, False),
        ({"pre": "deepseek-llm"}, False),
        ({"drop": ("tokenizer.ggml.pre",)}, True),
    ],
    ids=["byte-level", "sentencepiece", "other-split", "no-split-named"],
)
def test_the_tokenizer_kind_is_read_without_walking_the_vocabulary(
    changes: dict, byte_level: bool, tmp_path: Path
) -> None:
    """The engine's launch asks only which kind a file's tokenizer is (start_tokenizer_build): its header is read
    up to the kind's fields, not through the vocabulary and merges after them, with the whole read's answer.
    A file that lacks one of them is read to its end."""
    from chatapp.engine.gguf_tokenizer import KIND_KEYS, is_byte_level_bpe
    from chatapp.engine.models.gguf_file import read_tokenizer_metadata

    gguf = _tokenizer_only_gguf(tmp_path / "kind.gguf", **changes)
    whole, kind = read_tokenizer_metadata(gguf), read_tokenizer_metadata(gguf, until=KIND_KEYS)
    assert "tokenizer.ggml.tokens" in whole and "tokenizer.ggml.merges" in whole
    assert is_byte_level_bpe(kind) == is_byte_level_bpe(whole) == byte_level
    if all(key in whole for key in KIND_KEYS):
        assert "tokenizer.ggml.tokens" not in kind and "tokenizer.ggml.merges" not in kind
    else:
        assert kind == whole


@pytest.mark.parametrize(
    "changes",
    [{"model": "llama"}, {"pre": "deepseek-llm"}, {"raw_token": (7000, "→ arrow")}],
    ids=["sentencepiece", "other-split", "merges-naming-a-missing-token"],
)
def test_other_gguf_tokenizers_are_left_to_transformers(changes: dict, tmp_path: Path) -> None:
    from chatapp.engine.gguf_tokenizer import write_byte_level_tokenizer

    gguf = _tokenizer_only_gguf(tmp_path / "other.gguf", **changes)
    assert not write_byte_level_tokenizer(gguf, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


def test_a_vocabulary_without_gpt2s_end_of_text_gets_no_extra_token(tmp_path: Path) -> None:
    """The one difference from transformers' build (a Llama 3 vocabulary has no <|endoftext|>): it adds
    that token one id past the model's vocabulary; we add nothing the model has no embedding for."""
    from chatapp.engine.gguf_tokenizer import GPT2_END_OF_TEXT, write_byte_level_tokenizer

    gguf = _tokenizer_only_gguf(tmp_path / "l3.gguf", pre="llama-bpe", add_bos=True, raw_token=(0, "<|end_of_text|>"))
    assert write_byte_level_tokenizer(gguf, tmp_path / "ours")
    tokenizer_module._gguf_tokenizer_quickly(gguf).save_pretrained(str(tmp_path / "theirs"))
    ours, theirs = (json.loads((tmp_path / d / "tokenizer.json").read_text()) for d in ("ours", "theirs"))
    invented = [t for t in theirs["added_tokens"] if t["content"] == GPT2_END_OF_TEXT]
    assert [t["id"] for t in invented] == [len(ours["model"]["vocab"])]  # past the model's vocabulary
    theirs["added_tokens"].remove(invented[0])
    assert ours == theirs
    assert GPT2_END_OF_TEXT not in ours["model"]["vocab"]
    a = TextTokenizer(tmp_path / "ours")
    assert len(a) == len(ours["model"]["vocab"]) and max(a.encode(f"x{GPT2_END_OF_TEXT}y")) < len(a)


def test_only_a_byte_level_gguf_tokenizer_is_left_to_the_clients(tmp_path: Path) -> None:
    assert clients_build_tokenizer(bundled_gguf_path())
    assert not clients_build_tokenizer(_tokenizer_only_gguf(tmp_path / "other.gguf", pre="deepseek-llm"))
    assert not clients_build_tokenizer(tmp_path)  # a model directory: its own files, or transformers'


def test_the_engine_load_does_not_wait_for_a_client_building_the_tokenizer(tmp_path: Path, monkeypatch) -> None:
    """A byte-level BPE GGUF file's tokenizer is each client's to build: the engine's load used to wait on the
    build lock until the first client's build was done (~0.14 s of a 1B file's first start), and wrote nothing
    of its own. Here a client holds the lock for as long as the load takes."""
    from chatapp.engine.config import EngineConfig
    from chatapp.engine.model_loader import ModelLoader
    from chatapp.engine.model_pool import ModelSlot
    from tests.gguf_models import write_llama_gguf

    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_llama_gguf(tmp_path / "tiny.gguf")
    config = EngineConfig(model=str(gguf), device="cpu", max_model_len=256, kv_cache_memory_gib=0.01)
    loader = ModelLoader(config, ModelSlot(str(gguf), pinned=True))
    cache = gguf_tokenizer_cache(gguf)
    with tokenizer_module._build_lock(cache):  # a client's build under way
        loader.start()
        loader.join(timeout=60)  # seconds where the load takes ~2: only a wait on the lock runs past it
        assert not loader.is_alive(), "the load waited for the client's tokenizer build"
    assert loader.error is None and loader.core is not None
    assert not cache.exists()  # the client's build writes the files, not the engine


async def test_a_client_starts_its_tokenizer_before_it_looks_for_an_engine(monkeypatch) -> None:
    """The build used to begin when the engine's "loading" message was read: in `chatapp serve`, only after
    the HTTP server's imports, and a first start then waited ~0.14 s for it once the engine was ready."""
    from chatapp.engine.api import EngineDeadError
    from chatapp.engine.client import AsyncEngineClient
    from chatapp.engine.config import EngineConfig

    client = AsyncEngineClient(EngineConfig(model=str(bundled_gguf_path())))
    building: list[bool] = []

    async def attach() -> None:
        building.append(client._tokenizer_preload is not None)
        raise EngineDeadError("no engine in this test")

    monkeypatch.setattr(client, "_attach", attach)
    with pytest.raises(EngineDeadError):
        await client.start()
    assert building == [True]
    assert client._tokenizer_preload is not None
    _path, task = client._tokenizer_preload
    assert isinstance(await task, Tokenizer)  # the preload is a whole tokenizer, for the model asked for
    await client.close()


async def test_a_client_keeps_the_tokenizer_it_built_as_it_closes(tmp_path: Path, monkeypatch) -> None:
    """A client's tokenizer is built in memory as its start begins; its files reach the cache as it closes, so
    a later start reads them instead of building again."""
    from chatapp.engine.client import AsyncEngineClient
    from chatapp.engine.config import EngineConfig

    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(tmp_path / "cache"))
    gguf = bundled_gguf_path()
    client = AsyncEngineClient(EngineConfig(model=str(gguf)))
    client._tokenizer = Tokenizer(gguf)  # as its start leaves it (no engine in this test)
    cache = gguf_tokenizer_cache(gguf)
    assert not cache.exists()
    await client.close()
    assert (cache / "tokenizer.json").exists() and (cache / "tokenizer_config.json").exists()
    assert TextTokenizer(cache).encode(TEXTS[0]) == client._tokenizer.encode(TEXTS[0])


def test_a_tokenizer_that_cannot_be_saved_is_logged_not_raised(tmp_path: Path, monkeypatch, caplog) -> None:
    """The files only spare a later start the build: a full disk or a removed cache must not fail a close."""
    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = Tokenizer(bundled_gguf_path())

    def full_disk(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tokenizer_module, "save_built_tokenizer", full_disk)
    with caplog.at_level("WARNING"):
        tokenizer.save_files()
    assert "could not save the tokenizer files" in caplog.text


def test_no_tokenizer_files_are_saved_for_a_model_removed_meanwhile(tmp_path: Path, monkeypatch) -> None:
    """A TUI that closes after `chatapp models rm` (which clears the model's tokenizer cache) must not write the
    files back for a file that is gone, or for one replaced by another under the same name."""
    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(tmp_path / "cache"))
    gguf = _tokenizer_only_gguf(tmp_path / "model.gguf")
    cache = gguf_tokenizer_cache(gguf)
    removed = Tokenizer(gguf)
    gguf.unlink()
    removed.save_files()
    assert not cache.exists()

    _tokenizer_only_gguf(gguf)
    replaced = Tokenizer(gguf)
    _tokenizer_only_gguf(gguf, add_bos=True)  # another file under the same name (a new mtime, and size)
    os.utime(gguf, ns=(1, 1))
    replaced.save_files()
    assert not list((tmp_path / "cache").glob("tokenizers/*/tokenizer.json"))
    kept = Tokenizer(gguf)
    kept.save_files()
    assert (gguf_tokenizer_cache(gguf) / "tokenizer.json").exists()
