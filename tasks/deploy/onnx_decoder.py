"""The LLaMA decoder as an ONNX graph with a KV cache and dynamic shapes, written from the weights.

numpy + onnx only (no MindSpore): the graph is built node by node with `onnx.helper` from the
model artifact's weights, in the layout the ONNX Runtime ecosystem uses for decoders, so
onnxruntime, onnxruntime-genai (`genai_config`) and Hugging Face-style KV-cache loops all run it.

    model = build_decoder(config, weights)            # config: ModelConfig fields; weights: name -> [out, in] array
    save_model(model, "model.onnx") cfg = genai_config(config, eos_id=2, bos_id=1, pad_id=3) # genai_config.json
    tok_json, tok_cfg = hf_tokenizer_files(open("tokenizer.model", "rb").read())

Inputs and outputs (L = num_layers, nkv = num_kv_heads, hd = head_dim; every axis named here
is dynamic, the rest are the model's constants):

    input_ids                  int64   [batch_size, sequence_length]
    attention_mask             int64   [batch_size, total_sequence_length]   1 = real token, 0 = padding
    position_ids               int64   [batch_size, sequence_length]         RoPE positions (< max_seq_length)
    past_key_values.{i}.key    float32 [batch_size, nkv, past_sequence_length, hd]    i = 0..L-1
    past_key_values.{i}.value  float32 [batch_size, nkv, past_sequence_length, hd]
    ->
    logits                     float32 [batch_size, sequence_length, vocab]
    present.{i}.key            float32 [batch_size, nkv, total_sequence_length, hd]
    present.{i}.value          float32 [batch_size, nkv, total_sequence_length, hd]

total_sequence_length = past_sequence_length + sequence_length. `present` is `past` with the
new tokens' keys (after RoPE) and values appended along axis 2: feed it back as the next
call's `past` (a first call takes past axes of length 0). Query t may attend to cache slot j
when j <= past_sequence_length + t (causal in slot order) and attention_mask[b, j] == 1, so
a batch is left-padded (as onnxruntime-genai does) or right-padded, with position_ids
counting real tokens only. Every shape comes from Shape/Range and Reshape with 0/-1, so
nothing traced is baked in.

The math is model/llama.py's, op for op: RMSNorm x / sqrt(mean(x²) + eps) * w (written as
Pow → ReduceMean → Add → Sqrt → Div → Mul, the pattern onnxruntime fuses into one kernel),
rotate-half RoPE from the same cos/sin tables (model/rope.py rope_tables, numpy only), q scaled by
head_dim^-0.5 after RoPE, grouped-query attention by folding a KV head's query heads into the
query axis (no K/V copies), an additive -1e9 mask, SwiGLU, an untied or tied LM head. Plain
opset-18 ops only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from sentencepiece import sentencepiece_model_pb2 as pb

from model.rope import rope_tables

OPSET = 18
MASKED = -1e9  # as model/llama.py: exp() of it underflows to exactly 0
INPUT_IDS, ATTENTION_MASK, POSITION_IDS, LOGITS = "input_ids", "attention_mask", "position_ids", "logits"
PAST_KEY, PAST_VALUE = "past_key_values.{}.key", "past_key_values.{}.value"
PRESENT_KEY, PRESENT_VALUE = "present.{}.key", "present.{}.value"
_B, _T, _P, _S = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
_EXTERNAL_ABOVE = 1_800_000_000  # bytes of weights: above this, save_model writes them next to the graph


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """(input names, output names) in graph order: past/present interleaved key, value per layer."""
    past = [n.format(i) for i in range(num_layers) for n in (PAST_KEY, PAST_VALUE)]
    present = [n.format(i) for i in range(num_layers) for n in (PRESENT_KEY, PRESENT_VALUE)]
    return [INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *past], [LOGITS, *present]


class _Graph:
    """Nodes and initializers under construction, with unique names."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def op(self, op_type: str, inputs: list[str], name: str | None = None, n_out: int = 1, **attrs) -> Any:
        self._n += 1
        base = name or f"{op_type.lower()}_{self._n}"
        outs = [base] if n_out == 1 else [f"{base}_{k}" for k in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=f"{op_type}_{self._n}", **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def i64(self, name: str, values: list[int]) -> str:
        return self.const(name, np.asarray(values, np.int64))


def _cfg(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    c = dict(config) if isinstance(config, Mapping) else dict(config.to_dict())
    need = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "max_seq_length",
    )
    missing = [k for k in need if k not in c]
    if missing:
        raise ValueError(f'model config lacks {missing}; pass ModelConfig.to_dict() (model.json\'s "model")')
    c.setdefault("rope_theta", 10000.0)
    c.setdefault("norm_eps", 1e-5)
    c.setdefault("tie_embeddings", False)
    if c["hidden_size"] % c["num_heads"] or c["num_heads"] % c["num_kv_heads"]:
        raise ValueError(
            f"hidden_size {c['hidden_size']}, num_heads {c['num_heads']}, num_kv_heads "
            f"{c['num_kv_heads']}: heads must divide hidden_size and kv heads must divide heads"
        )
    return c


def _weight(weights: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in weights:
        raise ValueError(f"weights lack {name!r} (expected LlamaForCausalLM parameter names)")
    w = np.asarray(weights[name], dtype=np.float32)
    if w.shape != shape:
        raise ValueError(f"weight {name!r} has shape {list(w.shape)}, expected {list(shape)}")
    return w


def build_decoder(
    config: Mapping[str, Any] | Any, weights: Mapping[str, np.ndarray], *, metadata: Mapping[str, str] | None = None
) -> onnx.ModelProto:
    """The decoder with a KV cache (see the module docstring) from LlamaForCausalLM weights ([out, in] each).

    `config` is a ModelConfig or its dict; `metadata` goes into the model's metadata_props
    (with the architecture as JSON under "model_config").
    """
    c = _cfg(config)
    g = _Graph()
    embed = _shared_constants(g, c, weights)
    d = _Decoder(g, c, weights)
    x = g.op("Gather", ["embed_tokens.weight", INPUT_IDS], "embeddings", axis=0)  # [B, T, H]
    for i in range(c["num_layers"]):
        x = d.layer(i, x)
    h = d.rms_norm(x, "norm.weight", "final_norm")
    head = "embed_tokens.weight" if c["tie_embeddings"] else "lm_head.weight"
    if c["tie_embeddings"]:
        g.const("lm_head.weight.T", embed.T)  # its own [H, V] copy: a plain MatMul that int8 can quantize
        g.op("MatMul", [h, "lm_head.weight.T"], LOGITS)
    else:
        d.linear(h, head, (c["vocab_size"], c["hidden_size"]), LOGITS)
    return _model(g, c, metadata)


def _shared_constants(g: _Graph, c: dict[str, Any], weights: Mapping[str, np.ndarray]) -> np.ndarray:
    """The constants and shapes every layer shares (the embedding among them, returned for a tied head)."""
    V, H = c["vocab_size"], c["hidden_size"]
    nh, nkv = c["num_heads"], c["num_kv_heads"]
    hd = H // nh
    embed = _weight(weights, "embed_tokens.weight", (V, H))
    g.const("embed_tokens.weight", embed)
    cos, sin = rope_tables(hd, c["max_seq_length"], float(c["rope_theta"]))
    g.const("rope.cos", cos)
    g.const("rope.sin", sin)
    g.const("eps", np.asarray(c["norm_eps"], np.float32))
    g.const("two", np.asarray(2.0, np.float32))
    g.const("scale", np.asarray(hd**-0.5, np.float32))
    g.const("zero_f", np.asarray(0.0, np.float32))
    g.const("masked_f", np.asarray(MASKED, np.float32))
    g.i64("axes_last", [-1])
    g.i64("axes_0", [0])
    g.i64("axes_1", [1])
    g.i64("axes_12", [1, 2])
    g.i64("half_split", [hd // 2, hd // 2])
    g.i64("zero_i", [0])
    g.const("zero_s", np.asarray(0, np.int64))
    g.const("one_s", np.asarray(1, np.int64))
    g.i64("shape_q", [0, 0, nh, hd])
    g.i64("shape_kv", [0, 0, nkv, hd])
    g.i64("shape_fold", [0, nkv, -1, 0])  # [B, nh, T, X] -> [B, nkv, rep*T, X]: a KV head's query heads
    g.i64("shape_unfold", [0, nh, -1, 0])  # [B, nkv, rep*T, X] -> [B, nh, T, X]
    g.i64("shape_merge", [0, 0, nh * hd])
    return embed


class _Decoder:
    """The per-layer pieces of the graph (RMSNorm, a linear layer, RoPE, one decoder layer) over the shared
    attention mask and RoPE angles, which the constructor adds to the graph."""

    def __init__(self, g: _Graph, c: dict[str, Any], weights: Mapping[str, np.ndarray]):
        self.g, self.c, self.weights = g, c, weights
        # additive mask [B, 1, T, S], shared by every layer: causal in cache-slot order, padding from attention_mask
        t_len = g.op("Squeeze", [g.op("Shape", [INPUT_IDS], start=1, end=2), "zero_i"], "seq_len")
        s_len = g.op("Squeeze", [g.op("Shape", [ATTENTION_MASK], start=1, end=2), "zero_i"], "total_len")
        p_len = g.op("Sub", [s_len, t_len], "past_len")
        q_slots = g.op("Range", [p_len, s_len, "one_s"], "query_slots")  # [T]
        k_slots = g.op("Range", ["zero_s", s_len, "one_s"], "key_slots")  # [S]
        causal = g.op(
            "LessOrEqual", [g.op("Unsqueeze", [k_slots, "axes_0"]), g.op("Unsqueeze", [q_slots, "axes_last"])], "causal"
        )  # [T, S]
        real = g.op(
            "Unsqueeze", [g.op("Cast", [ATTENTION_MASK], to=TensorProto.BOOL), "axes_12"], "real_keys"
        )  # [B, 1, 1, S]
        self.mask = g.op("Where", [g.op("And", [causal, real]), "zero_f", "masked_f"], "attn_mask")  # [B, 1, T, S]
        # RoPE angles of each token [B, 1, T, hd]
        self.cos_t = g.op("Unsqueeze", [g.op("Gather", ["rope.cos", POSITION_IDS], axis=0), "axes_1"], "cos")
        self.sin_t = g.op("Unsqueeze", [g.op("Gather", ["rope.sin", POSITION_IDS], axis=0), "axes_1"], "sin")

    def rms_norm(self, x: str, w_name: str, out: str) -> str:
        """x / sqrt(mean(x²) + eps) * w, as the pattern onnxruntime fuses."""
        g = self.g
        g.const(w_name, _weight(self.weights, w_name, (self.c["hidden_size"],)))
        ms = g.op("ReduceMean", [g.op("Pow", [x, "two"]), "axes_last"], keepdims=1)
        return g.op("Mul", [g.op("Div", [x, g.op("Sqrt", [g.op("Add", [ms, "eps"])])]), w_name], out)

    def linear(self, x: str, w_name: str, shape: tuple[int, int], out: str | None = None) -> str:
        """x @ W.T of a [out, in] weight."""
        t_name = w_name + ".T"  # stored [in, out]: one MatMul (and dynamic int8 quantizes it to MatMulInteger)
        self.g.const(t_name, _weight(self.weights, w_name, shape).T)
        return self.g.op("MatMul", [x, t_name], out)

    def rope(self, x: str) -> str:
        """Rotate-half RoPE of [B, heads, T, hd] by each token's angles."""
        g = self.g
        x1, x2 = g.op("Split", [x, "half_split"], n_out=2, axis=-1)
        rotated = g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)
        return g.op("Add", [g.op("Mul", [x, self.cos_t]), g.op("Mul", [rotated, self.sin_t])])

    def layer(self, i: int, x: str) -> str:
        """Decoder layer `i` on the residual stream `x` [B, T, H]: attention with the KV cache, then SwiGLU."""
        g, linear, c = self.g, self.linear, self.c
        H, F = c["hidden_size"], c["intermediate_size"]
        nh, nkv = c["num_heads"], c["num_kv_heads"]
        hd = H // nh
        p = f"layers.{i}."
        h = self.rms_norm(x, p + "input_layernorm.weight", f"l{i}.attn_in")
        q = linear(h, p + "self_attn.q_proj.weight", (nh * hd, H))
        k = linear(h, p + "self_attn.k_proj.weight", (nkv * hd, H))
        v = linear(h, p + "self_attn.v_proj.weight", (nkv * hd, H))
        perm = [0, 2, 1, 3]
        q = g.op("Transpose", [g.op("Reshape", [q, "shape_q"])], perm=perm)  # [B, nh, T, hd]
        k = g.op("Transpose", [g.op("Reshape", [k, "shape_kv"])], perm=perm)  # [B, nkv, T, hd]
        v = g.op("Transpose", [g.op("Reshape", [v, "shape_kv"])], perm=perm)  # [B, nkv, T, hd]
        q = g.op("Mul", [self.rope(q), "scale"], f"l{i}.q")
        k = self.rope(k)
        k_all = g.op("Concat", [PAST_KEY.format(i), k], PRESENT_KEY.format(i), axis=2)  # [B, nkv, S, hd]
        v_all = g.op("Concat", [PAST_VALUE.format(i), v], PRESENT_VALUE.format(i), axis=2)
        qf = g.op("Reshape", [q, "shape_fold"])  # [B, nkv, rep*T, hd]
        scores = g.op("MatMul", [qf, g.op("Transpose", [k_all], perm=[0, 1, 3, 2])])  # [B, nkv, rep*T, S]
        scores = g.op("Add", [g.op("Reshape", [scores, "shape_unfold"]), self.mask])  # [B, nh, T, S]
        probs = g.op("Reshape", [g.op("Softmax", [scores], axis=-1), "shape_fold"])  # [B, nkv, rep*T, S]
        ctx = g.op("Reshape", [g.op("MatMul", [probs, v_all]), "shape_unfold"])  # [B, nh, T, hd]
        ctx = g.op("Reshape", [g.op("Transpose", [ctx], perm=perm), "shape_merge"])  # [B, T, H]
        x = g.op("Add", [x, linear(ctx, p + "self_attn.o_proj.weight", (H, nh * hd))], f"l{i}.resid_attn")
        h = self.rms_norm(x, p + "post_attention_layernorm.weight", f"l{i}.mlp_in")
        gate = linear(h, p + "mlp.gate_proj.weight", (F, H))
        up = linear(h, p + "mlp.up_proj.weight", (F, H))
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])  # silu(gate) * up
        x = g.op("Add", [x, linear(act, p + "mlp.down_proj.weight", (H, F))], f"l{i}.out")
        return x


def _model(g: _Graph, c: dict[str, Any], metadata: Mapping[str, str] | None) -> onnx.ModelProto:
    """The graph's inputs and outputs (dynamic axes named), the model around it, and its metadata."""
    V, L, nkv, hd = c["vocab_size"], c["num_layers"], c["num_kv_heads"], c["hidden_size"] // c["num_heads"]
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info(INPUT_IDS, i64, [_B, _T]),
        helper.make_tensor_value_info(ATTENTION_MASK, i64, [_B, _S]),
        helper.make_tensor_value_info(POSITION_IDS, i64, [_B, _T]),
    ]
    outputs = [helper.make_tensor_value_info(LOGITS, f32, [_B, _T, V])]
    for i in range(L):
        for past, present in ((PAST_KEY, PRESENT_KEY), (PAST_VALUE, PRESENT_VALUE)):
            inputs.append(helper.make_tensor_value_info(past.format(i), f32, [_B, nkv, _P, hd]))
            outputs.append(helper.make_tensor_value_info(present.format(i), f32, [_B, nkv, _S, hd]))
    graph = helper.make_graph(g.nodes, "llama_decoder_kv_cache", inputs, outputs, initializer=g.inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="msllm",
        doc_string="LLaMA decoder with a KV cache: input_ids, attention_mask, position_ids, "
        "past_key_values.{i}.key/value -> logits, present.{i}.key/value",
    )
    model.ir_version = 8  # readable by every onnxruntime since 1.10
    arch = {
        k: c[k]
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_seq_length",
            "rope_theta",
            "norm_eps",
            "tie_embeddings",
        )
    }
    helper.set_model_props(
        model, {"model_config": json.dumps(arch), **{k: str(v) for k, v in (metadata or {}).items()}}
    )
    return model


