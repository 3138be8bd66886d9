"""Pulling, listing, resolving and searching against a fake Hub on 127.0.0.1."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.hub_helpers import FakeHub, point_hf_at, run_cli, tiny_gguf, with_config

REPO = "tiny/llama"
UNWANTED = {"README.md": b"# tiny\n", "pytorch_model.bin": b"\0" * 1000, "onnx/model.onnx": b"\1" * 100}


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama: Path):
    """A fake Hub serving the tiny Llama as tiny/llama (plus files a pull must skip), and a fresh HF cache."""
    monkeypatch.setenv("CHATAPP_DATA_DIR", str(tmp_path / "data"))
    with FakeHub() as fake:
        files = {p.name: p.read_bytes() for p in tiny_llama.iterdir() if p.is_file()}
        fake.add_repo(REPO, {**files, **UNWANTED})
        fake.cache = point_hf_at(fake.url, tmp_path / "hf-home", monkeypatch)
        yield fake


def _snapshot(hub: FakeHub, repo_id: str = REPO) -> Path:
    return hub.cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / hub.repos[repo_id].commit


def test_pull_list_info_resolve(hub: FakeHub, tiny_llama: Path) -> None:
    code, out, err = run_cli("models", "pull", REPO)
    assert code == 0, err
    assert "pulled tiny/llama" in out

    snapshot = _snapshot(hub)
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ):
        assert (snapshot / name).read_bytes() == (tiny_llama / name).read_bytes(), name
    for name in UNWANTED:  # only what the engine needs is fetched
        assert not (snapshot / name).exists()
        assert hub.served(name) == []
    assert (hub.cache / "models--tiny--llama" / "refs" / "main").read_text() == hub.repos[REPO].commit

    code, out, _ = run_cli("models", "list")
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith(REPO))
    assert "hf-cache" in row and "LlamaForCausalLM" in row and row.rstrip().endswith("ok")
    assert "2048" in row and "f32" in row

    code, out, _ = run_cli("models", "info", REPO)
    assert code == 0
    assert f"{REPO} @ {hub.repos[REPO].commit}" in out and "memory" in out and "fits" in out

    from chatapp.store import resolve_model

    resolved = resolve_model(REPO)
    assert resolved.source == "hf-cache" and resolved.path == snapshot

    # A second pull finds everything in the cache and fetches no file again.
    before = len(hub.served("model.safetensors"))
    assert run_cli("models", "pull", REPO)[0] == 0
    assert len(hub.served("model.safetensors")) == before


def _cut_point(weights: bytes) -> int:
    """Where to drop the connection: huggingface_hub writes whole 10 MiB chunks, so a cut on a chunk
    boundary is exactly the point a resume must start from."""
    from huggingface_hub import constants

    assert len(weights) > constants.DOWNLOAD_CHUNK_SIZE, "the test weights must be bigger than one chunk"
    return constants.DOWNLOAD_CHUNK_SIZE


def test_dropped_connection_resumes_with_a_range_request(hub: FakeHub, tiny_llama: Path) -> None:
    weights = (tiny_llama / "model.safetensors").read_bytes()
    half = _cut_point(weights)
    hub.interrupt("model.safetensors", half)

    code, _, err = run_cli("models", "pull", REPO)
    assert code == 0, err
    gets = hub.served("model.safetensors")
    assert [g.range for g in gets] == [None, f"bytes={half}-"]
    assert (_snapshot(hub) / "model.safetensors").read_bytes() == weights


def test_failed_pull_keeps_its_partial_file_and_the_next_pull_resumes_it(hub: FakeHub, tiny_llama: Path) -> None:
    from huggingface_hub import scan_cache_dir

    weights = (tiny_llama / "model.safetensors").read_bytes()
    half = _cut_point(weights)
    hub.interrupt("model.safetensors", half, fail_next=1)  # drop half-way, then the retry fails too

    code, _, err = run_cli("models", "pull", REPO)
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    partial = scan_cache_dir(hub.cache).incomplete_files
    assert [p.size_on_disk for p in partial] == [half]
    from chatapp.store import ModelNotFoundError, resolve_model

    with pytest.raises(ModelNotFoundError, match="only partly downloaded"):
        resolve_model(REPO)
    listed = next(line for line in run_cli("models", "list")[1].splitlines() if line.startswith(REPO))
    assert "download interrupted; run `chatapp models pull tiny/llama` to finish it" in listed

    first_try = len(hub.served("model.safetensors"))
    code, _, err = run_cli("models", "pull", REPO)
    assert code == 0, err
    resumed = hub.served("model.safetensors")[first_try:]
    assert [g.range for g in resumed] == [f"bytes={half}-"]
    assert (_snapshot(hub) / "model.safetensors").read_bytes() == weights
    assert not scan_cache_dir(hub.cache).incomplete_files


def test_a_corrupt_partial_file_is_caught_by_its_checksum(hub: FakeHub, tiny_llama: Path) -> None:
    weights = (tiny_llama / "model.safetensors").read_bytes()
    sha = hub.repos[REPO].sha256("model.safetensors")
    blobs = hub.cache / "models--tiny--llama" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{sha}.incomplete").write_bytes(b"\xff" * 1000)  # not the file's first bytes

    code, _, err = run_cli("models", "pull", REPO)
    assert code == 1 and "checksum" in err
    assert not (blobs / f"{sha}.incomplete").exists()
    assert run_cli("models", "pull", REPO)[0] == 0
    assert (_snapshot(hub) / "model.safetensors").read_bytes() == weights


def test_unsupported_architecture_is_refused_before_any_weights(hub: FakeHub, tiny_llama: Path) -> None:
    hub.add_repo("other/mamba", with_config(tiny_llama, architectures=["MambaForCausalLM"], model_type="mamba"))

    code, _, err = run_cli("models", "pull", "other/mamba")
    assert code == 1
    assert "MambaForCausalLM is not supported" in err and err.count("\n") == 1
    assert hub.served("model.safetensors") == []
    assert not (hub.cache / "models--other--mamba").exists()  # nothing left in the cache


def test_quantised_checkpoint_is_refused_before_any_weights(hub: FakeHub, tiny_llama: Path) -> None:
    hub.add_repo("other/gptq", with_config(tiny_llama, quantization_config={"quant_method": "gptq", "bits": 4}))
    code, _, err = run_cli("models", "pull", "other/gptq")
    assert code == 1 and "gptq" in err
    assert hub.served("model.safetensors") == []


def test_model_too_big_for_memory_is_refused_before_any_weights(hub: FakeHub, tiny_llama: Path) -> None:
    # A config describing ~70B parameters: 280 GB of float32 weights.
    big = with_config(
        tiny_llama,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
    )
    hub.add_repo("big/llama", big)

    code, out, err = run_cli("models", "pull", "big/llama")
    assert code == 1
    assert "will not fit in memory" in err and "--force" in err
    assert "will not fit" in out  # the estimate was shown before refusing
    assert hub.served("model.safetensors") == []


def test_not_enough_disk_space_is_refused_before_any_weights(hub: FakeHub, tiny_llama: Path) -> None:
    files = {p.name: p.read_bytes() for p in tiny_llama.iterdir() if p.is_file()}
    hub.add_repo("huge/llama", files, declared_sizes={"model.safetensors": 10**18})

    code, _, err = run_cli("models", "pull", "huge/llama")
    assert code == 1 and "not enough disk space" in err
    assert hub.served("model.safetensors") == []


def test_private_repo_needs_a_login_and_uses_the_token(
    hub: FakeHub, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {p.name: p.read_bytes() for p in tiny_llama.iterdir() if p.is_file()}
    hub.add_repo("me/private", files, token="hf_secret")

    code, _, err = run_cli("models", "pull", "me/private")
    assert code == 1
    assert "HTTP 401" in err and "hf auth login" in err and "HF_TOKEN" in err
    assert hub.served("model.safetensors") == []

    monkeypatch.setenv("HF_TOKEN", "hf_expired_token")
    code, _, err = run_cli("models", "pull", "me/private")
    assert code == 1 and "refused (HTTP 401)" in err and "hf auth login" in err

    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    first = len(hub.requests)
    code, _, err = run_cli("models", "pull", "me/private")
    assert code == 0, err
    to_hub = [r for r in hub.requests[first:] if not r.path.startswith("/cdn/")]
    assert to_hub and all(r.authorization == "Bearer hf_secret" for r in to_hub)
    cdn = hub.served("model.safetensors")
    assert cdn and all(r.authorization is None for r in cdn)  # the token never goes to the CDN


def test_gated_repo_says_how_to_get_access(hub: FakeHub, tiny_llama: Path) -> None:
    files = {p.name: p.read_bytes() for p in tiny_llama.iterdir() if p.is_file()}
    hub.add_repo("corp/gated", files, token="hf_allowed", gated=True)

    code, _, err = run_cli("models", "pull", "corp/gated")
    assert code == 1
    assert "gated" in err and "hf auth login" in err
    assert hub.served("model.safetensors") == []


def test_offline_and_unreachable_hub_give_one_clear_line_and_cached_models_still_work(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    assert run_cli("models", "pull", REPO)[0] == 0

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code, _, err = run_cli("models", "pull", "tiny/other")
    assert code == 1 and "offline" in err and err.count("\n") == 1
    code, out, _ = run_cli("models", "list")
    assert code == 0 and REPO in out
    assert run_cli("models", "info", REPO)[0] == 0
    from chatapp.store import resolve_model

    assert resolve_model(REPO).source == "hf-cache"

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}")
    code, _, err = run_cli("models", "pull", "tiny/other")
    assert code == 1 and "cannot reach the Hugging Face Hub" in err and err.count("\n") == 1


def test_bad_specs_are_one_line_errors(hub: FakeHub) -> None:
    for spec, message in (
        ("nonsense", "not a Hugging Face repo id"),
        ("a/b:weights.bin", "only a .gguf file"),
        ("nobody/nothing", "not found on the Hub"),
    ):
        code, _, err = run_cli("models", "pull", spec)
        assert code == 1 and message in err and err.count("\n") == 1, (spec, err)


def test_gguf_pull_fetches_only_the_chosen_file(hub: FakeHub, tmp_path: Path) -> None:
    small = tiny_gguf(tmp_path / "tiny-Q8_0.gguf").read_bytes()
    other = tiny_gguf(tmp_path / "tiny-F16.gguf", rows=128).read_bytes()
    hub.add_repo(
        "tiny/gguf",
        {"tiny-Q8_0.gguf": small, "tiny-F16.gguf": other, "README.md": b"hi"},
        info={"gguf": {"total": 128, "architecture": "llama", "context_length": 2048}},
    )
    mamba = tiny_gguf(tmp_path / "mamba.gguf", arch="mamba", rows=32).read_bytes()
    hub.add_repo("tiny/mamba-gguf", {"mamba-Q4.gguf": mamba}, info={"gguf": {"total": 128, "architecture": "mamba"}})

    code, out, err = run_cli("models", "pull", "tiny/gguf:tiny-Q8_0.gguf")
    assert code == 0, err
    assert hub.served("tiny-F16.gguf") == [] and hub.served("README.md") == []
    assert (_snapshot(hub, "tiny/gguf") / "tiny-Q8_0.gguf").read_bytes() == small

    code, out, _ = run_cli("models", "list")
    row = next(line for line in out.splitlines() if line.startswith("tiny/gguf:tiny-Q8_0.gguf"))
    assert "F16" in row and "2048" in row and row.rstrip().endswith("ok")

    code, _, err = run_cli("models", "pull", "tiny/mamba-gguf:mamba-Q4.gguf")
    assert code == 1 and "'mamba' is not supported" in err
    assert hub.served("mamba-Q4.gguf") == []

    # Without the Hub's GGUF summary the file's own header is checked once it is here.
    hub.add_repo(
        "tiny/plain-gguf", {"a.gguf": small, "b.gguf": tiny_gguf(tmp_path / "b.gguf", arch="mamba").read_bytes()}
    )
    code, out, err = run_cli("models", "pull", "tiny/plain-gguf:a.gguf")
    assert code == 0 and "memory: fits" in out, err
    code, out, err = run_cli("models", "pull", "tiny/plain-gguf:b.gguf")
    assert code == 1 and "cannot run tiny/plain-gguf:b.gguf" in err and "models rm" in err

    # Removing one GGUF file keeps the repo's other one; removing the last one removes the repo.
    code, out, err = run_cli("models", "rm", "tiny/plain-gguf:b.gguf", "--yes")
    assert code == 0, err
    names = [line.split()[0] for line in run_cli("models", "list")[1].splitlines()[1:]]
    assert "tiny/plain-gguf:a.gguf" in names and "tiny/plain-gguf:b.gguf" not in names
    assert run_cli("models", "rm", "tiny/plain-gguf:a.gguf", "--yes")[0] == 0
    assert not (hub.cache / "models--tiny--plain-gguf").exists()
    code, _, err = run_cli("models", "pull", "tiny/gguf:missing.gguf")
    assert code == 1 and "tiny-F16.gguf" in err  # says which files there are
    code, _, err = run_cli("models", "pull", "tiny/gguf")
    assert code == 1 and "tiny/gguf:tiny-" in err  # no config.json: suggests pulling a GGUF file


def test_a_split_gguf_model_is_pulled_listed_run_and_removed_as_one(hub: FakeHub, tmp_path: Path) -> None:
    """A model split in parts (NAME-00001-of-00003.gguf ...), as many Hub repos publish larger files: pulling
    any part fetches them all, the list shows one model under its first part, any part's name runs it,
    a missing part is named, and `models rm` deletes every part."""
    from chatapp.engine import LLM, SamplingParams
    from chatapp.store import ModelNotFoundError, resolve_model
    from tests.gguf_models import write_llama_gguf

    first = write_llama_gguf(tmp_path / "m-Q8_0.gguf", mix="Q8_0", seed=21, split_max_tensors=8)
    parts = {p.name: p.read_bytes() for p in sorted(tmp_path.glob("m-Q8_0-*-of-*.gguf"))}
    names = sorted(parts)
    assert len(names) == 3 and names[0] == first.name
    summary = {"gguf": {"total": 1_000_000, "architecture": "llama", "context_length": 2048}}
    hub.add_repo("tiny/split", {**parts, "other.gguf": tiny_gguf(tmp_path / "other.gguf").read_bytes()}, info=summary)

    code, out, err = run_cli("models", "pull", f"tiny/split:{names[1]}")
    assert code == 0, err
    snapshot = _snapshot(hub, "tiny/split")
    for name, data in parts.items():
        assert (snapshot / name).read_bytes() == data
    assert hub.served("other.gguf") == []
    rows = [line for line in run_cli("models", "list")[1].splitlines() if line.startswith("tiny/split:")]
    assert len(rows) == 1 and rows[0].startswith(f"tiny/split:{names[0]}") and rows[0].rstrip().endswith("ok")
    resolved = resolve_model(f"tiny/split:{names[2]}")
    assert resolved.name == f"tiny/split:{names[0]}" and resolved.path == snapshot / names[0]
    out = LLM(f"tiny/split:{names[2]}", kv_cache_memory_gib=0.02).generate(["hi"], SamplingParams(max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3

    (snapshot / names[2]).unlink()  # as an interrupted pull leaves it
    row = next(line for line in run_cli("models", "list")[1].splitlines() if line.startswith("tiny/split:"))
    assert "1 of its 3 parts are not downloaded" in row
    with pytest.raises(ModelNotFoundError, match="only partly downloaded"):
        resolve_model(f"tiny/split:{names[0]}")
    assert run_cli("models", "pull", f"tiny/split:{names[0]}")[0] == 0  # puts the missing part back
    assert (snapshot / names[2]).read_bytes() == parts[names[2]] and len(hub.served(names[1])) == 1
    assert resolve_model(f"tiny/split:{names[0]}").path == snapshot / names[0]

    assert run_cli("models", "pull", "tiny/split:other.gguf")[0] == 0
    code, out, err = run_cli("models", "rm", f"tiny/split:{names[0]}", "--yes")
    assert code == 0 and f"delete {names[0]} and its 2 other parts of tiny/split" in out, err
    assert sorted(p.name for p in snapshot.iterdir()) == ["other.gguf"]
    assert [line.split()[0] for line in run_cli("models", "list")[1].splitlines() if "tiny/split" in line] == [
        "tiny/split:other.gguf"
    ]

    hub.add_repo("tiny/split-broken", {n: parts[n] for n in names[:2]}, info=summary)
    fetched = len(hub.served(names[0]))
    code, _, err = run_cli("models", "pull", f"tiny/split-broken:{names[0]}")
    assert code == 1 and f"the repo lacks {names[2]}" in err
    assert len(hub.served(names[0])) == fetched  # refused before any part is fetched


def test_rm_asks_first_and_deletes_from_the_hf_cache(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_cli("models", "pull", REPO)[0] == 0
    repo_dir = hub.cache / "models--tiny--llama"

    code, _, err = run_cli("models", "rm", REPO)  # stdin is not a terminal here
    assert code == 1 and "--yes" in err and repo_dir.exists()

    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    code, out, _ = run_cli("models", "rm", REPO)
    assert code == 1 and "nothing removed" in out and repo_dir.exists()

    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    code, out, _ = run_cli("models", "rm", REPO)
    assert code == 0 and not repo_dir.exists()
    assert REPO not in run_cli("models", "list")[1]


def test_search_lists_runnable_text_generation_models_with_a_memory_label(hub: FakeHub) -> None:
    from chatapp.hub import search_models

    hub.add_repo(
        "org/small-llama",
        {},
        info={
            "downloads": 300,
            "config": {"architectures": ["LlamaForCausalLM"]},
            "safetensors": {"parameters": {"BF16": 135_000_000}, "total": 135_000_000},
        },
    )
    hub.add_repo(
        "org/mid-qwen",
        {},
        info={
            "downloads": 200,
            "config": {"architectures": ["Qwen2ForCausalLM"]},
            "safetensors": {"parameters": {"BF16": 1_500_000_000}, "total": 1_500_000_000},
        },
    )
    hub.add_repo(
        "org/big-llama-gguf",
        {},
        info={"downloads": 100, "tags": ["gguf"], "gguf": {"total": 70_000_000_000, "architecture": "llama"}},
    )
    hub.add_repo(
        "org/gpt2",
        {},
        info={
            "downloads": 1000,
            "config": {"architectures": ["GPT2LMHeadModel"]},
            "safetensors": {"parameters": {"F32": 124_000_000}, "total": 124_000_000},
        },
    )
    hub.add_repo(
        "org/mamba-gguf", {}, info={"downloads": 900, "gguf": {"total": 3_800_000_000, "architecture": "mamba"}}
    )
    hub.add_repo("org/llama-vision", {}, info={"downloads": 5000, "pipeline_tag": "image-text-to-text"})

    results = search_models("", limit=10, available_bytes=16 << 30)
    by_id = {r.repo_id: r for r in results}
    assert "org/gpt2" not in by_id and "org/mamba-gguf" not in by_id and "org/llama-vision" not in by_id
    assert [r.repo_id for r in results if r.repo_id.startswith("org/")] == [
        "org/small-llama",
        "org/mid-qwen",
        "org/big-llama-gguf",
    ]
    assert by_id["org/small-llama"].label == "fits"
    assert by_id["org/mid-qwen"].label == "will be slow"  # 6 GB of float32 weights
    assert by_id["org/big-llama-gguf"].label == "will not fit"
    assert by_id["org/big-llama-gguf"].format == "gguf"
    assert by_id["org/big-llama-gguf"].architecture == "LlamaForCausalLM"
    assert by_id["tiny/llama"].label == "size unknown"  # the listing gave no parameter count

    assert [r.repo_id for r in search_models("qwen", available_bytes=16 << 30)] == ["org/mid-qwen"]
    assert len(search_models("", limit=2)) == 2

    code, out, _ = run_cli("models", "search", "llama")
    assert code == 0 and "org/small-llama" in out and "FIT" in out


def test_cli_in_a_fresh_process_reads_the_hf_environment(hub: FakeHub, tmp_path: Path) -> None:
    """No patched constants: HF_ENDPOINT / HF_HUB_CACHE reach huggingface_hub as a user sets them."""
    env = {**os.environ, "CHATAPP_DATA_DIR": str(tmp_path / "data2")}
    pull = subprocess.run(
        [sys.executable, "-m", "chatapp", "models", "pull", REPO], env=env, capture_output=True, text=True, timeout=120
    )
    assert pull.returncode == 0, pull.stderr
    listing = subprocess.run(
        [sys.executable, "-m", "chatapp", "models", "list"],
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listing.returncode == 0, listing.stderr
    assert any(line.startswith(REPO) for line in listing.stdout.splitlines())
    assert (_snapshot(hub) / "model.safetensors").exists()


def test_plan_pull_reports_files_and_estimate_without_downloading(hub: FakeHub) -> None:
    from chatapp.hub import plan_pull

    plan = plan_pull(REPO, available_bytes=8 << 30)
    names = [f.name for f in plan.files]
    assert names[0] == "config.json" and names[-1] == "model.safetensors"
    assert set(names).isdisjoint(UNWANTED)
    assert plan.commit == hub.repos[REPO].commit
    assert plan.estimate is not None and plan.estimate.label == "fits"
    assert plan.facts is not None and plan.facts.parameters == plan.estimate.weights_bytes // 4
    assert not hub.cache.exists() or not any(hub.cache.iterdir())


def test_a_gguf_pull_plan_counts_the_memory_its_type_will_take(hub: FakeHub, tmp_path: Path) -> None:
    """A Q2_K file runs in float32 (12x its bytes): its plan says so before anything is downloaded, where
    the download's size would call a 7B of 3 GB "fits" on 16 GB and the engine then refuse it."""
    from chatapp.hub import plan_pull
    from chatapp.model_facts import cpu_bytes_per_file_byte

    data = tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    info = {"gguf": {"total": 128, "architecture": "llama", "context_length": 2048}}
    hub.add_repo("tiny/typed-gguf", {"tiny-Q2_K.gguf": data, "tiny-Q4_K_M.gguf": data}, info=info)
    wide = plan_pull("tiny/typed-gguf:tiny-Q2_K.gguf", available_bytes=16 << 30)
    own = plan_pull("tiny/typed-gguf:tiny-Q4_K_M.gguf", available_bytes=16 << 30)
    assert wide.facts is not None and own.facts is not None
    assert wide.facts.weights_bytes == int(len(data) * cpu_bytes_per_file_byte("tiny-Q2_K.gguf")) > 12 * len(data)
    assert own.facts.weights_bytes == int(len(data) * cpu_bytes_per_file_byte("tiny-Q4_K_M.gguf")) < 1.1 * len(data)
    assert not hub.served("tiny-Q2_K.gguf")


