"""Dynamic int8 linear layers for the CPU: int8 weights per output channel, int8 activations per token.

Why int8: at batch 1 a decode step streams every weight from memory, and int8
weights are a quarter of float32. With fbgemm's VNNI kernels the int8 GEMMs are
also several times faster at larger batches. Measured on this 2-core machine
(torch 2.13), `quantized::linear_dynamic` beat float32 about 2x at batch 1,
4-9x at batch 16, and ran the 49152-row LM head 12x faster, whereas
`aten._weight_int8pack_mm` was 10-800x slower than float32; torch.compile
graph-breaks on the quantized op and came out slower than eager.

Why per token: fbgemm quantizes activations per *tensor*, so in a prefill one
token with a massive activation ruined every other token's precision (top-1
agreement with float32 fell to 0.60 on SmolLM2). Dividing each row by its own
absmax first makes the per-tensor quantizer act per token (0.87).

Why float outlier channels: the first token (the attention sink) carries
"massive activations", single channels thousands of times larger than the
rest (3,065 against ~2 in SmolLM2's layer-11 down projection). Quantized per
token, the rest of that row rounds to zero, the sink's keys and values go
wrong and every later token with them. Those few channels, found by the
calibration pass, are multiplied in float32 (LLM.int8()'s decomposition).

Why batch-invariant: a greedy answer should not change with whatever else the
engine is running (a chat user regenerating with temperature 0 would notice).
fbgemm picks the activation scale from the whole tensor's min and max, so after
normalising each row to absmax 1 we prepend one constant anchor row [1, -1,
0, ...]: the range is then always exactly [-1, 1], every row is quantized the
same way whatever shares the batch, and the integer GEMM is exact. The float
outlier channels are accumulated one by one (addcmul), whose per-element order
does not depend on the batch either (a float matmul's does).

Why SmoothQuant: other input channels carry milder outliers in every token.
Moving part of their scale into the weights (folded into the preceding
RMSNorm, the up projection and the value projection, so it costs nothing at
run time) gains a few more points of agreement. The scales come from the
same calibration pass at load time.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from chatapp.engine.attention import AttentionBackend
from chatapp.engine.models.config import ModelConfig
from chatapp.engine.models.llama import LlamaForCausalLM, RMSNorm, Tables, projections

SMOOTH_ALPHA = 0.5
OUTLIER_RATIO = 20.0  # a channel whose max is this many times the median channel's is kept in float
OUTLIER_MIN = 6.0  # ... and at least this large in absolute terms (LLM.int8()'s threshold)
MAX_OUTLIERS = 8

CALIBRATION_TEXT = (
    "User: Can you explain how a hash map works, and when I should use one?\n"
    "Assistant: A hash map stores key-value pairs. It computes a hash of each key to pick a bucket, "
    "so lookups, inserts and deletes take constant time on average. Use one when you need fast "
    "access by key and do not care about order.\n\n"
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    "    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n"
    "            out.append(a[i]); i += 1\n"
    "        else:\n"
    "            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n\n"
    "The river wound through the valley, past fields of wheat and old stone farmhouses. In 1887 "
    "the town built its first bridge; today 12,400 people live there. Quelle heure est-il ? "
    "Es ist halb acht. 東京は日本の首都です。 Numbers: 3.14159, 2.71828, 42, -7, 1e-5.\n"
)


_INPUT_BUFFERS: dict[int, torch.Tensor] = {}
_QUANTIZE_CHUNK = 1 << 20  # weights quantized per chunk: a 4 MB float32 slice at a time


def _input_buffer(in_features: int, rows: int) -> torch.Tensor:
    """A shared [1 + rows, in_features] buffer whose row 0 is the anchor [1, -1, 0, ...]."""
    buf = _INPUT_BUFFERS.get(in_features)
    if buf is None or buf.shape[0] < rows + 1:
        with torch.inference_mode(False):  # a normal tensor: usable in and out of inference mode
            buf = torch.zeros(max(rows + 1, 2 * (buf.shape[0] if buf is not None else 64)), in_features)
        buf[0, 0], buf[0, 1] = 1.0, -1.0
        _INPUT_BUFFERS[in_features] = buf
    return buf


@dataclass
class Int8Codes:
    """A weight quantized per output channel: codes * scales[:, None], plus the outlier input
    channels (zeroed in the codes) as float rows."""

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] float32
    outliers: torch.Tensor | None
    outlier_rows: list[torch.Tensor]  # one [N] float row per outlier channel


def quantize_rows(
    weight: torch.Tensor, outliers: torch.Tensor | None = None, smooth: torch.Tensor | None = None
) -> Int8Codes:
    """weight [N, K] (any float dtype, left untouched) times the per-input-channel factors ``smooth``,
    with the ``outliers`` input channels set apart, quantized in row chunks: a 16-bit LM head of a
    128k vocabulary never exists whole in float32."""
    n, k = weight.shape
    weight = weight.detach()
    outliers = outliers if outliers is not None and outliers.numel() else None
    rows_of = [] if outliers is None else outliers.tolist()
    outlier_rows = [weight[:, c].float() * (1.0 if smooth is None else smooth[c]) for c in rows_of]
    scales = torch.empty(n)
    codes = torch.empty(n, k, dtype=torch.int8)
    zero_points = torch.zeros(n, dtype=torch.long)
    step = max(1, _QUANTIZE_CHUNK // k)
    with warnings.catch_warnings():  # torch's quantized tensors warn about their own deprecation
        warnings.simplefilter("ignore")
        for start in range(0, n, step):
            rows = slice(start, min(n, start + step))
            w = weight[rows].float()
            if smooth is not None:
                w = w * smooth
            if outliers is not None:
                w = w.index_fill(1, outliers, 0.0)
            chunk_scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
            q = torch.quantize_per_channel(w, chunk_scales.double(), zero_points[rows], 0, torch.qint8)
            codes[rows] = q.int_repr()
            scales[rows] = chunk_scales
    return Int8Codes(codes, scales, outliers, outlier_rows)


class Int8Linear(nn.Module):
    """y = x @ W^T (+ b) with W prepacked as int8 (fbgemm) and x quantized per token on the fly.

    Input channels listed in ``outliers`` bypass quantization: they are
    multiplied in float32 and added to the int8 result.
    """

    def __init__(
        self,
        weight: torch.Tensor | Int8Codes,
        bias: torch.Tensor | None,
        outliers: torch.Tensor | None = None,
        smooth: torch.Tensor | None = None,
    ) -> None:
        """weight: float [N, K] (see quantize_rows for outliers and smooth), or its Int8Codes already made."""
        super().__init__()
        q = weight if isinstance(weight, Int8Codes) else quantize_rows(weight, outliers, smooth)
        self.outliers, self.outlier_rows = q.outliers, q.outlier_rows
        zero_points = torch.zeros(q.codes.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch's quantized tensors warn about their own deprecation
            warnings.simplefilter("ignore")
            qweight = torch._make_per_channel_quantized_tensor(q.codes, q.scales.double(), zero_points, 0)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = None if bias is None else bias.detach().float()
        self.out_features, self.in_features = q.codes.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.outliers is not None:
            kept = x.index_select(1, self.outliers)
            x = x.index_fill(1, self.outliers, 0.0)
        row_max = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-6)
        buf = _input_buffer(self.in_features, rows)
        torch.div(x, row_max, out=buf[1 : rows + 1])
        # reduce_range=False: with VNNI the u8 x s8 products accumulate in int32 without saturating.
        y: torch.Tensor = torch.ops.quantized.linear_dynamic(buf[: rows + 1], self._packed, False)[1:].mul_(row_max)
        if self.outliers is not None:
            for i, row in enumerate(self.outlier_rows):
                y.addcmul_(kept[:, i : i + 1], row)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


@dataclass
class Calibration:
    """CALIBRATION_TEXT's tokens, their positions and an attention backend on a scratch cache: a float
    prefill that the int8 quantizer runs one decoder layer at a time."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionBackend


