"""How closely the int8 and int4 engines follow float32: greedy agreement on the bundled model.

With --kv-cache: how closely a float16 KV cache (the CPU default) follows a float32 one, the
weights the same (each --quantization given, "none" for float32 weights).

For each chat prompt, float32 answers greedily; the quantized engine then reads
float32's answer token by token (teacher forcing) and we count how often its
own top choice is float32's next token. Also reported: how many whole answers
come out identical, and the largest logit difference.

    python benchmarks/quality.py [--model M] [--tokens 32]
    python benchmarks/quality.py --kv-cache --quantization none auto
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import chatapp  # noqa: E402,F401
import torch  # noqa: E402

from chatapp.engine import LLM, SamplingParams  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "How do I reverse a list in Python?",
    "Give me three tips for better sleep.", "Explain photosynthesis to a child.", "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.", "Write a SQL query that counts users by country.",
    "Why is the sky blue?", "Suggest a name for a bakery.", "What are prime numbers?",
    "Summarise the plot of Romeo and Juliet in two sentences.", "How does a hash map work?",
    "Write a short poem about autumn leaves.", "What causes earthquakes?", "List four planets of the solar system.",
    "How do I make a cup of tea?", "What is the difference between a list and a tuple in Python?",
    "Give me a fun fact about octopuses.", "What is machine learning?", "How many legs does a spider have?",
    "Write a JavaScript function that adds two numbers.", "What is the boiling point of water?",
    "Recommend a book for a long train journey.",
]


def teacher_forced_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``ids`` from one prefill (the offline API's prompt_logits)."""
    return llm.prompt_logits(ids)


def agreement(reference: LLM, candidate: LLM, num_tokens: int) -> dict[str, float]:
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=num_tokens)
    ref_outs = reference.chat(conversations, params)
    cand_outs = candidate.chat(conversations, params)
    matched = total = identical = 0
    worst = 0.0
    for ref, cand in zip(ref_outs, cand_outs):
        ids = ref.prompt_token_ids + ref.outputs[0].token_ids
        n_prompt = len(ref.prompt_token_ids)
        ref_logits = teacher_forced_logits(reference, ids)[n_prompt - 1 : -1]
        cand_logits = teacher_forced_logits(candidate, ids)[n_prompt - 1 : -1]
        matched += int((cand_logits.argmax(-1) == ref_logits.argmax(-1)).sum())
        total += len(ref_logits)
        worst = max(worst, float((cand_logits - ref_logits).abs().max()))
        identical += ref.outputs[0].token_ids == cand.outputs[0].token_ids
    return {"greedy_agreement": matched / total, "identical_answers": identical / len(QUESTIONS),
            "max_logit_diff": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--quantization", nargs="+", default=["int8", "int4"])
    parser.add_argument("--kv-cache", action="store_true", help="float16 against float32 KV cache instead")
    args = parser.parse_args()
    if args.kv_cache:
        # Against float32 weights and cache: the quantized weights' own noise (int8 activations round
        # differently after any change) is the scale a half cache's effect must be judged on.
        fp32 = LLM(args.model, quantization=None, kv_cache_memory_gib=0.25, kv_cache_dtype="float32")
        for quantization in args.quantization:
            q = None if quantization == "none" else quantization
            for kv in ("float32", "float16"):
                candidate = LLM(args.model, quantization=q, kv_cache_memory_gib=0.25, kv_cache_dtype=kv)
                r = agreement(fp32, candidate, args.tokens)
                print(f"weights {candidate.config.quantization or 'float32'}, {kv} KV cache vs float32 weights and "
                      f"cache on {len(QUESTIONS)} chat prompts x {args.tokens} tokens: greedy agreement "
                      f"{r['greedy_agreement']:.3f}, identical answers {r['identical_answers']:.2f}, "
                      f"max |logit diff| {r['max_logit_diff']:.2f}", flush=True)
                del candidate
        return
    fp32 = LLM(args.model, quantization=None, kv_cache_memory_gib=0.25)
    for quantization in args.quantization:
        candidate = LLM(args.model, quantization=quantization, kv_cache_memory_gib=0.25)
        r = agreement(fp32, candidate, args.tokens)
        print(f"{quantization} vs float32 on {len(QUESTIONS)} chat prompts x {args.tokens} tokens: greedy agreement "
              f"{r['greedy_agreement']:.3f}, identical answers {r['identical_answers']:.2f}, "
              f"max |logit diff| {r['max_logit_diff']:.2f}")
        del candidate


if __name__ == "__main__":
    main()
