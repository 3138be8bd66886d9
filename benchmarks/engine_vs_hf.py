"""Our engine against Hugging Face generate(), in one process and one run.

Prints single-stream decode tokens/s, aggregate tokens/s for 16 concurrent
requests (~200-token prompts, 128 new tokens each) against HF run one request
at a time, and the TTFT of a follow-up turn on a ~2,000-token conversation
with and without prefix caching. Each figure is a ratio against its baseline
measured in the same run, since these machines are noisy.

    python benchmarks/engine_vs_hf.py [--model M] [--quantization int8] [--hf-requests 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# isort: off
import chatapp  # noqa: E402,F401  first: it sets the OpenMP wait policy before torch loads

# isort: on
import torch  # noqa: E402

from benchmarks.common import conversation, prompt_of_tokens, timed  # noqa: E402
from chatapp.engine import LLM, SamplingParams  # noqa: E402

NEW_TOKENS = 128


def hf_decode_rate(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(decode tokens/s, total seconds) of HF generate() on one prompt."""
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        with torch.no_grad():
            return timed(
                lambda: model.generate(
                    ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
                )
            )[0]

    first = run(1)
    total = run(new_tokens)
    return (new_tokens - 1) / (total - first), total


def our_decode_rate(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    first, _ = timed(lambda: llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1)))
    total, _ = timed(
        lambda: llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    )
    return (new_tokens - 1) / (total - first)


def follow_up_ttft(llm: LLM, messages: list[dict[str, str]]) -> tuple[float, int]:
    """TTFT of the follow-up turn after the conversation's previous turn was answered."""
    first = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32))[0]
    messages = messages + [
        {"role": "assistant", "content": first.outputs[0].text},
        {"role": "user", "content": "Thanks. Can you summarise that in one line?"},
    ]
    seconds, outs = timed(lambda: llm.chat(messages, SamplingParams(temperature=0, max_tokens=1)))
    return seconds, len(outs[0].prompt_token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default=None)
    parser.add_argument(
        "--hf-requests",
        type=int,
        default=4,
        help="how many of the 16 requests HF runs one at a time to measure its rate",
    )
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    llm = LLM(args.model, quantization=args.quantization)
    path = llm.core.model.path
    if path.suffix == ".gguf":  # transformers de-quantises the same file itself
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = llm.tokenizer
    prompts = [prompt_of_tokens(tok, 200, seed=i) for i in range(16)]
    print(
        f"model {llm.core.model.name}, device {llm.config.device}, threads {torch.get_num_threads()}, "
        f"quantization {llm.config.quantization}"
    )

    # 1. Single-stream decode.
    hf_rate, _ = hf_decode_rate(hf, prompts[0], NEW_TOKENS)
    our_rate = our_decode_rate(llm, prompts[0], NEW_TOKENS)
    print(
        f"single-stream decode: ours {our_rate:.1f} tok/s, HF {hf_rate:.1f} tok/s, "
        f"ratio {our_rate / hf_rate:.2f}x (goal >= 1.5x)"
    )

    # 2. 16 concurrent requests vs HF one at a time.
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    seconds, outs = timed(lambda llm=llm: llm.generate(prompts, params))
    ours_total = sum(len(o.outputs[0].token_ids) for o in outs) / seconds
    ttfts = [o.metrics["ttft_s"] for o in outs]
    hf_seconds = sum(hf_decode_rate(hf, p, NEW_TOKENS)[1] for p in prompts[: args.hf_requests])
    hf_total = args.hf_requests * NEW_TOKENS / hf_seconds
    print(
        f"16 concurrent x {NEW_TOKENS} tokens: ours {ours_total:.1f} tok/s total "
        f"(mean TTFT {sum(ttfts) / len(ttfts):.2f} s), HF sequential {hf_total:.1f} tok/s, "
        f"ratio {ours_total / hf_total:.2f}x (goal >= 4x)"
    )

    # 3. Follow-up turn on a ~2,000-token conversation, with and without prefix caching.
    history = conversation(2000, tok)
    cached, n_tokens = follow_up_ttft(llm, history)
    del llm
    uncached_llm = LLM(args.model, quantization=args.quantization, enable_prefix_caching=False)
    uncached, _ = follow_up_ttft(uncached_llm, history)
    print(
        f"follow-up TTFT on a {n_tokens}-token conversation: cached {cached * 1000:.0f} ms, "
        f"uncached {uncached * 1000:.0f} ms, ratio {uncached / cached:.1f}x (goal >= 10x)"
    )


if __name__ == "__main__":
    main()