def check_model(model: onnx.ModelProto | str | Path) -> None:
    """onnx.checker's full check (with shape inference); ValueError with its message."""
    try:
        onnx.checker.check_model(model if isinstance(model, onnx.ModelProto) else str(model), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ValueError(f"onnx.checker rejects the decoder graph: {exc}") from None


def save_model(model: onnx.ModelProto, path: str | Path) -> list[Path]:
    """Write `model` to `path` (weights inline below ~1.8 GB, else in `<name>.data` beside it). Returns the files."""
    p = Path(path)
    big = sum(t.ByteSize() for t in model.graph.initializer) > _EXTERNAL_ABOVE
    if big:
        onnx.save_model(
            model,
            str(p),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=p.name + ".data",
            size_threshold=1024,
        )
        return [p, p.with_name(p.name + ".data")]
    onnx.save_model(model, str(p))
    return [p]


def arch_of(model: onnx.ModelProto) -> dict[str, Any]:
    """The architecture dict stored by build_decoder (metadata "model_config")."""
    props = {p.key: p.value for p in model.metadata_props}
    if "model_config" not in props:
        raise ValueError("not a decoder written by tasks.deploy.onnx_decoder (no model_config metadata)")
    return json.loads(props["model_config"])


# ----------------------------------------------------------------------------- onnxruntime-genai files


def genai_config(
    config: Mapping[str, Any] | Any,
    *,
    eos_id: int,
    bos_id: int,
    pad_id: int,
    filename: str = "model.onnx",
    context_length: int | None = None,
) -> dict[str, Any]:
    """genai_config.json for onnxruntime-genai's "llama" decoder type, over the graph build_decoder writes.

    past and present are separate buffers (`past_present_share_buffer: false`): plain Concat
    grows the cache, as GroupQueryAttention's shared buffer would not. Search defaults: greedy,
    max_length = context_length (the model's max_seq_length unless given).
    """
    c = _cfg(config)
    ctx = int(context_length or c["max_seq_length"])
    return {
        "model": {
            "bos_token_id": int(bos_id),
            "eos_token_id": int(eos_id),
            "pad_token_id": int(pad_id),
            "context_length": ctx,
            "type": "llama",
            "vocab_size": int(c["vocab_size"]),
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": c["hidden_size"] // c["num_heads"],
                "hidden_size": c["hidden_size"],
                "num_attention_heads": c["num_heads"],
                "num_hidden_layers": c["num_layers"],
                "num_key_value_heads": c["num_kv_heads"],
                "inputs": {
                    "input_ids": INPUT_IDS,
                    "attention_mask": ATTENTION_MASK,
                    "position_ids": POSITION_IDS,
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": LOGITS,
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": ctx,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


SPACE = "\u2581"  # SentencePiece's whitespace symbol
# A pre-tokenizer that never splits: its pattern has a space, and the normalizer has replaced every
# space by the time Hugging Face tokenizers pre-tokenizes. It is there for onnxruntime-extensions
# (onnxruntime-genai's tokenizer): with no pre-tokenizer it splits English contractions ('s, 't,
# 're, 've, 'm, 'll, 'd) off before BPE, which SentencePiece does not ("'That" -> "'", "T", "hat"
# instead of "'", "That"); a Split on a literal string turns that off.
NO_SPLIT = {
    "type": "Split",
    "pattern": {"String": "<msllm: no pre-tokenizer split>"},
    "behavior": "Isolated",
    "invert": False,
}


def hf_tokenizer_files(model_bytes: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer.json, tokenizer_config.json) equivalent to a SentencePiece BPE model, for onnxruntime-genai.

    onnxruntime-genai's tokenizer (onnxruntime-extensions) reads Hugging Face tokenizer files,
    not tokenizer.model. This writes the layout of Hugging Face's LLaMA tokenizer.json: a BPE
    model over the SentencePiece pieces with byte fallback, merges ranked by the merged
    piece's score (a BPE SentencePiece model's piece order), a normalizer that replaces " "
    with "▁" (and prepends "▁" when the model adds a dummy prefix), and the matching decoder.
    Exactly equivalent only for what it can express: BPE pieces, identity normalization (NFKC
    normalization is approximated by the NFKC normalizer), no extra-whitespace removal; the
    export stage checks the token ids against SentencePiece. Needs sentencepiece's protobuf.
    """
    proto = pb.ModelProto()
    proto.ParseFromString(model_bytes)
    ts, ns = proto.trainer_spec, proto.normalizer_spec
    if ts.model_type != pb.TrainerSpec.BPE:
        raise ValueError(
            f"tokenizer.model is a {pb.TrainerSpec.ModelType.Name(ts.model_type)} SentencePiece model; "
            "the onnxruntime-genai tokenizer files are written for BPE models only"
        )
    pieces = [(p.piece, p.type) for p in proto.pieces]
    vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    normal = pb.ModelProto.SentencePiece.NORMAL
    user = pb.ModelProto.SentencePiece.USER_DEFINED
    merges = _bpe_merges(pieces, vocab)
    special = [
        (i, piece)
        for i, (piece, kind) in enumerate(pieces)
        if kind not in (normal, user) and not (piece.startswith("<0x") and len(piece) == 6)
    ]  # control + unknown, not the byte pieces
    unk = next((piece for piece, kind in pieces if kind == pb.ModelProto.SentencePiece.UNKNOWN), None)
    norm, dec = _normalizer_and_decoder(ns)
    tok_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": piece,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, piece in special
        ],
        "normalizer": {"type": "Sequence", "normalizers": norm},
        "pre_tokenizer": NO_SPLIT,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": dec},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": bool(ts.byte_fallback),
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[a, b] for *_, a, b in merges],
        },
    }
    return tok_json, _tokenizer_config(pieces, ts, ns, special)


def _tokenizer_config(pieces: list[tuple[str, int]], ts, ns, special: list[tuple[int, str]]) -> dict[str, Any]:
    """tokenizer_config.json of HF's LLaMA tokenizer for these pieces: no BOS/EOS added, the special pieces."""

    def piece_or_none(i: int) -> str | None:
        return pieces[i][0] if 0 <= i < len(pieces) else None

    return {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": False,
        "add_eos_token": False,
        "legacy": True,
        "add_prefix_space": bool(ns.add_dummy_prefix),
        "clean_up_tokenization_spaces": False,
        "bos_token": piece_or_none(ts.bos_id),
        "eos_token": piece_or_none(ts.eos_id),
        "unk_token": piece_or_none(ts.unk_id),
        "pad_token": piece_or_none(ts.pad_id),
        "model_max_length": 1_000_000_000,
        "added_tokens_decoder": {
            str(i): {
                "content": piece,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, piece in special
        },
    }


def _bpe_merges(pieces: list[tuple[str, int]], vocab: dict[str, int]) -> list[tuple[int, int, int, str, str]]:
    """Every split of a NORMAL piece into two NORMAL pieces of the vocab, ranked by the merged piece's id (= score
    order in a BPE model), then by the parts' ids, as transformers' SentencePieceExtractor does."""
    normal = pb.ModelProto.SentencePiece.NORMAL
    merges = []
    for piece, kind in pieces:
        if kind != normal or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            a, b = piece[:cut], piece[cut:]
            if a in vocab and b in vocab and pieces[vocab[a]][1] == normal and pieces[vocab[b]][1] == normal:
                merges.append((vocab[piece], vocab[a], vocab[b], a, b))
    return sorted(merges)


def _normalizer_and_decoder(ns) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The normalizers (NFKC where the model normalizes so, the dummy prefix, " " → "▁") and the decoders that undo
    them, for a SentencePiece normalizer spec."""
    norm: list[dict[str, Any]] = []
    if ns.name.lower().startswith("nmt_nfkc") or ns.name.lower() == "nfkc":
        norm.append({"type": "NFKC"})
    if ns.add_dummy_prefix:
        norm.append({"type": "Prepend", "prepend": SPACE})
    norm.append({"type": "Replace", "pattern": {"String": " "}, "content": SPACE})
    dec: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if ns.add_dummy_prefix:
        dec.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return norm, dec