class Int8Quantizer:
    """Calibrates and swaps projections for Int8Linear one decoder layer at a time.

    A layer is calibrated by running it in float on the calibration stream (the float output
    of the layer before), then smoothed and quantized; so a loader can hand over each layer as
    soon as its weights are in and no float model is ever whole. Without a calibration there is
    no smoothing and no outlier channel.
    """

    def __init__(self, model: LlamaForCausalLM, calibration: Calibration | None) -> None:
        if torch.backends.quantized.engine not in ("x86", "fbgemm"):
            torch.backends.quantized.engine = "x86"
        self.mc = model.config
        self.calibration = calibration
        self.hidden: torch.Tensor | None = None
        self.tables: tuple[Tables, Tables] | None = None
        if calibration is not None:
            with torch.inference_mode():
                self.hidden = model.embed(calibration.token_ids)
                self.tables = model.rope_tables(calibration.positions)

    def layer(self, model: LlamaForCausalLM, layer: nn.Module) -> None:
        """Calibrate (advancing the stream), smooth and quantize one decoder layer, in place."""
        outliers: dict[str, torch.Tensor] = {}
        if self.calibration is not None:
            maxima = self._run_and_measure(model, layer)
            outliers = {name: _outlier_channels(m) for name, m in maxima.items()}
            for name, channels in outliers.items():  # the float path handles them: do not smooth for them
                maxima[name] = maxima[name].index_fill(0, channels, float(maxima[name].median()))
            _smooth_layer(layer, maxima, self.mc)
        # Owners typed as plain modules: their nn.Linear attributes are replaced by Int8Linear.
        attn, mlp = cast(nn.Module, layer.self_attn), cast(nn.Module, layer.mlp)
        attn.qkv_proj = _int8(cast(nn.Linear, attn.qkv_proj), outliers.get("qkv_proj"))
        attn.o_proj = _int8(cast(nn.Linear, attn.o_proj), outliers.get("o_proj"))
        mlp.gate_up_proj = _int8(cast(nn.Linear, mlp.gate_up_proj), outliers.get("gate_up_proj"))
        mlp.down_proj = _int8(cast(nn.Linear, mlp.down_proj), outliers.get("down_proj"))

    def advance(self, model: LlamaForCausalLM, layer: nn.Module) -> None:
        """Run a layer that stays as it is over the calibration stream, for the layers after it."""
        if self.calibration is not None:
            assert self.hidden is not None and self.tables is not None  # set with the calibration, until finish
            with torch.inference_mode():
                self.hidden = model.run_layer(layer, self.hidden, self.tables, self.calibration.attn)

    @torch.no_grad()
    def finish(self, model: LlamaForCausalLM) -> None:
        """The LM head in int8, smoothed into the final norm; an untied head's float weight is dropped."""
        head_weight = (model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).detach()
        outliers = s = None
        if self.calibration is not None:
            with torch.inference_mode():
                x_max = model.norm(self.hidden).abs().amax(dim=0).float()
            outliers = _outlier_channels(x_max)
            x_max = x_max.index_fill(0, outliers, float(x_max.median()))
            # The head reads the final norm's output; the factors go into the int8 head only, so
            # (tied) embeddings keep the unsmoothed weights.
            s = _factor(x_max, head_weight)
            model.norm.weight.div_(s)
        codes = quantize_rows(head_weight, outliers, smooth=s)
        del head_weight
        model.lm_head = None  # an untied head's 16-bit weight goes before the int8 one is packed
        model.quantized_lm_head = Int8Linear(codes, None)
        self.hidden = None

    def _run_and_measure(self, model: LlamaForCausalLM, layer: nn.Module) -> dict[str, torch.Tensor]:
        """Per-input-channel max |x| of the layer's projections, as the layer runs in float."""
        maxima: dict[str, torch.Tensor] = {}

        def record(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
            def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
                maxima[name] = inputs[0].detach().abs().amax(dim=0).float()

            return hook

        # layer() measures only with a calibration, whose stream __init__ started
        assert self.calibration is not None and self.hidden is not None and self.tables is not None
        hooks = [getattr(owner, attr).register_forward_pre_hook(record(attr)) for owner, attr in projections(layer)]
        try:
            with torch.inference_mode():
                self.hidden = model.run_layer(layer, self.hidden, self.tables, self.calibration.attn)
        finally:
            for hook in hooks:
                hook.remove()
        return maxima


def quantize_int8(model: LlamaForCausalLM, calibration: Calibration | None) -> None:
    """A whole loaded float model to int8 (Int8Quantizer over every layer, then the head)."""
    quantizer = Int8Quantizer(model, calibration)
    for layer in model.layers:
        quantizer.layer(model, layer)
    quantizer.finish(model)


def _int8(linear: nn.Linear, outliers: torch.Tensor | None) -> Int8Linear:
    return Int8Linear(linear.weight, linear.bias, outliers)


def _outlier_channels(maxima: torch.Tensor) -> torch.Tensor:
    """Input channels with massive activations, at most MAX_OUTLIERS of the largest."""
    threshold = max(OUTLIER_MIN, OUTLIER_RATIO * float(maxima.median()))
    candidates = torch.nonzero(maxima > threshold).flatten()
    if candidates.numel() > MAX_OUTLIERS:
        candidates = candidates[maxima[candidates].topk(MAX_OUTLIERS).indices]
    return candidates.sort().values


def _factor(x_max: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SmoothQuant's s_j = max|X_j|^a / max|W_j|^(1-a) per input channel j."""
    low, high = weight.aminmax(dim=0)  # no |W| copy of a whole (LM head) weight
    w_max = torch.maximum(low.abs(), high.abs()).float()
    return (x_max.clamp(min=1e-5).pow(SMOOTH_ALPHA) / w_max.clamp(min=1e-5).pow(1 - SMOOTH_ALPHA)).clamp(min=1e-5)


@torch.no_grad()
def _smooth_layer(layer: nn.Module, maxima: dict[str, torch.Tensor], mc: ModelConfig) -> None:
    """Divide activations by s and multiply weights by s where a preceding op can absorb the division."""
    group, d = mc.num_heads // mc.num_kv_heads, mc.head_dim
    v_start = (mc.num_heads + mc.num_kv_heads) * d
    attn, mlp = cast(nn.Module, layer.self_attn), cast(nn.Module, layer.mlp)
    qkv, o = cast(nn.Linear, attn.qkv_proj), cast(nn.Linear, attn.o_proj)  # float projections, not yet swapped
    gate_up, down = cast(nn.Linear, mlp.gate_up_proj), cast(nn.Linear, mlp.down_proj)
    s = _factor(maxima["qkv_proj"], qkv.weight)
    cast(RMSNorm, layer.input_layernorm).weight.div_(s)
    qkv.weight.mul_(s)
    s = _factor(maxima["gate_up_proj"], gate_up.weight)
    cast(RMSNorm, layer.mlp_input_norm).weight.div_(s)
    gate_up.weight.mul_(s)
    s = _factor(maxima["down_proj"], down.weight)  # absorbed by the up projection
    gate_up.weight[mc.intermediate_size :].div_(s[:, None])
    if gate_up.bias is not None:
        gate_up.bias[mc.intermediate_size :].div_(s)
    down.weight.mul_(s)
    # o_proj's input channel (head h, dim j) is a mix of value channel (h // group, j): heads of
    # one group share a factor, absorbed by the value projection.
    x_max = maxima["o_proj"].view(mc.num_kv_heads, group, d).amax(dim=1)
    w_max = o.weight.abs().amax(dim=0).float().view(mc.num_kv_heads, group, d).amax(dim=1)
    s = (x_max.clamp(min=1e-5).pow(SMOOTH_ALPHA) / w_max.clamp(min=1e-5).pow(1 - SMOOTH_ALPHA)).clamp(min=1e-5)
    qkv.weight[v_start:].div_(s.reshape(-1, 1))
    if qkv.bias is not None:
        qkv.bias[v_start:].div_(s.reshape(-1))
    o.weight.mul_(s[:, None, :].expand(mc.num_kv_heads, group, d).reshape(1, -1))
