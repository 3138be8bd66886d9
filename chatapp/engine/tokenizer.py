"""Prompts to token ids, with chat rendering that keeps multi-turn prefix hits.

A follow-up turn re-renders the whole conversation through the chat template.
Re-tokenising an earlier answer's *text* can give different ids than the ones
the model generated (BPE has many spellings of one string), which breaks the
prefix cache for every block after it. So the tokenizer remembers the ids it
generated for each answer text and splices them back in when that answer comes
back as history.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatapp.engine.model_ref import is_gguf_path
from chatapp.engine.models.config import read_json_object
from chatapp.engine.models.gguf_split import metadata_part
from chatapp.engine.reasoning import OPEN as THINK_OPEN
from chatapp.engine.reasoning import prompt_opens_thinking

if TYPE_CHECKING:
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from chatapp.engine.gguf_tokenizer import ByteLevelTokenizer

_ROLES = ("system", "developer", "user", "assistant", "tool")
_REMEMBERED = 4096


class TokenizerFilesError(ValueError):
    """A model's tokenizer files cannot be read (a cut download, a bad edit); the message names the file."""


class ChatFormatError(ValueError):
    """A conversation that cannot be rendered (bad role, bad content, no template)."""


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check OpenAI-style messages and flatten text parts; raise ChatFormatError clearly.

    An assistant turn's ``tool_calls`` and a tool result's ``tool_call_id``/``name`` are kept, the
    calls' arguments as objects (what chat templates expect; OpenAI sends JSON text)."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatFormatError(f"messages[{i}] must be an object with role and content")
        role = message.get("role")
        if role not in _ROLES:
            raise ChatFormatError(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ChatFormatError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if content is None and role == "tool":
            content = ""
        if not isinstance(content, str):
            raise ChatFormatError(f"messages[{i}].content must be a string or a list of text parts")
        normal: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            normal["tool_calls"] = _template_tool_calls(message["tool_calls"], i)
        if role == "tool":  # OpenAI's rules: a result names its call, after a turn that made calls
            if not isinstance(message.get("tool_call_id"), str):
                raise ChatFormatError(f"messages[{i}].tool_call_id is required in a tool message (the call it answers)")
            if not any(m["role"] == "assistant" and m.get("tool_calls") for m in out):
                raise ChatFormatError(
                    f"messages[{i}].role 'tool' must answer an earlier assistant message's tool_calls"
                )
            normal["tool_call_id"] = message["tool_call_id"]
            if isinstance(message.get("name"), str):
                normal["name"] = message["name"]
        out.append(normal)
    return out


def _template_tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ChatFormatError(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"messages[{i}].tool_calls[{j}] must hold a function with a name")
        arguments = fn.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ChatFormatError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON") from None
        out.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": arguments},
            }
        )
    return out


def gguf_tokenizer_cache(gguf: Path) -> Path:
    """Where the tokenizer files built for a GGUF file (or a model directory without tokenizer.json) are kept,
    keyed on its path, size and time."""
    from chatapp import paths

    st = gguf.stat()
    key = hashlib.blake2b(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode(), digest_size=8).hexdigest()
    return paths.cache_dir() / "tokenizers" / f"{gguf.stem}-{key}"


def load_hf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """A model directory's or GGUF file's tokenizer as transformers builds it (imports torch: ~1 s).

    Used once per GGUF file to write its tokenizer files (prepare_tokenizer_files), and by tests as
    the reference our own TextTokenizer is held to.
    """
    from transformers import AutoTokenizer

    if not is_gguf_path(path):
        return AutoTokenizer.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def prepare_tokenizer_files(path: Path) -> Path:
    """The directory with the model's tokenizer.json and tokenizer_config.json, building them once.

    A model directory usually has them; a GGUF file's (and a directory with only a slow,
    SentencePiece tokenizer) are built once and kept in the cache directory. The engine calls this
    while it loads, so the clients that attach find them and stay light. One process builds them at a
    time (a file lock): whoever comes second waits for the first build and uses its files.
    """
    return _prepare_tokenizer(path)[0]


