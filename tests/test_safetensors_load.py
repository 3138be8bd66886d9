"""Safetensors checkpoints load one decoder layer at a time into the configured format
(chatapp/engine/models/loader.py, chatapp/engine/load_quantizer.py): no float32 model whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from chatapp.engine.llm import LLM
from chatapp.engine.load_quantizer import LoadQuantizer, calibration_prefill, single_prefill_attention
from chatapp.engine.models.config import load_model_config
from chatapp.engine.models.loader import CheckpointError, load_model
from chatapp.engine.quantization import Int8Linear, quantize_int8
from chatapp.engine.sampling_params import SamplingParams
from tests.tiny_model import make_tiny_model, write_llama_checkpoint

CPU = torch.device("cpu")


def _calibration(path: Path):
    return calibration_prefill(path, load_model_config(path), CPU, torch.float32, 512, 16)


def _logits(model, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits of one prompt through the Python model (torch attention, own cache)."""
    attn = single_prefill_attention(model.config, len(ids), CPU, torch.float32, 16)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn))


def test_asking_a_checkpoint_for_gguf_types_is_refused_by_name(tmp_path: Path) -> None:
    """quantization="gguf" keeps a GGUF file's own blocks: a safetensors checkpoint has none, and used to
    load unquantized without a word."""
    path = make_tiny_model(tmp_path / "m", num_layers=2)
    with pytest.raises(ValueError, match=r"quantization='gguf'.* m is not a GGUF file: use auto, int4, int8 or None"):
        LLM(str(path), device="cpu", quantization="gguf", kv_cache_memory_gib=0.01)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM"])
def test_int8_quantized_while_loading_equals_quantizing_the_whole_float_model(tmp_path: Path, arch: str) -> None:
    """The layer-by-layer calibration and quantization give the very bits of the whole-model pass."""
    path = make_tiny_model(tmp_path / "m", arch, num_layers=3, tie_word_embeddings=False, seed=3)
    mc = load_model_config(path)
    whole = load_model(path, mc, torch.float32, CPU, 512)
    quantize_int8(whole, _calibration(path))
    quantizer = LoadQuantizer("int8", None, lambda: _calibration(path))
    streamed = load_model(path, mc, torch.float32, CPU, 512, quantizer)
    assert quantizer.applied == "int8"
    assert isinstance(streamed.layers[2].mlp.down_proj, Int8Linear) and streamed.lm_head is None
    ids = list(range(5, 60, 3))
    assert torch.equal(_logits(streamed, ids), _logits(whole, ids))


def test_a_bf16_checkpoint_keeps_its_embedding_table_in_bf16_when_quantized(tmp_path: Path) -> None:
    """The table's rows are exact once looked up in float32, so int8 answers match those of the same
    model loaded with a float32 table."""
    path = write_llama_checkpoint(
        tmp_path / "bf16", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
    )
    mc = load_model_config(path)
    compact = load_model(path, mc, torch.float32, CPU, 512, LoadQuantizer("int8", None, lambda: _calibration(path)))
    assert compact.embed_tokens.weight.dtype == torch.bfloat16
    full = load_model(path, mc, torch.float32, CPU, 512)
    assert full.embed_tokens.weight.dtype == torch.float32
    quantize_int8(full, _calibration(path))
    ids = list(range(100, 140))
    assert torch.equal(_logits(compact, ids), _logits(full, ids))


_RSS_PROBE = """
import json, sys
from pathlib import Path
import psutil, torch
from chatapp.engine import cpu_kernels
from chatapp.engine.load_quantizer import LoadQuantizer, calibration_prefill
from chatapp.engine.models.config import load_model_config
from chatapp.engine.models.loader import load_model
path, mode = Path(sys.argv[1]), sys.argv[2]
ext = cpu_kernels.load()
mc = load_model_config(path)
cpu = torch.device("cpu")
# What any load pays once comes first: the tokenizer, the calibration's scratch cache, fbgemm.
calibration = calibration_prefill(path, mc, cpu, torch.float32, 512, 16)
torch.ops.quantized.linear_prepack(torch.quantize_per_tensor(torch.zeros(16, 16), 1.0, 0, torch.qint8), None)
def high_water() -> int:  # VmHWM: this process's own peak (ru_maxrss would carry the parent's across exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
before = psutil.Process().memory_info().rss
assert high_water() < before + 64 * 2**20, "the warm-up must not leave a peak above the start"
quantizer = LoadQuantizer(mode, ext, lambda: calibration)
model = load_model(path, mc, torch.float32, cpu, 2048, quantizer)
print(json.dumps({"applied": quantizer.applied, "before": before, "peak": high_water()}))
"""


