"""What guided decoding costs on the CPU: per-token overhead at 1 and 16 concurrent requests, and
grammar compile time for a typical tool schema (chatapp/engine/guided.py, llguidance).

Overhead: the same batch decoded free and guided, the same number of tokens each (the guided
requests follow a JSON schema whose one string field cannot close within the budget, so both
run to max_tokens), alternated over several rounds; reported as the median time per decode step
guided over free. Goal: <= 1.10.

Compile: a fresh grammar (never cached) for a weather-tool argument schema turned into a matcher,
and its first token mask; the tokenizer's one-off conversion is reported apart.

    python benchmarks/guided_decoding.py [--model M] [--tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import chatapp  # noqa: E402,F401  first: it sets OpenMP's wait policy before torch loads
from chatapp.engine import LLM, SamplingParams  # noqa: E402
from chatapp.engine.guided import GrammarCompiler, GuidedDecoding  # noqa: E402

LONG_STRING = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 5000}},
    "required": ["story"],
}
TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include_hourly": {"type": "boolean"},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper, as JSON."}]


def seconds_per_step(llm: LLM, batch: int, tokens: int, guided: bool) -> float:
    spec = GuidedDecoding(json_schema=LONG_STRING) if guided else None
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, guided=spec)
    llm.chat([PROMPT] * batch, params)  # the prompt's blocks cached: both runs then decode only
    start = time.perf_counter()
    outs = llm.chat([PROMPT] * batch, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs), "both runs must decode the same tokens"
    return elapsed / tokens


def compile_times(llm: LLM, rounds: int) -> tuple[float, list[float], list[float]]:
    start = time.perf_counter()
    tokenizer_json = llm.tokenizer.hf.backend.to_str()
    compiler = GrammarCompiler(tokenizer_json, llm.core.model_config.vocab_size, llm.core.model_config.eos_token_ids)
    compiler.matcher(GuidedDecoding(regex="warm"))  # builds llguidance's tokenizer
    tokenizer_seconds = time.perf_counter() - start
    import llguidance.torch as llt

    compiles, first_masks = [], []
    for i in range(rounds):
        schema = {**TOOL_SCHEMA, "description": f"variant {i}"}  # a new grammar each round: no cache hit
        start = time.perf_counter()
        matcher = compiler.matcher(GuidedDecoding(json_schema=schema))
        compiles.append(time.perf_counter() - start)
        mask = llt.allocate_token_bitmask(1, llm.core.model_config.vocab_size)
        start = time.perf_counter()
        llt.fill_next_token_bitmask(matcher, mask, 0)
        first_masks.append(time.perf_counter() - start)
    return tokenizer_seconds, compiles, first_masks


def library_comparison(llm: LLM, rounds: int) -> None:
    """llguidance against xgrammar on the same tool schema and the same JSON answer, token by
    token: compile (a new grammar each round) and one mask per token. Runs when xgrammar is
    installed (it is not a dependency): pip install xgrammar."""
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar not installed: no library comparison (pip install xgrammar)")
        return
    import json

    import llguidance.torch as llt

    from chatapp.engine.tokenizer import load_hf_tokenizer

    vocab = llm.core.model_config.vocab_size
    answer = json.dumps({"location": "Paris, France", "unit": "celsius", "days": 3, "include_hourly": False})
    ids = llm.tokenizer.hf.encode(answer, add_special_tokens=False)

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(load_hf_tokenizer(llm.core.model.path), vocab_size=vocab)
    xgr_compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    xgr_setup = time.perf_counter() - start
    start = time.perf_counter()
    ll_compiler = GrammarCompiler(llm.tokenizer.hf.backend.to_str(), vocab, llm.core.model_config.eos_token_ids)
    ll_compiler.matcher(GuidedDecoding(regex="warm"))
    ll_setup = time.perf_counter() - start

    ll_compile, xgr_compile, ll_mask, xgr_mask = [], [], [], []
    for i in range(rounds):
        schema = {**TOOL_SCHEMA, "description": f"variant {i}"}
        start = time.perf_counter()
        ll = ll_compiler.matcher(GuidedDecoding(json_schema=schema))
        ll_compile.append(time.perf_counter() - start)
        start = time.perf_counter()
        xm = xgr.GrammarMatcher(xgr_compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
        xgr_compile.append(time.perf_counter() - start)
        ll_bits, xgr_bits = llt.allocate_token_bitmask(1, vocab), xgr.allocate_token_bitmask(1, vocab)
        for token in ids:
            start = time.perf_counter()
            llt.fill_next_token_bitmask(ll, ll_bits, 0)
            ll_mask.append(time.perf_counter() - start)
            start = time.perf_counter()
            xm.fill_next_token_bitmask(xgr_bits)
            xgr_mask.append(time.perf_counter() - start)
            ll.consume_token(token)
            xm.accept_token(token)
    print()
    print(f"| library | tokenizer set-up | tool schema compile (median) | mask per token (median, {len(ids)} tokens) |")
    print("| --- | --- | --- | --- |")
    for name, setup, comp, mask in (
        ("llguidance", ll_setup, ll_compile, ll_mask),
        ("xgrammar", xgr_setup, xgr_compile, xgr_mask),
    ):
        print(
            f"| {name} | {setup * 1e3:.0f} ms | {statistics.median(comp) * 1e3:.2f} ms | "
            f"{statistics.median(mask) * 1e6:.0f} us |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(args.model, kv_cache_memory_gib=0.5)
    print(f"model {llm.core.model.name}, {args.tokens} tokens per request, {args.rounds} rounds (alternated)")
    print("| concurrent | free ms/step | guided ms/step | guided / free | goal |")
    print("| --- | --- | --- | --- | --- |")
    for batch in (1, 16):
        free, guided = [], []
        for _ in range(args.rounds):
            free.append(seconds_per_step(llm, batch, args.tokens, guided=False))
            guided.append(seconds_per_step(llm, batch, args.tokens, guided=True))
        f, g = statistics.median(free), statistics.median(guided)
        print(f"| {batch} | {f * 1e3:.2f} | {g * 1e3:.2f} | {g / f:.3f} | <= 1.10 |")
    tokenizer_seconds, compiles, masks = compile_times(llm, args.rounds)
    print()
    print(f"llguidance tokenizer (once per model): {tokenizer_seconds * 1e3:.0f} ms")
    print(
        f"tool schema -> matcher: median {statistics.median(compiles) * 1e3:.2f} ms "
        f"(max {max(compiles) * 1e3:.2f}); first mask: median {statistics.median(masks) * 1e3:.2f} ms"
    )
    library_comparison(llm, args.rounds)


if __name__ == "__main__":
    main()
