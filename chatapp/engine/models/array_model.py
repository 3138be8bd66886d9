"""A GGUF model for the torch-free CPU engine: the C++ layer loop's weights as numpy arrays.

The same model as gguf_loader.load_gguf_native + cpu_forward.build_cpu_model (the torch path),
built without torch: every projection in the file's own blocks (repacked into our kernels' tiles),
types our kernels do not take de-quantised to float32, the token embeddings read from the file a
row at a time, and the RoPE tables from rope_arrays.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from chatapp.engine.huge_pages import WeightArena
from chatapp.engine.models.config import ModelConfig
from chatapp.engine.models.gguf_file import GGUFModelFile
from chatapp.engine.models.gguf_weights import EmbeddingTable, GGUFWeights, check_embedding, check_layer_count
from chatapp.engine.models.rope_arrays import rope_tables
from chatapp.engine.weight_packer import WeightPacker

Tables = tuple[np.ndarray, np.ndarray]


def rows_of(table: np.ndarray, index: np.ndarray) -> np.ndarray:
    """table[index] for a 1-D index; for one index in range, a view of its row. Why: a decode step's RoPE lookup
    takes one row of each table, and an index array cost ~13 us a lookup there (numpy's code cold after the
    weights have streamed through the caches: 40 -> 13 us a step for both tables), a slice next to nothing."""
    if len(index) == 1 and 0 <= (i := int(index[0])) < len(table):
        return table[i : i + 1]
    picked: np.ndarray = table[index]
    return picked


class ArrayModel:
    """Token ids and positions of a flattened batch in, final hidden states and logits out."""

    def __init__(
        self,
        mc: ModelConfig,
        cpu: Any,
        embedding: EmbeddingTable,
        tables: Tables,
        local: Tables,
        packer: WeightPacker | None = None,
    ) -> None:
        self.config = mc
        self.cpu = cpu  # the extension's CpuModel, its LM head set
        self.packer = packer  # filling the CpuModel's tiles after the engine is ready; None once they are full
        self._embedding = embedding
        self._tables, self._local_tables = tables, local
        # Gemma scales embeddings by sqrt(hidden), rounded to float32 first as Hugging Face does.
        self._embed_scale = np.float32(mc.hidden_size**0.5) if mc.is_gemma else None

    def wait_for_weights(self) -> None:
        """Return once every tile is packed (at once after the first call); raise PackingFailed where the
        packing failed, on every call: the model cannot compute."""
        if self.packer is None:
            return
        self.packer.wait()
        self.packer = None

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        """float32 [T, hidden]: each token's row, de-quantised exactly (a new array the loop may write)."""
        rows = self._embedding.rows(token_ids)
        if self._embed_scale is not None:
            rows *= self._embed_scale
        return np.ascontiguousarray(rows, dtype=np.float32)

    def rope(self, positions: np.ndarray) -> tuple[Tables, Tables]:
        """(global, local) layers' (cos, signed_sin) [T, 1, rotary_dim] for a step's positions."""

        def lookup(tables: Tables) -> Tables:
            return rows_of(tables[0], positions)[:, None, :], rows_of(tables[1], positions)[:, None, :]

        table = lookup(self._tables)
        return table, (table if self._local_tables is self._tables else lookup(self._local_tables))

    def forward(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        k_caches: list[np.ndarray],
        v_caches: list[np.ndarray],
        slots: np.ndarray,
        query_start: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
    ) -> np.ndarray:
        """Final-normed hidden states [T, hidden] (the keys and values go into the caches)."""
        self.wait_for_weights()
        (cos, sin), (local_cos, local_sin) = self.rope(positions)
        hidden: np.ndarray = self.cpu.forward_arrays(
            self.embed(token_ids),
            cos,
            sin,
            local_cos,
            local_sin,
            k_caches,
            v_caches,
            slots,
            query_start,
            seq_lens,
            block_tables,
        )
        return hidden

    def compute_logits(self, hidden: np.ndarray) -> np.ndarray:
        """float32 [rows, vocab]; Gemma 2's final soft-cap applied."""
        self.wait_for_weights()
        logits: np.ndarray = self.cpu.head_arrays(np.ascontiguousarray(hidden, dtype=np.float32))
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = np.tanh(logits / np.float32(cap)) * np.float32(cap)
        return logits


def load_array_model(
    gguf: GGUFModelFile,
    mc: ModelConfig,
    max_positions: int,
    ext: ModuleType,
    arena: WeightArena | None = None,
    defer_packing: bool = False,
) -> ArrayModel:
    """Read the file into the extension's CpuModel (weights shared with the arrays, not copied), the packed
    weights carved from ``arena`` where one is given. defer_packing: the tiles are filled on a background
    thread (weight_packer.py) that starts here; the model's first forward waits for it."""
    check_layer_count(gguf, mc)
    weights = GGUFWeights(gguf, mc, arena, defer_packing=defer_packing)
    cpu = ext.CpuModel(
        mc.num_heads,
        mc.num_kv_heads,
        mc.head_dim,
        mc.rms_norm_eps,
        weights.floats("output_norm.weight", (mc.hidden_size,)),
        mc.attention_scale,
        mc.sliding_window or 0,
        mc.attn_logit_softcapping or 0.0,
        mc.is_gemma,
    )
    for i in range(mc.num_layers):
        w = weights.layer(ext, i)
        cpu.add_layer(
            w.input_norm,
            w.mlp_in_norm,
            w.q_norm,
            w.k_norm,
            w.qkv.spec(),
            w.o.spec(),
            w.gate_up.spec(),
            w.down.spec(),
            w.attn_out_norm,
            w.mlp_out_norm,
            mc.layer_is_local(i),
            mc.layer_uses_rope(i),
        )
    cpu.set_head(weights.lm_head(ext).spec())
    tables = rope_tables(mc.head_dim, max_positions, mc.rope_theta, mc.rope_scaling, mc.rotary_dim, ext.cos_sin)
    local = tables
    if mc.is_gemma and mc.local_rope_theta is not None:  # Gemma 3: local layers take their own base, unscaled
        local = rope_tables(mc.head_dim, max_positions, mc.local_rope_theta, None, mc.rotary_dim, ext.cos_sin)
    embedding = EmbeddingTable(check_embedding(gguf, mc), ext)
    packer = None
    if weights.pack_jobs:
        packer = WeightPacker(weights.pack_jobs, gguf.path.name)
        packer.start()
    return ArrayModel(mc, cpu, embedding, tables, local, packer)