@pytest.fixture(scope="module")
def checkpoint_300mb(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A ~370 MB bf16 Llama checkpoint in two shards, with an untied 49k-row LM head."""
    path = write_llama_checkpoint(
        tmp_path_factory.mktemp("st") / "m",
        hidden_size=1024,
        num_layers=8,
        num_heads=16,
        num_kv_heads=4,
        intermediate_size=2816,
    )
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    assert 300e6 < size < 450e6
    return path, size


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_loading_a_bf16_checkpoint_quantized_adds_at_most_1_3x_its_size_to_peak_rss(
    checkpoint_300mb: tuple[Path, int], mode: str
) -> None:
    """As a float32 model the checkpoint would be twice its size: loaded layer by layer into int8 or
    int4, the peak stays under 1.3x the file (measured 1.07x and 0.97x)."""
    path, size = checkpoint_300mb
    probe = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(path), mode], capture_output=True, text=True, timeout=600
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    rss = json.loads(probe.stdout.strip().splitlines()[-1])
    assert rss["applied"] == mode
    assert rss["peak"] - rss["before"] <= 1.3 * size, (rss, size)


def test_a_quantized_checkpoint_is_sized_as_quantized_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fit check counts int8 weights, not float32 ones: with memory for the first but not the
    second, int8 loads and float32 is refused before a weight is read."""
    import psutil

    from chatapp.engine.model_runner import ModelTooLargeError

    path = write_llama_checkpoint(
        tmp_path / "m", hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=2, intermediate_size=2048
    )
    real = psutil.virtual_memory()
    # float32: 12 x 4.2M + 2 x 25M parameters = ~0.4 GB; int8: ~0.16 GB plus the 0.5 GB working allowance
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=int(0.85 * 2**30)))
    with pytest.raises(ModelTooLargeError, match="needs about"):
        LLM(str(path), kv_cache_memory_gib=0.02, quantization=None)
    llm = LLM(str(path), kv_cache_memory_gib=0.02, quantization="int8")
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


# --- bad checkpoints: a clear error naming the tensor ----------------------------------------------


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Path:
    return make_tiny_model(tmp_path / "tiny", "LlamaForCausalLM", seed=1)


def _rewrite(path: Path, edit) -> None:
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    edit(tensors)
    save_file(tensors, str(weights), metadata={"format": "pt"})


def test_a_missing_tensor_is_named(tiny_checkpoint: Path) -> None:
    _rewrite(tiny_checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"lacks weights: layers\.1\.mlp\.gate_up_proj\.weight"):
        LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)


def test_a_tensor_of_the_wrong_shape_is_named(tiny_checkpoint: Path) -> None:
    def widen(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 64)

    _rewrite(tiny_checkpoint, widen)
    with pytest.raises(
        CheckpointError, match=r"tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape \(48, 64\)"
    ):
        LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)


def test_an_unknown_tensor_is_refused_before_any_weight_is_read(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chatapp.engine.models import loader

    _rewrite(tiny_checkpoint, lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(4)))
    filled: list[str] = []
    real = loader._Filler.__call__
    monkeypatch.setattr(loader._Filler, "__call__", lambda self, *a, **k: filled.append("x") or real(self, *a, **k))
    with pytest.raises(CheckpointError, match=r"unexpected checkpoint tensor model\.layers\.0\.mystery\.weight"):
        LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)
    assert filled == []


def test_a_truncated_or_garbled_file_is_a_clear_error(tiny_checkpoint: Path) -> None:
    weights = tiny_checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])  # the last tensor cut short
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated: tensor .* past its end"):
        LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a safetensors file"):
        LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)


