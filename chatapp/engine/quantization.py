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

import torch
from torch import nn

from chatapp.engine.models.llama import LlamaForCausalLM

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


def _input_buffer(in_features: int, rows: int) -> torch.Tensor:
    """A shared [1 + rows, in_features] buffer whose row 0 is the anchor [1, -1, 0, ...]."""
    buf = _INPUT_BUFFERS.get(in_features)
    if buf is None or buf.shape[0] < rows + 1:
        with torch.inference_mode(False):  # a normal tensor: usable in and out of inference mode
            buf = torch.zeros(max(rows + 1, 2 * (buf.shape[0] if buf is not None else 64)), in_features)
        buf[0, 0], buf[0, 1] = 1.0, -1.0
        _INPUT_BUFFERS[in_features] = buf
    return buf


class Int8Linear(nn.Module):
    """y = x @ W^T (+ b) with W prepacked as int8 (fbgemm) and x quantized per token on the fly.

    Input channels listed in ``outliers`` bypass quantization: they are
    multiplied in float32 and added to the int8 result.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, outliers: torch.Tensor | None = None) -> None:
        super().__init__()
        weight = weight.detach().float()
        self.outliers = outliers if outliers is not None and outliers.numel() else None
        if self.outliers is not None:
            self.outlier_rows = [weight[:, int(c)].clone() for c in self.outliers]  # one [N] row per channel
            weight = weight.index_fill(1, self.outliers, 0.0)
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch's quantized tensors warn about their own deprecation
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = None if bias is None else bias.detach().float()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.outliers is not None:
            kept = x.index_select(1, self.outliers)
            x = x.index_fill(1, self.outliers, 0.0)
        row_max = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-6)
        buf = _input_buffer(self.in_features, rows)
        torch.div(x, row_max, out=buf[1 : rows + 1])
        # reduce_range=False: with VNNI the u8 x s8 products accumulate in int32 without saturating.
        y = torch.ops.quantized.linear_dynamic(buf[: rows + 1], self._packed, False)[1:].mul_(row_max)
        if self.outliers is not None:
            for i, row in enumerate(self.outlier_rows):
                y.addcmul_(kept[:, i : i + 1], row)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int8(model: LlamaForCausalLM, calibrate: Callable[[], None] | None) -> None:
    """Smooth (if a calibration pass is given), then swap projections and the LM head for Int8Linear."""
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        torch.backends.quantized.engine = "x86"
    head_weight = (model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).detach().clone()
    outliers: dict[str, torch.Tensor] = {}
    if calibrate is not None:
        maxima = _input_maxima(model, calibrate)
        outliers = {name: _outlier_channels(m) for name, m in maxima.items()}
        for name, channels in outliers.items():  # the float path handles them: do not smooth for them
            maxima[name] = maxima[name].index_fill(0, channels, float(maxima[name].median()))
        head_weight = _smooth(model, maxima, head_weight)
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        prefix = f"layers.{i}"
        attn.qkv_proj = _int8(attn.qkv_proj, outliers.get(f"{prefix}.self_attn.qkv_proj"))
        attn.o_proj = _int8(attn.o_proj, outliers.get(f"{prefix}.self_attn.o_proj"))
        mlp.gate_up_proj = _int8(mlp.gate_up_proj, outliers.get(f"{prefix}.mlp.gate_up_proj"))
        mlp.down_proj = _int8(mlp.down_proj, outliers.get(f"{prefix}.mlp.down_proj"))
    model.quantized_lm_head = Int8Linear(head_weight, None, outliers.get("head"))


def _int8(linear: nn.Linear, outliers: torch.Tensor | None) -> Int8Linear:
    return Int8Linear(linear.weight, linear.bias, outliers)


def _outlier_channels(maxima: torch.Tensor) -> torch.Tensor:
    """Input channels with massive activations, at most MAX_OUTLIERS of the largest."""
    threshold = max(OUTLIER_MIN, OUTLIER_RATIO * float(maxima.median()))
    candidates = torch.nonzero(maxima > threshold).flatten()
    if candidates.numel() > MAX_OUTLIERS:
        candidates = candidates[maxima[candidates].topk(MAX_OUTLIERS).indices]
    return candidates.sort().values


def _input_maxima(model: LlamaForCausalLM, calibrate: Callable[[], None]) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| of every projection (and the head) over a calibration pass."""
    maxima: dict[str, torch.Tensor] = {}
    hooks = []

    def record(name: str):
        def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            m = inputs[0].detach().abs().amax(dim=0).float()
            maxima[name] = torch.maximum(maxima[name], m) if name in maxima else m

        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.split(".")[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            hooks.append(module.register_forward_pre_hook(record(name)))
    hooks.append(
        model.norm.register_forward_hook(
            lambda _m, _i, out: maxima.__setitem__(
                "head",
                torch.maximum(maxima.get("head", torch.zeros(out.shape[-1])), out.detach().abs().amax(0).float()),
            )
        )
    )
    try:
        calibrate()
    finally:
        for hook in hooks:
            hook.remove()
    return maxima


def _factor(x_max: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SmoothQuant's s_j = max|X_j|^a / max|W_j|^(1-a) per input channel j."""
    w_max = weight.abs().amax(dim=0).float()
    return (x_max.clamp(min=1e-5).pow(SMOOTH_ALPHA) / w_max.clamp(min=1e-5).pow(1 - SMOOTH_ALPHA)).clamp(min=1e-5)


@torch.no_grad()
def _smooth(model: LlamaForCausalLM, maxima: dict[str, torch.Tensor], head_weight: torch.Tensor) -> torch.Tensor:
    """Divide activations by s and multiply weights by s where a preceding op can absorb the division."""
    mc = model.config
    group, d = mc.num_heads // mc.num_kv_heads, mc.head_dim
    v_start = (mc.num_heads + mc.num_kv_heads) * d
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        prefix = f"layers.{i}"
        s = _factor(maxima[f"{prefix}.self_attn.qkv_proj"], attn.qkv_proj.weight)
        layer.input_layernorm.weight.div_(s)
        attn.qkv_proj.weight.mul_(s)
        s = _factor(maxima[f"{prefix}.mlp.gate_up_proj"], mlp.gate_up_proj.weight)
        layer.mlp_input_norm.weight.div_(s)
        mlp.gate_up_proj.weight.mul_(s)
        s = _factor(maxima[f"{prefix}.mlp.down_proj"], mlp.down_proj.weight)  # absorbed by the up projection
        mlp.gate_up_proj.weight[mc.intermediate_size :].div_(s[:, None])
        if mlp.gate_up_proj.bias is not None:
            mlp.gate_up_proj.bias[mc.intermediate_size :].div_(s)
        mlp.down_proj.weight.mul_(s)
        # o_proj's input channel (head h, dim j) is a mix of value channel (h // group, j): heads of
        # one group share a factor, absorbed by the value projection.
        x_max = maxima[f"{prefix}.self_attn.o_proj"].view(mc.num_kv_heads, group, d).amax(dim=1)
        w_max = attn.o_proj.weight.abs().amax(dim=0).float().view(mc.num_kv_heads, group, d).amax(dim=1)
        s = (x_max.clamp(min=1e-5).pow(SMOOTH_ALPHA) / w_max.clamp(min=1e-5).pow(1 - SMOOTH_ALPHA)).clamp(min=1e-5)
        attn.qkv_proj.weight[v_start:].div_(s.reshape(-1, 1))
        if attn.qkv_proj.bias is not None:
            attn.qkv_proj.bias[v_start:].div_(s.reshape(-1))
        attn.o_proj.weight.mul_(s[:, None, :].expand(mc.num_kv_heads, group, d).reshape(1, -1))
    # The head reads the final norm's output; embeddings keep the unsmoothed (tied) weights.
    s = _factor(maxima["head"], head_weight)
    model.norm.weight.div_(s)
    return head_weight * s
