"""The engine on a CUDA GPU against Hugging Face generate() on the same GPU (issue 21's goals).

For the bundled SmolLM2 (its GGUF de-quantised to bfloat16) and a random ~1B Llama in bfloat16:

- single-stream decode tokens/s: ours with CUDA graphs (and eager, for the record) against HF
  generate() (goal: >= 3x);
- 64 requests at once, aggregate tokens/s, against HF run one request after another, i.e. its
  single-stream rate (goal: >= 20x);
- prefill tokens/s of a 2,048-token prompt: ours against one HF forward of it;
- for the ~1B model, single-stream decode as a share of the memory-bandwidth roofline: a decode
  step must read every weight once, so the roofline is copy bandwidth / weight bytes, with the
  bandwidth measured on this GPU in the same run (goal: >= 50%).

Our engine runs three ways: as it is by default (CUDA graphs and overlapped steps), without
overlapped steps (graphs only; its 64-way tokens must equal the default's), and eager (neither).

    python benchmarks/gpu.py [--models bundled,1b] [--json out.json] [--tokenizer DIR]

``--tokenizer`` takes the bundled model's tokenizer files from DIR (for the ~1B model) on a machine
where the bundled model is not installed.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# isort: off
import chatapp  # noqa: E402,F401  first: it sets the OpenMP wait policy before torch loads

# isort: on
import torch  # noqa: E402

from benchmarks.common import prompt_of_tokens  # noqa: E402
from chatapp.engine import LLM, SamplingParams  # noqa: E402

NEW_TOKENS = 128
WIDE = 64
PREFILL_TOKENS = 2048
REPEATS = 3


def seconds(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def make_1b_model(path: Path, tokenizer_dir: Path | None = None) -> Path:
    """A random Llama of Llama-3.2-1B's shape (16 layers, 2048 wide, GQA 32:8) with the bundled tokenizer."""
    import transformers

    from chatapp.engine.tokenizer import prepare_tokenizer_files
    from chatapp.store import bundled_gguf_path

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.02,
    )
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    tokenizer_files = tokenizer_dir or prepare_tokenizer_files(bundled_gguf_path())
    shutil.copytree(tokenizer_files, path, dirs_exist_ok=True)
    return path


def hf_figures(path: str, prompt: list[int], long_prompt: list[int]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    ids = torch.tensor([prompt], device="cuda")

    def generate(n: int) -> None:
        with torch.no_grad():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )

    generate(8)  # warm-up
    rates = [(NEW_TOKENS - 1) / (seconds(lambda: generate(NEW_TOKENS)) - seconds(lambda: generate(1)))]
    rates += [(NEW_TOKENS - 1) / (seconds(lambda: generate(NEW_TOKENS)) - seconds(lambda: generate(1)))]
    long_ids = torch.tensor([long_prompt], device="cuda")
    with torch.no_grad():
        model(long_ids)
        prefill = min(seconds(lambda: model(long_ids)) for _ in range(REPEATS))
    return {"decode_tok_s": max(rates), "prefill_tok_s": len(long_prompt) / prefill}