def test_odd_safetensors_headers_and_a_broken_index_are_named(tiny_checkpoint: Path) -> None:
    """A header that parses as JSON but not as a safetensors header (a list, a negative or fractional
    size) and an index that is not one: each a CheckpointError naming the file, not an AttributeError or a
    torch error about negative dimensions."""
    import struct

    weights = tiny_checkpoint / "model.safetensors"

    def write_header(header: object) -> None:
        text = json.dumps(header).encode()
        weights.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 64)

    write_header([1, 2, 3])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a safetensors file \(its header is not"):
        LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)
    for shape, offsets in (([-4, 4], [0, 64]), ([4, 4.0], [0, 64]), ([4, 4], [0]), ([4, 4], "0-64")):
        write_header({"model.embed_tokens.weight": {"dtype": "F32", "shape": shape, "data_offsets": offsets}})
        with pytest.raises(CheckpointError, match=r"the header entry of model\.embed_tokens\.weight is malformed"):
            LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)
    index = tiny_checkpoint / "model.safetensors.index.json"
    for text in ('{"weight_map": ', '{"metadata": {}}', "[]"):
        index.write_text(text)
        with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json is not a safetensors index"):
            LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)


def test_a_broken_config_or_tokenizer_file_is_named(tiny_checkpoint: Path) -> None:
    """Found by fuzzing model directories: a config.json missing a field was a bare KeyError, one cut short a
    JSONDecodeError naming no file, and a cut tokenizer.json a bare Exception from the tokenizers library."""
    from chatapp.engine.models.config import ModelConfigError
    from chatapp.engine.tokenizer import TextTokenizer, TokenizerFilesError

    config_path = tiny_checkpoint / "config.json"
    config = json.loads(config_path.read_text())
    good = config_path.read_text()
    config_path.write_text(json.dumps({k: v for k, v in config.items() if k != "hidden_size"}))
    with pytest.raises(ModelConfigError, match=r"config\.json lacks the field 'hidden_size'"):
        LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)
    config_path.write_text(json.dumps({**config, "num_attention_heads": "four"}))
    with pytest.raises(ModelConfigError, match=r"config\.json has a field of the wrong kind"):
        LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)
    config_path.write_text(json.dumps({**config, "num_hidden_layers": 0}))
    with pytest.raises(ModelConfigError, match=r"config\.json has a field .*\(the model's num_layers is 0\)"):
        LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)
    config_path.write_text(json.dumps({**config, "num_key_value_heads": 3}))
    with pytest.raises(ModelConfigError, match=r"4 attention heads do not share 3 KV heads evenly"):
        LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)
    rope = {**config.get("rope_parameters", {}), "rope_theta": -1.0}
    config_path.write_text(json.dumps({**config, "rope_theta": -1.0, "rope_parameters": rope}))
    with pytest.raises(ModelConfigError, match=r"the RoPE base frequency is -1\.0"):
        LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)
    config_path.write_text(good[: len(good) // 2])
    with pytest.raises(ModelConfigError, match=r"config\.json is not valid JSON"):
        LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)
    config_path.write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match=r"config\.json holds a list, not a JSON object"):
        LLM(str(tiny_checkpoint), kv_cache_memory_gib=0.02)
    config_path.write_text(good)
    tokenizer_json = tiny_checkpoint / "tokenizer.json"
    whole = tokenizer_json.read_bytes()
    tokenizer_json.write_bytes(whole[:1000])
    with pytest.raises(TokenizerFilesError, match=r"tokenizer\.json cannot be read"):
        TextTokenizer(tiny_checkpoint)
    tokenizer_json.write_bytes(whole)
    (tiny_checkpoint / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerFilesError, match=r"tokenizer_config\.json is not valid JSON"):
        TextTokenizer(tiny_checkpoint)


def test_weights_are_read_into_place_not_left_mapped_to_the_file(tiny_checkpoint: Path) -> None:
    """Rewriting the checkpoint after loading leaves the loaded weights as they were."""
    mc = load_model_config(tiny_checkpoint)
    model = load_model(tiny_checkpoint, mc, torch.float32, CPU, 512)
    before = model.embed_tokens.weight.clone()
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    save_file({k: torch.zeros_like(v) for k, v in tensors.items()}, str(tiny_checkpoint / "model.safetensors"))
    assert torch.equal(model.embed_tokens.weight, before)
