"""Shared measures of how closely one engine follows another (the quantized ones against float32):
teacher-forced logits, greedy agreement over 24 chat prompts (benchmarks/quality.py reports it too)."""

from __future__ import annotations

import torch

from chatapp.engine import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "Give me three tips for better sleep.",
    "Explain photosynthesis to a child.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Write a SQL query that counts users by country.",
    "Why is the sky blue?",
    "Suggest a name for a bakery.",
    "What are prime numbers?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "How does a hash map work?",
    "Write a short poem about autumn leaves.",
    "What causes earthquakes?",
    "List four planets of the solar system.",
    "How do I make a cup of tea?",
    "What is the difference between a list and a tuple in Python?",
    "Give me a fun fact about octopuses.",
    "What is machine learning?",
    "How many legs does a spider have?",
    "Write a JavaScript function that adds two numbers.",
    "What is the boiling point of water?",
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
    return {
        "greedy_agreement": matched / total,
        "identical_answers": identical / len(QUESTIONS),
        "max_logit_diff": worst,
    }


def moon_landing_logits(reference: LLM, candidate: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    """Both engines' teacher-forced logits over a short user/assistant exchange."""
    prompt = reference.tokenizer.render_chat(
        [
            {"role": "user", "content": "Tell me about the moon landing."},
            {"role": "assistant", "content": "In 1969 Apollo 11 landed on the Moon."},
        ],
        add_generation_prompt=False,
    )
    return teacher_forced_logits(reference, prompt), teacher_forced_logits(candidate, prompt)