def our_figures(
    model: str | None, tokenizer_prompts: Callable[[int, int], list[int]], graphs: bool, overlap: bool = True
) -> dict[str, Any]:
    llm = LLM(model, dtype="bfloat16", kv_cache_memory_gib=16, cuda_graphs=graphs, overlap_steps=overlap)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1)
    prompt = tokenizer_prompts(32, 0)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    rates = []
    for _ in range(REPEATS):
        total = seconds(lambda: llm.generate([prompt], greedy))
        rates.append((NEW_TOKENS - 1) / (total - seconds(lambda: llm.generate([prompt], first))))
    out: dict[str, Any] = {"decode_tok_s": statistics.median(rates)}
    if graphs:
        wide = [tokenizer_prompts(32, 100 + i) for i in range(WIDE)]
        llm.generate(wide[:8], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        wide_runs = [seconds(lambda: llm.generate(wide, greedy)) for _ in range(REPEATS)]
        out["wide_tok_s"] = WIDE * NEW_TOKENS / statistics.median(wide_runs)
        out["wide_tokens"] = [o.outputs[0].token_ids for o in llm.generate(wide, greedy)]
    if graphs and overlap:
        prefill = []
        for i in range(REPEATS):  # a new prompt each time: nothing comes from the prefix cache
            long_prompt = [tokenizer_prompts(PREFILL_TOKENS, 1000 + i)]
            prefill.append(seconds(lambda: llm.generate(long_prompt, first)))  # noqa: B023  (called at once)
        out["prefill_tok_s"] = PREFILL_TOKENS / statistics.median(prefill)
        out["weight_bytes"] = sum(p.numel() * p.element_size() for p in llm.core.runner.model.parameters())
    return out


def release() -> None:
    """Give the last model's memory back before the next one loads."""
    gc.collect()
    torch.cuda.empty_cache()


def bench(name: str, engine_model: str | None, hf_path: str) -> dict[str, float]:
    from chatapp.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(hf_path)

    def prompts(n: int, seed: int) -> list[int]:
        return prompt_of_tokens(tokenizer, n, seed)

    ours = our_figures(engine_model, prompts, graphs=True)
    release()
    stepwise = our_figures(engine_model, prompts, graphs=True, overlap=False)
    release()
    eager = our_figures(engine_model, prompts, graphs=False, overlap=False)
    release()
    same = ours["wide_tokens"] == stepwise["wide_tokens"]
    print(f"[{name}] 64-way greedy tokens, overlapped vs step by step: {'the same' if same else 'DIFFERENT'}")
    hf = hf_figures(hf_path, prompts(32, 0), prompts(PREFILL_TOKENS, 999))
    release()
    result = {
        "ours_decode_tok_s": ours["decode_tok_s"],
        "ours_stepwise_decode_tok_s": stepwise["decode_tok_s"],
        "ours_eager_decode_tok_s": eager["decode_tok_s"],
        "ours_stepwise_64way_tok_s": stepwise["wide_tok_s"],
        "overlap_tokens_same": float(same),
        "hf_decode_tok_s": hf["decode_tok_s"],
        "decode_x_hf": ours["decode_tok_s"] / hf["decode_tok_s"],
        "ours_64way_tok_s": ours["wide_tok_s"],
        "64way_x_hf_sequential": ours["wide_tok_s"] / hf["decode_tok_s"],
        "ours_prefill_tok_s": ours["prefill_tok_s"],
        "hf_prefill_tok_s": hf["prefill_tok_s"],
        "prefill_x_hf": ours["prefill_tok_s"] / hf["prefill_tok_s"],
        "weight_gb": ours["weight_bytes"] / 1e9,
    }
    print(f"[{name}] " + ", ".join(f"{k}={v:.3g}" for k, v in result.items()), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bundled,1b")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tokenizer", type=Path, help="the bundled model's tokenizer files, for the ~1B model")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU")
    bandwidth = copy_bandwidth()
    results: dict[str, object] = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gb_s": bandwidth / 1e9}
    print(f"{results['device']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "bundled":
                from tests.hf_reference import bundled_hf_dir

                results[name] = bench(name, None, str(bundled_hf_dir()))
            elif name == "1b":
                path = str(make_1b_model(Path(tmp) / "llama-1b", args.tokenizer))
                figures = bench(name, path, path)
                roofline = bandwidth / (figures["weight_gb"] * 1e9)
                figures["roofline_tok_s"] = roofline
                figures["share_of_roofline"] = figures["ours_decode_tok_s"] / roofline
                print(f"[1b] roofline {roofline:.0f} tok/s; ours at {figures['share_of_roofline']:.0%}", flush=True)
                results[name] = figures
            else:
                sys.exit(f"unknown model {name!r}: bundled or 1b")
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
