"""The local model store: bundled model, registry of user paths, listing, removal, memory estimates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chatapp import model_facts, store
from tests.hub_helpers import point_hf_at, run_cli, tiny_gguf, with_config

DEAD_HUB = "http://127.0.0.1:9"  # nothing listens there: any network use fails loudly


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Empty registry and HF cache, and a Hub that cannot be reached."""
    monkeypatch.setenv("CHATAPP_DATA_DIR", str(tmp_path / "data"))
    point_hf_at(DEAD_HUB, tmp_path / "hf-home", monkeypatch)
    return tmp_path


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty chatapp cache dir, to see what resolving writes there."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(cache))
    return cache


# --- the bundled model ----------------------------------------------------------------------


def test_bundled_model_is_found_offline_on_a_fresh_install(tmp_path: Path) -> None:
    """A fresh process with no network and an empty HF cache and registry lists and resolves it."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_ENDPOINT": DEAD_HUB,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
        "CHATAPP_DATA_DIR": str(tmp_path / "data"),
    }
    listing = subprocess.run(
        [sys.executable, "-m", "chatapp", "models", "list"], env=env, capture_output=True, text=True, timeout=300
    )
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if line.startswith(store.BUNDLED_NAME))
    assert row.split()[1:4] == ["bundled", "LlamaForCausalLM", "135M"] and "Q4_1" in row and row.endswith("ok")
    # What it will take: its weights as the engine holds them, the file's own blocks (96.6 MB of the file's
    # 98.4 MB; the rest is its vocabulary), + a float16 KV cache for its 8k context (188.7 MB).
    assert "285.3 MB (fits)" in row and "available now" in listing.stderr

    code = "from chatapp.store import resolve_model; m = resolve_model(None); print(m.source, m.path)"
    resolved = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert resolved.returncode == 0, resolved.stderr
    source, path = resolved.stdout.split()
    assert source == "bundled" and Path(path) == store.bundled_gguf_path()


def test_a_gguf_file_resolves_to_itself_and_nothing_is_converted(tmp_path: Path, fresh_cache: Path, home: Path) -> None:
    """The engine reads GGUF files in place: resolving writes no converted copy anywhere."""
    gguf = tiny_gguf(tmp_path / "mine.gguf")
    first = store.resolve_model(str(gguf))
    assert first == store.resolve_model(str(gguf))
    assert first.source == "gguf" and first.name == "mine" and first.path == gguf.absolute()
    assert store.resolve_model(None).path == store.bundled_gguf_path()
    assert not (fresh_cache / "converted").exists()


def test_bundled_model_cannot_be_removed(home: Path) -> None:
    code, _, err = run_cli("models", "rm", store.BUNDLED_NAME, "--yes")
    assert code == 1 and "cannot be removed" in err
    assert store.bundled_gguf_path().exists()


# --- paths the user points to --------------------------------------------------------------


def test_add_list_and_forget_a_model_directory(home: Path, tiny_llama: Path) -> None:
    before = {p.name: p.read_bytes() for p in tiny_llama.iterdir()}
    code, out, err = run_cli("models", "add", str(tiny_llama))
    assert code == 0, err
    assert "LlamaForCausalLM" in out and "ok" in out

    code, out, _ = run_cli("models", "list")
    row = next(line for line in out.splitlines() if line.startswith(str(tiny_llama)))
    assert row.split()[1:4] == ["directory", "LlamaForCausalLM", f"{_tiny_params(tiny_llama) / 1e6:.1f}M"]
    assert row.endswith("ok")

    code, out, _ = run_cli("models", "rm", str(tiny_llama))  # forgetting deletes nothing: no question asked
    assert code == 0 and "its files stay where they are" in out
    assert str(tiny_llama) not in run_cli("models", "list")[1]
    assert {p.name: p.read_bytes() for p in tiny_llama.iterdir()} == before


def _tiny_params(model_dir: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(model_dir / "model.safetensors").values())


def test_model_flag_remembers_the_path(home: Path, tiny_llama: Path) -> None:
    store.resolve_model(str(tiny_llama))
    assert store.registered_paths() == []
    store.resolve_model(str(tiny_llama), remember=True)
    store.resolve_model(str(tiny_llama), remember=True)
    assert store.registered_paths() == [tiny_llama.resolve()]


def test_unsupported_and_vanished_paths_are_listed_with_the_reason(
    home: Path, tmp_path: Path, tiny_llama: Path
) -> None:
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    for name, data in with_config(tiny_llama, architectures=["GPT2LMHeadModel"], model_type="gpt2").items():
        (gpt2 / name).write_bytes(data)
    gone = tmp_path / "gone"
    gone.mkdir()
    (gone / "config.json").write_text("{}")
    store.remember_path(gpt2)
    store.remember_path(gone)
    (gone / "config.json").unlink()
    gone.rmdir()

    code, out, _ = run_cli("models", "list")
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "unsupported: model architecture GPT2LMHeadModel is not supported" in rows[str(gpt2)]
    assert "the path no longer exists" in rows[str(gone)]

    code, out, _ = run_cli("models", "info", str(gpt2))
    assert code == 0 and "supported" in out and "GPT2LMHeadModel" in out

    assert run_cli("models", "rm", str(gone))[0] == 0
    assert store.registered_paths() == [gpt2]


def test_a_broken_gguf_file_is_listed_as_unreadable(home: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 10)
    store.remember_path(broken)
    code, out, _ = run_cli("models", "list")
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith(str(broken)))
    assert "unsupported: unreadable GGUF file" in row


def test_a_model_directory_with_a_broken_index_is_listed_as_such(home: Path, tmp_path: Path, tiny_llama: Path) -> None:
    """An index that is JSON but not an index (a list) was a TypeError that took `models list` down."""
    import shutil

    model = shutil.copytree(tiny_llama, tmp_path / "odd-index")
    (model / "model.safetensors.index.json").write_text("[]")
    store.remember_path(model)
    code, out, err = run_cli("models", "list")
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith(str(model)))
    assert "the safetensors index is unreadable" in row and "is not a safetensors index" in row


def test_adding_something_that_is_not_a_model_is_one_clear_line(home: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for path, message in ((tmp_path / "empty", "no config.json"), (tmp_path / "nowhere", "does not exist")):
        code, _, err = run_cli("models", "add", str(path))
        assert code == 1 and message in err and err.count("\n") == 1
    assert store.registered_paths() == []


def test_an_unreadable_registry_is_kept_aside_not_overwritten(home: Path, tiny_llama: Path) -> None:
    registry = home / "data" / store.REGISTRY_FILE
    registry.parent.mkdir(parents=True, exist_ok=True)
    registry.write_text("{ this is not json")
    assert run_cli("models", "list")[0] == 0
    store.remember_path(tiny_llama)
    assert store.registered_paths() == [tiny_llama.resolve()]
    kept = list(registry.parent.glob(f"{store.REGISTRY_FILE}.unreadable-*"))
    assert [p.read_text() for p in kept] == ["{ this is not json"]


def test_a_registered_gguf_is_forgotten_and_only_our_cached_files_deleted(
    home: Path, tmp_path: Path, fresh_cache: Path
) -> None:
    """`models rm` forgets the user's file and deletes what we cached for it: its tokenizer and the
    float32 conversion an earlier chatapp made (the GGUF file itself stays)."""
    from chatapp.engine.tokenizer import gguf_tokenizer_cache

    gguf = tiny_gguf(tmp_path / "mine-F16.gguf")
    assert store.resolve_model(str(gguf), remember=True).path == gguf.absolute()
    legacy, tokenizer = store.conversion_dir(gguf), gguf_tokenizer_cache(gguf)
    for cached in (legacy, tokenizer):
        cached.mkdir(parents=True)
        (cached / "config.json").write_text("{}")
    code, out, _ = run_cli("models", "list")
    row = next(line for line in out.splitlines() if line.startswith(str(gguf)))
    assert row.split()[1:3] == ["gguf", "LlamaForCausalLM"] and "F16" in row and "2048" in row

    code, out, _ = run_cli("models", "rm", str(gguf))
    assert code == 0 and "cached files" in out
    assert gguf.exists() and not legacy.exists() and not tokenizer.exists() and store.registered_paths() == []


# --- names that lead nowhere ---------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nobody/nothing", "not in the Hugging Face cache; download it with `chatapp models pull nobody/nothing`"),
        ("nobody/nothing:x.gguf", "chatapp models pull nobody/nothing:x.gguf"),
        ("just-a-word", "not a path, and not a Hugging Face repo id"),
    ],
)
def test_unknown_names_say_what_to_do(home: Path, spec: str, message: str) -> None:
    with pytest.raises(store.ModelNotFoundError) as err:
        store.resolve_model(spec)
    assert message in str(err.value)
    code, _, stderr = run_cli("models", "info", spec)
    assert code == 1 and stderr.startswith("error: no local model named") and stderr.count("\n") == 1


# --- facts and memory ----------------------------------------------------------------------


def test_memory_labels() -> None:
    gib = 1 << 30
    assert model_facts.estimate_memory(400_000_000, 50_000, available_bytes=16 * gib).label == "fits"
    # 8 GB of weights (a 2B float32 model, a 13B in 4 bits): fits in 16 GiB, but slow to decode on a CPU.
    assert model_facts.estimate_memory(8_000_000_000, available_bytes=16 * gib).label == "will be slow"
    # Small weights, little memory left over.
    assert model_facts.estimate_memory(2_000_000_000, available_bytes=int(2.2 * gib)).label == "will be slow"
    assert model_facts.estimate_memory(32_000_000_000, available_bytes=16 * gib).label == "will not fit"
    # The KV cache counts, for the model's whole context when memory allows it...
    roomy = model_facts.estimate_memory(400_000_000, 1 << 17, context_tokens=8192, available_bytes=16 * gib)
    assert roomy.kv_tokens == 8192 and roomy.kv_bytes == gib and roomy.label == "fits"
    assert "KV cache for 8,192 tokens" in roomy.describe()
    # ...held to what half the memory left can cache (as the engine holds it), never below 2k tokens.
    held = model_facts.estimate_memory(400_000_000, 1 << 17, context_tokens=131072, available_bytes=16 * gib)
    room = (16 * gib - 400_000_000 - model_facts.WORKING_BYTES) // 2 // (1 << 17)
    assert held.kv_tokens == room < 131072 and held.label == "fits"
    tight = model_facts.estimate_memory(400_000_000, 1 << 20, context_tokens=8192, available_bytes=2 * gib)
    assert tight.kv_tokens == 2048 and tight.kv_bytes == 2 * gib and tight.label == "will not fit"
    assert "will not fit: needs about" in tight.describe()


def test_a_gguf_files_weights_are_what_the_engine_holds_and_its_cache_is_half_precision() -> None:
    from chatapp.engine.models.gguf_file import GGUFModelFile
    from chatapp.engine.models.gguf_weights import native_weight_bytes
    from chatapp.store import bundled_gguf_path

    path = bundled_gguf_path()
    facts = model_facts.facts_from_gguf(path)
    gguf = GGUFModelFile(path)
    mc = gguf.model_config()
    assert facts.weights_bytes == native_weight_bytes(gguf, mc)
    assert 0.9 * path.stat().st_size < facts.weights_bytes <= path.stat().st_size  # run as it is, not as float32
    assert facts.kv_bytes_per_token == mc.kv_bytes_per_token // 2  # float16 cache on the CPU
    estimate = model_facts.estimate_for(facts, available_bytes=16 << 30)
    assert estimate.weights_bytes == facts.weights_bytes and estimate.kv_tokens == facts.context_length


@pytest.mark.parametrize("mix", ["Q3_K_M", "Q2_K"])
def test_a_gguf_file_of_a_type_run_wider_is_listed_with_what_the_engine_will_hold(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mix: str
) -> None:
    """Q3_K runs in Q6_K's kind (1.9x its bytes), Q2_K in float32: a listing that took the file's size would
    call a model that the engine then refuses "fits"."""
    from chatapp.engine.block_kinds import KIND_FOR_GGUF_TYPE
    from chatapp.engine.models.gguf_file import GGUFModelFile
    from chatapp.engine.models.gguf_weights import native_weight_bytes
    from tests.gguf_models import write_llama_gguf

    path = write_llama_gguf(tmp_path / f"tiny-{mix}.gguf", mix=mix, tied=True)
    gguf = GGUFModelFile(path)
    facts = model_facts.facts_from_gguf(path)
    weights_in_file = sum(t.data.nbytes for t in gguf.tensors.values())
    assert facts.weights_bytes == native_weight_bytes(gguf, gguf.model_config()) > 1.7 * weights_in_file
    assert model_facts.facts_from_gguf(path).weights_bytes == facts.weights_bytes  # from the cached summary too
    if mix == "Q3_K_M":  # a chatapp that packs Q3_K otherwise reads the file again, not the cached figure
        monkeypatch.delitem(KIND_FOR_GGUF_TYPE, "Q3_K")
        assert model_facts.facts_from_gguf(path).weights_bytes > facts.weights_bytes  # its Q3_K tensors in float32


def test_a_gguf_downloads_memory_is_scaled_by_the_type_its_name_says() -> None:
    from chatapp.engine.block_kinds import TILE_BYTES

    per_file_byte = model_facts.cpu_bytes_per_file_byte
    assert per_file_byte("org/Model-Q4_K_M.gguf") == pytest.approx(TILE_BYTES[104] / (16 * 256) / (144 / 256))
    assert per_file_byte("model.Q8_0.gguf") == per_file_byte("Model-q4_0.gguf") == 1.0  # their own bytes
    assert per_file_byte("Model-Q3_K_L.gguf") == pytest.approx(TILE_BYTES[106] / (16 * 256) / (110 / 256))
    assert per_file_byte("Qwen2.5-7B-Instruct-IQ4_XS-00001-of-00002.gguf") == pytest.approx(2208 / 2176)
    assert per_file_byte("Model-Q2_K.gguf") == pytest.approx(4 / (84 / 256))  # float32
    assert per_file_byte("Model-IQ3_M.gguf") == per_file_byte("Model-IQ3_S.gguf") > 9  # float32
    assert per_file_byte("Model-F16.gguf") == per_file_byte("Model-BF16.gguf") == 1.0  # read in place
    assert per_file_byte("Model-F32.gguf") == 1.0
    assert per_file_byte("model.gguf") == per_file_byte("QQ4_K_MM.gguf") == 1.0  # no type named: its size


def test_facts_count_the_real_parameters_and_flag_what_the_engine_cannot_load(tiny_llama: Path) -> None:
    facts = model_facts.facts_from_model_dir(tiny_llama)
    assert facts.supported and facts.parameters == _tiny_params(tiny_llama)
    assert facts.quantization == "f32" and facts.context_length == 2048

    config = json.loads((tiny_llama / "config.json").read_text())
    gptq = model_facts.facts_from_config({**config, "quantization_config": {"quant_method": "gptq"}})
    assert not gptq.supported and "gptq" in gptq.reason
    broken = model_facts.facts_from_config({"architectures": ["LlamaForCausalLM"]})
    assert not broken.supported and "incomplete" in broken.reason


def test_the_engine_is_a_leaf_package() -> None:
    """chatapp/engine never imports the app (store, model facts, settings, TUI, server): the store
    hands it a resolver instead (chatapp/engine/model_ref.py)."""
    import ast

    engine = Path(store.__file__).parent / "engine"
    offenders = []
    for source in engine.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            for name in names:
                if name.startswith("chatapp.") and not name.startswith(
                    ("chatapp.engine", "chatapp.kernels", "chatapp.paths")
                ):
                    offenders.append(f"{source.relative_to(engine)}: {name}")
    assert offenders == []


def test_bundled_store_name_matches_the_engines_default() -> None:
    from chatapp.engine.model_ref import default_model_name

    assert default_model_name() == store.BUNDLED_NAME