def _prepare_tokenizer(path: Path, write: bool = True) -> tuple[Path, ByteLevelTokenizer | None]:
    """prepare_tokenizer_files, plus the tokenizer itself where this call built it in memory (a byte-level
    BPE GGUF file's): the caller then need not read back the files it wrote.

    write=False: a tokenizer built in memory comes back without its files, for the caller to write later
    (save_built_tokenizer; Tokenizer.save_files says why)."""
    path = metadata_part(Path(path))  # a split GGUF model's metadata is in its first part
    if not is_gguf_path(path) and (path / "tokenizer.json").exists():
        return path, None
    cache = gguf_tokenizer_cache(path)
    if (cache / "tokenizer.json").exists():
        return cache, None
    if not write and is_gguf_path(path):
        from chatapp.engine.gguf_tokenizer import build_byte_level_tokenizer

        built = build_byte_level_tokenizer(path)  # in memory, without the lock: each process may build its own
        if built is not None:
            return cache, built
    with _build_lock(cache):
        if (cache / "tokenizer.json").exists():
            return cache, None
        return cache, _build_tokenizer_files(path, cache)


def save_built_tokenizer(cache: Path, built: ByteLevelTokenizer) -> None:
    """Write the files of a tokenizer built in memory into its cache directory, unless another process has."""
    with _build_lock(cache):
        if not (cache / "tokenizer.json").exists():
            _write_into(cache, built.write, cache)


def clients_build_tokenizer(path: Path) -> bool:
    """Whether each client builds this model's tokenizer itself, in memory (a byte-level BPE GGUF file's,
    ~0.2 s), rather than reading the files the engine's side prepares (prepare_tokenizer_files).

    Why the engine must know: its load waited for those files, that is for its first client's build, which
    that client runs beside its own start (a 1B Q4_K_M file's first start to /health, the weights' repack
    left out as a measure of what else waits: 0.58 s with the wait, 0.41 s without)."""
    path = metadata_part(Path(path))
    if not is_gguf_path(path):
        return False
    from chatapp.engine.gguf_tokenizer import KIND_KEYS, is_byte_level_bpe
    from chatapp.engine.models.gguf_file import read_tokenizer_metadata

    return is_byte_level_bpe(read_tokenizer_metadata(path, until=KIND_KEYS))