def test_pulled_model_loads_in_the_engine_and_generates(hub: FakeHub, tiny_llama: Path) -> None:
    from chatapp.engine import LLM, SamplingParams

    assert run_cli("models", "pull", REPO)[0] == 0
    params = SamplingParams(temperature=0, max_tokens=5)
    pulled = LLM(model=REPO, num_kv_blocks=64)
    assert pulled.core.model.source == "hf-cache"
    out = pulled.generate(["hi"], params)[0]
    assert len(out.outputs[0].token_ids) == 5
    # The same weights straight from the directory the fake Hub served give the same tokens.
    original = LLM(model=str(tiny_llama), num_kv_blocks=64).generate(["hi"], params)[0]
    assert out.outputs[0].token_ids == original.outputs[0].token_ids


def test_progress_counts_every_byte_once_even_across_a_dropped_connection(hub: FakeHub, tiny_llama: Path) -> None:
    from chatapp.hub import pull

    weights = (tiny_llama / "model.safetensors").read_bytes()
    hub.interrupt("model.safetensors", _cut_point(weights))
    received: list[int] = []
    path = pull(REPO, progress=received.append)
    on_disk = sum(f.stat().st_size for f in path.iterdir())
    assert sum(received) == on_disk and len(received) > 1


def test_a_search_with_the_hub_unreachable_fails_after_one_try(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """huggingface_hub's own listing retries five times with back-off (~25 s of "Retrying in ..."
    lines); the models screen's search says it cannot reach the Hub after one short try."""
    from huggingface_hub import constants

    from chatapp import hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    import httpx2

    calls: list[str] = []
    real_get = httpx2.get

    def counting_get(url: str, **kwargs: Any) -> Any:
        calls.append(url)
        return real_get(url, **kwargs)

    monkeypatch.setattr(httpx2, "get", counting_get)
    with caplog.at_level(logging.WARNING), pytest.raises(hub.HubError, match="cannot reach the Hugging Face Hub"):
        hub.search_models("llama")
    assert calls == ["http://127.0.0.1:9/api/models"]  # one try
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]