def start_tokenizer_build(path: Path) -> subprocess.Popen[bytes] | None:
    """Start building a GGUF file's missing tokenizer files in a process of their own, where transformers
    builds them; None when they exist, or when the file's tokenizer is byte-level BPE.

    Why: transformers takes ~1.2 s over a SentencePiece file's tokenizer, and the engine would wait for it
    after its weights; started before the engine's load, the build runs on another core meanwhile, and
    prepare_tokenizer_files then finds the files, or waits for the build (its lock). A byte-level BPE
    tokenizer is built in ~0.2 s by the first client to ask (Tokenizer), in that client's process: a build
    process of its own would only add a Python start (~0.1 s of CPU) beside the weights' load.
    """
    path = metadata_part(Path(path))
    if not is_gguf_path(path) or (gguf_tokenizer_cache(path) / "tokenizer.json").exists():
        return None
    if clients_build_tokenizer(path):
        return None
    # OpenBLAS's threads (numpy, in the transformers fallback) would spin on the core the engine loads on.
    env = {"OPENBLAS_NUM_THREADS": "1", **os.environ}
    builder = subprocess.Popen(
        [sys.executable, "-m", "chatapp.engine.tokenizer", str(path)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )
    _builders.append(builder)
    return builder


_builders: list[subprocess.Popen[bytes]] = []  # kept so that each is waited for (reaped) when it ends


@contextlib.contextmanager
def _build_lock(cache: Path) -> Iterator[None]:
    """Held while one process checks and builds the files at `cache`: a lock on the directory that holds
    every model's (builds are rare, and no lock file is left behind for `chatapp models rm` to find)."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
        for builder in list(_builders):
            if builder.poll() is not None:
                _builders.remove(builder)


def _build_tokenizer_files(path: Path, cache: Path) -> ByteLevelTokenizer | None:
    """Byte-level BPE GGUF files are built by gguf_tokenizer.py (~0.2 s; returned too); the others by
    transformers."""
    from chatapp.engine.gguf_tokenizer import build_byte_level_tokenizer

    built = build_byte_level_tokenizer(path) if is_gguf_path(path) else None
    if built is not None:
        _write_into(cache, built.write, path)
        return built

    def save_through_transformers(tmp: Path) -> None:
        tokenizer: PreTrainedTokenizerBase | None = _gguf_tokenizer_quickly(path) if is_gguf_path(path) else None
        if tokenizer is None:
            tokenizer = load_hf_tokenizer(path)
        tokenizer.save_pretrained(str(tmp))

    _write_into(cache, save_through_transformers, path)
    return None


def _write_into(cache: Path, write: Callable[[Path], None], source: Path) -> None:
    """The files ``write`` makes in a directory beside ``cache``, moved into its place whole: no reader ever
    finds a cache half written."""
    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        if not (tmp / "tokenizer.json").exists():
            raise ChatFormatError(f"the tokenizer of {source} has no fast (tokenizer.json) form")
        shutil.rmtree(cache, ignore_errors=True)  # an earlier version's partial files
        os.replace(tmp, cache)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gguf_tokenizer_quickly(path: Path) -> PreTrainedTokenizerFast | None:
    """transformers' GGUF tokenizer conversion fed by its metadata-only reader, or None.

    AutoTokenizer also parses the whole file through `gguf`'s reader for the model's config (8 s
    for the bundled model's 49k vocabulary; 0.4 s this way). This uses transformers 5's GGUF
    integration; with another version, or if it fails, the caller takes AutoTokenizer's way.
    tests/test_tokenizer.py holds the result to AutoTokenizer's.
    """
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

        architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
        # transformers leaves TokenizersBackend.__init__ unannotated
        return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
            tokenizer_object=backend, **tokenizer_config, **extra
        )
    except Exception as exc:  # an older transformers, or a file its quick path does not take
        import logging

        logging.getLogger(__name__).info("building the tokenizer the slow way (%s)", exc)
        return None


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """tokenizer.json through the `tokenizers` library, plus the config's special tokens and template.

    What transformers' fast tokenizer does for encode, decode and apply_chat_template, without
    importing transformers or torch (tests/test_tokenizer.py compares the two).
    """

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer as Backend

        tokenizer_file = directory / "tokenizer.json"
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
            raise TokenizerFilesError(f"{tokenizer_file} cannot be read ({exc})") from None
        config_file = directory / "tokenizer_config.json"
        config = read_json_object(config_file, TokenizerFilesError) if config_file.exists() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.exists():
            try:
                template = jinja_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise TokenizerFilesError(f"{jinja_file} is not UTF-8 text ({exc})") from None
        self._take(backend, config, template)

    @classmethod
    def from_build(cls, built: ByteLevelTokenizer) -> TextTokenizer:
        """The tokenizer a build just made in memory: what TextTokenizer(its directory) would read back."""
        tokenizer = cls.__new__(cls)
        tokenizer._take(built.backend, built.config, built.chat_template)
        return tokenizer

    def _take(self, backend: Backend, config: dict[str, Any], template: Any) -> None:
        from tokenizers.models import BPE

        self.backend = backend
        self.backend.no_truncation()
        self.backend.no_padding()
        self.chat_template: str | None = template or None
        # The named special tokens, as transformers hands them to templates (not the extra ones).
        names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
        self.special_tokens = {n: t for n in names if (t := _token_text(config.get(n))) is not None}
        # transformers skips this clean-up for BPE models (it strips real spaces before punctuation).
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces")) and not isinstance(
            self.backend.model, BPE
        )

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            for before, after in (
                (" .", "."),
                (" ?", "?"),
                (" !", "!"),
                (" ,", ","),
                (" ' ", "'"),
                (" n't", "n't"),
                (" 'm", "'m"),
                (" 's", "'s"),
                (" 've", "'ve"),
                (" 're", "'re"),
            ):
                text = text.replace(before, after)
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        from chatapp.engine.chat_template import render_chat_template

        if not self.chat_template:
            raise ChatFormatError("this model has no chat template; use a plain completion prompt")
        extra = {"tools": None, "documents": None, **extra}
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **extra,
        )


class Tokenizer:
    """The model's tokenizer plus our chat rendering (tokenizers + Jinja: no torch in clients)."""

    def __init__(self, model_path: Path | str) -> None:
        directory, built = _prepare_tokenizer(Path(model_path), write=False)
        self.hf = TextTokenizer.from_build(built) if built is not None else TextTokenizer(directory)
        self._generated: OrderedDict[str, list[int]] = OrderedDict()
        self._unsaved = (Path(model_path), directory, built) if built is not None else None

    def save_files(self) -> None:
        """Write the files of a tokenizer built here in memory (a byte-level BPE GGUF file's) into the cache,
        where the next start reads them; a no-op for any other tokenizer, and once done.

        Why not as it is built: writing them holds this process's interpreter ~45 ms, and a client builds its
        tokenizer beside its own imports, on a first start's way to being ready (a 1B Q4_K_M file's first
        start to /health: median 0.68 -> 0.63 s, 8 alternated rounds on a noisy hour). Clients call this as
        they close. A failure is logged, not raised: the files only spare a later start the build. Nothing is
        written for a model file removed or replaced since (`chatapp models rm` has cleared its cache)."""
        if self._unsaved is None:
            return
        (model_path, cache, built), self._unsaved = self._unsaved, None
        try:
            if gguf_tokenizer_cache(metadata_part(model_path)) != cache:  # the file changed: another key now
                return
        except OSError:  # the file is gone
            return
        try:
            save_built_tokenizer(cache, built)
        except Exception as exc:  # noqa: BLE001  (a full disk; the model file or the cache removed meanwhile)
            import logging

            logging.getLogger(__name__).warning("could not save the tokenizer files to %s: %s", cache, exc)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of a conversation, reusing the exact ids of answers we generated.

        tools: OpenAI tool definitions, for a template that renders them (see engine/tools.py).
        continue_final_message: the last message is an assistant answer to go on with (one cut at the
        token limit): it is rendered open, with no end of turn after it and no new turn (vLLM's flag).
        """
        messages = normalize_messages(messages)
        if not self.hf.chat_template:
            raise ChatFormatError("this model has no chat template; use a plain completion prompt")
        if continue_final_message:
            if not messages or messages[-1]["role"] != "assistant" or not messages[-1]["content"]:
                raise ChatFormatError("continue_final_message needs the conversation to end with an assistant's text")
            add_generation_prompt = False
        try:
            text = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        except Exception as exc:  # templates raise their own errors (e.g. "roles must alternate")
            raise ChatFormatError(f"the model's chat template rejected the conversation: {exc}") from exc
        if continue_final_message:
            text = self._open_final_turn(text, messages, tools)
        ids: list[int] = []
        pos = 0
        for message in messages:
            remembered = self._generated.get(message["content"]) if message["role"] == "assistant" else None
            if not remembered or not message["content"]:
                continue
            at = text.find(message["content"], pos)
            if at == -1:
                continue
            ids += self._encode_piece(text[pos:at]) + remembered
            self._generated.move_to_end(message["content"])
            pos = at + len(message["content"])
        return ids + self._encode_piece(text[pos:])

    def _open_final_turn(self, text: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """``text`` (the whole conversation, rendered closed) cut just after the final answer's text.

        The answer is looked for after where its turn starts (the conversation before it, rendered with a
        generation prompt), so a short answer cannot be found inside the end-of-turn marker; and as it
        stands stripped, as templates that trim content (Llama 3, Gemma) render it. Its own trailing
        whitespace, if the template dropped it, is put back: the model goes on from what it wrote. An
        answer the template rewrote follows the generation prompt as it was written."""
        final: str = messages[-1]["content"]
        core = final.strip()
        head, start = "", 0
        try:
            head = self.hf.apply_chat_template(messages[:-1], add_generation_prompt=True, tools=tools)
        except Exception:  # noqa: BLE001  a template that cannot render the shorter conversation: search it all
            head = ""
        if head and text.startswith(head):
            start = len(head)
        elif head and prompt_opens_thinking(head) and text.startswith(head[: head.rfind(THINK_OPEN)]):
            # DeepSeek-R1's generation prompt opens a think block that the rendered past turn lacks.
            start = head.rfind(THINK_OPEN)
        at = text.find(core, start) if start else text.rfind(core)
        if core and at == -1 and start:
            # The template rewrote the answer (Qwen3's drops a think block from it): the turn opens as
            # the model wrote it, right after the prompt that asked for it, which is what it went on from
            # (where that prompt opened the think block, the answer's own opener is that one).
            if prompt_opens_thinking(head) and final.lstrip().startswith(THINK_OPEN):
                final = final.lstrip()[len(THINK_OPEN) :].lstrip("\n")
            return head + final
        if not core or at == -1:
            raise ChatFormatError("the model's chat template changed the final message; it cannot be continued")
        end = at + len(core)
        return text[:end] + final[len(final.rstrip()) :]

    def _encode_piece(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False) if text else []

    def remember_output(self, text: str, token_ids: list[int]) -> None:
        """Remember the ids of a finished answer whose tokens decode exactly to ``text``."""
        if not text:
            return
        ids = list(token_ids)
        while ids and self.decode(ids[-1:]) == "":  # a trailing end-of-turn token is not content
            ids.pop()
        if self.decode(ids) != text:
            return
        self._generated[text] = ids
        self._generated.move_to_end(text)
        while len(self._generated) > _REMEMBERED:
            self._generated.popitem(last=False)


def _read_gguf_metadata_without_torch() -> None:
    """Have transformers' GGUF tokenizer code read the file's metadata through our header reader.

    Its own reader module imports torch at the top (~1 s of a ~2.9 s build) and uses none of it for
    metadata. Only for the build process start_tokenizer_build starts, before transformers' reader
    is imported: our reader returns the same fields (tests/test_tokenizer.py holds the files built
    this way to AutoTokenizer's tokenizer). Anything failing here leaves the build to the engine's
    loader, which builds the usual way.
    """
    import types

    from chatapp.engine.models.gguf_file import read_tokenizer_metadata

    name = "transformers.integrations.gguf.reader"
    if "torch" in sys.modules or name in sys.modules:
        return
    reader = types.ModuleType(name)
    reader.read_gguf_metadata = lambda path, string_arrays=(): (  # type: ignore[attr-defined]
        read_tokenizer_metadata(path, string_arrays),
        (),
    )
    sys.modules[name] = reader


if __name__ == "__main__":  # the build start_tokenizer_build starts: python -m chatapp.engine.tokenizer FILE.gguf
    from chatapp.engine import startup_gc

    startup_gc.hold()  # never released: this process ends with the build (startup_gc.py says why)
    try:
        _read_gguf_metadata_without_torch()
        prepare_tokenizer_files(Path(sys.argv[1]))
    except Exception:  # the engine's loader builds them itself and reports why
        sys.exit(1)
