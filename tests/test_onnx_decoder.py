"""The ONNX decoder written from the weights (tasks/deploy/onnx_decoder.py) and its KV-cache generator
(tasks/deploy/onnx_generate.py).

Every check runs the graph in onnxruntime against the MindSpore network with the same
weights (`tiny`, random init): logits at many (batch, sequence, past) shapes, present → past
steps, left-padded batches, greedy and sampled generation, the int8 variant, and the
tokenizer files onnxruntime-genai reads.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import decoder_reduction, fp32_tol

from model.sampling import sample_next
from tasks.deploy.onnx_decoder import build_decoder, check_model, genai_config, hf_tokenizer_files, io_names, save_model
from tasks.deploy.onnx_generate import OnnxGenerator

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE = REPO / "data/corpora/tinyshakespeare.txt"


def _net(**overrides):
    from model.config import ModelConfig
    from model.llama import LlamaForCausalLM

    net = LlamaForCausalLM(ModelConfig.from_name("tiny", **overrides), seed=3)
    net.set_train(False)
    return net


def _weights(net) -> dict[str, np.ndarray]:
    return {p.name: p.asnumpy() for p in net.trainable_params()}


def _tol(net, want: np.ndarray) -> float:
    """onnxruntime (MLAS) against MindSpore (oneDNN) on the same weights: float32 sums in another order through
    the decoder's reductions (up to max_seq_length keys), at the scale of the logits compared (fp32_tol)."""
    return fp32_tol(np.abs(want).max(), decoder_reduction(net.config, net.config.max_seq_length))


def _ms_logits(net, rows: list[list[int]]) -> list[np.ndarray]:
    """MindSpore logits of each row alone ([len(row), V])."""
    import mindspore as ms

    return [net(ms.Tensor(np.asarray([r], np.int32))).asnumpy()[0] for r in rows]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    net = _net()
    path = tmp_path_factory.mktemp("decoder") / "model.onnx"
    save_model(build_decoder(net.config.to_dict(), _weights(net), metadata={"eos_id": 2}), path)
    return {"net": net, "path": path, "gen": OnnxGenerator(path)}


def _forward(gen, ids, mask, positions, past):
    return gen.forward(np.asarray(ids), np.asarray(mask), np.asarray(positions), past)


def test_graph_is_valid_and_every_data_axis_is_dynamic(tiny):
    m = onnx.load(str(tiny["path"]))
    check_model(tiny["path"])  # onnx.checker full check, with shape inference
    ins, outs = io_names(2)
    assert [i.name for i in m.graph.input] == ins and [o.name for o in m.graph.output] == outs
    dims = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*m.graph.input, *m.graph.output]
    }
    assert dims["input_ids"] == ["batch_size", "sequence_length"]
    assert dims["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert dims["past_key_values.1.value"] == ["batch_size", 2, "past_sequence_length", 16]
    assert dims["present.0.key"] == ["batch_size", 2, "total_sequence_length", 16]
    assert dims["logits"] == ["batch_size", "sequence_length", 512]
    # nothing traced: every Reshape target holds only 0 (copy), -1 (infer) and the model's head counts / sizes
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    targets = [inits[n.input[1]] for n in m.graph.node if n.op_type == "Reshape"]
    assert targets and all(set(t.tolist()) <= {0, -1, 4, 2, 16, 64} for t in targets)
    assert {n.domain for n in m.graph.node} <= {""} and m.opset_import[0].version == 18


@pytest.mark.parametrize("batch,prompt,past", [(1, 9, 0), (1, 1, 0), (3, 7, 0), (1, 4, 6), (2, 3, 5), (4, 1, 17)])
def test_logits_match_mindspore_at_dynamic_batch_prompt_and_past(tiny, batch, prompt, past):
    """Rows of different lengths, left-padded: a past (computed by the graph itself), then a prompt chunk."""
    rng = np.random.default_rng(batch * 100 + prompt * 10 + past)
    lens = [past + prompt - (i % 3 if past == 0 and prompt > 2 else 0) for i in range(batch)]  # padding when past = 0
    rows = [[int(t) for t in rng.integers(0, 512, n)] for n in lens]
    want = _ms_logits(tiny["net"], rows)
    gen, L = tiny["gen"], max(lens)
    head = L - prompt  # slots of the past (left padding included)
    ids, mask = np.zeros((batch, L), np.int64), np.zeros((batch, L), np.int64)
    for i, r in enumerate(rows):
        ids[i, L - len(r) :], mask[i, L - len(r) :] = r, 1
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    past_kv = gen.empty_past(batch)
    if head:
        _, past_kv = _forward(gen, ids[:, :head], mask[:, :head], pos[:, :head], past_kv)
    logits, present = _forward(gen, ids[:, head:], mask, pos[:, head:], past_kv)
    assert logits.shape == (batch, prompt, 512) and present["past_key_values.0.key"].shape == (batch, 2, L, 16)
    for i, r in enumerate(rows):
        real = min(prompt, len(r))  # the chunk's last `real` positions are this row's tokens
        assert np.abs(logits[i, prompt - real :] - want[i][len(r) - real :]).max() <= _tol(tiny["net"], want[i])


def test_single_token_steps_feed_present_back_as_past(tiny):
    rows = [[5, 9, 30, 7], [11, 12]]
    steps = [[40 + s, 200 + s] for s in range(10)]
    want = _ms_logits(tiny["net"], [rows[0] + [s[0] for s in steps], rows[1] + [s[1] for s in steps]])
    gen = tiny["gen"]
    last, state = gen.prefill(rows)
    net = tiny["net"]
    assert np.abs(last[0] - want[0][3]).max() <= _tol(net, want[0]) and np.abs(last[1] - want[1][1]).max() <= _tol(
        net, want[1]
    )
    for k, toks in enumerate(steps):
        logits = gen.step(state, toks)
        assert state.length == 4 + k + 1
        assert np.abs(logits[0] - want[0][4 + k]).max() <= _tol(net, want[0])
        assert np.abs(logits[1] - want[1][2 + k]).max() <= _tol(net, want[1])


def test_prefill_in_chunks_is_the_whole_prompt_at_once(tiny):
    """A prompt longer than the prefill chunk runs in chunks over the cache of the ones before (so a 2000-token
    prompt costs one chunk's logits and scores, not [T, V]): last logits, the cache and the steps after it are the
    whole prompt's, for a left-padded batch whose short row is all padding in the first chunk."""
    rows = [list(range(5, 16)), [40, 41, 42]]  # 11 and 3 tokens: chunks of 4 -> 3 calls, row 1 real in the last
    gen = OnnxGenerator(tiny["path"])
    gen.prefill_chunk = 4
    net = tiny["net"]
    want = _ms_logits(net, [rows[0] + [60, 61], rows[1] + [70, 71]])
    calls, forward = [], gen.forward
    gen.forward = lambda ids, *rest: calls.append(ids.shape) or forward(ids, *rest)
    last, state = gen.prefill(rows)
    assert calls == [(2, 4), (2, 4), (2, 3)]  # no call is fed more than one chunk
    whole_last, whole = OnnxGenerator(tiny["path"]).prefill(rows)  # prefill_chunk 256: one call
    assert state.length == whole.length == 11 and list(state.positions) == [11, 3]
    for k in whole.past:
        real = whole.attention_mask.astype(bool)  # padding slots hold whatever the padding computed
        for b in range(2):
            got, ref = state.past[k][b][:, real[b]], whole.past[k][b][:, real[b]]
            assert np.abs(got - ref).max() <= fp32_tol(np.abs(ref).max(), decoder_reduction(net.config, 11)), k
    for r, n in ((0, 11), (1, 3)):
        assert np.abs(last[r] - want[r][n - 1]).max() <= _tol(net, want[r])
        assert np.abs(last[r] - whole_last[r]).max() <= _tol(net, want[r])
    for j, toks in enumerate(([60, 70], [61, 71])):
        logits = gen.step(state, toks)
        for r, n in ((0, 11), (1, 3)):
            assert np.abs(logits[r] - want[r][n + j]).max() <= _tol(net, want[r])


def test_tied_embeddings_and_a_missing_weight():
    net = _net(tie_embeddings=True)
    w = _weights(net)
    assert "lm_head.weight" not in w
    model = build_decoder(net.config.to_dict(), w)
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[3, 4, 5, 6]], np.int64)
    past = {i.name: np.zeros((1, 2, 0, 16), np.float32) for i in sess.get_inputs() if i.name.startswith("past")}
    got = sess.run(
        ["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None], **past}
    )[0]
    want = _ms_logits(net, [[3, 4, 5, 6]])[0]
    assert np.abs(got[0] - want).max() <= _tol(net, want)
    del w["layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"weights lack 'layers.1.mlp.up_proj.weight'"):
        build_decoder(net.config.to_dict(), w)


def test_generation_matches_mindspore_greedy_and_sampled(tiny):
    from model.generate import Generator

    ms_gen = Generator(tiny["net"], max_len=24)
    gen = OnnxGenerator(tiny["path"], max_len=24)
    prompts = [[2, 17, 300, 45], [2], list(range(3, 40))]  # the last is longer than the window: cut like MindSpore's
    for p in prompts:
        want = ms_gen.generate(p, 30, eos_id=2)
        assert gen.generate(p, 30, eos_id=2) == want and list(gen.stream(p, 30, eos_id=2)) == want
        kw = dict(temperature=0.9, top_k=50, top_p=0.9, seed=7)
        assert gen.generate(p, 12, **kw) == ms_gen.generate(p, 12, **kw)
    assert len(gen.generate(prompts[0], 100)) == 20  # fills the window of 24
    stopped = gen.generate(prompts[0], 30, stop=lambda new: len(new) == 3)
    assert stopped == ms_gen.generate(prompts[0], 30)[:3]
    # a left-padded batch gives each row what it gets alone
    batch = gen.generate_batch(prompts[:2] + [[9, 8, 7, 6, 5, 4]], 10, eos_id=2)
    assert batch == [gen.generate(p, 10, eos_id=2) for p in prompts[:2] + [[9, 8, 7, 6, 5, 4]]]


def test_both_generators_sample_with_the_one_rule():
    import model.generate
    import model.sampling
    from tasks.deploy import onnx_generate

    assert onnx_generate.sample_next is model.sampling.sample_next is model.generate.sample_next


def test_standalone_copy_runs_with_numpy_and_onnxruntime_only(tmp_path):
    """The export artifact's copies (onnx_generate.py + sampling.py) run outside the project, and sample as it does."""
    import shutil
    import subprocess
    import sys

    for src in (REPO / "tasks" / "deploy" / "onnx_generate.py", REPO / "model" / "sampling.py"):
        shutil.copy2(src, tmp_path / src.name)
    code = """
import json, runpy, sys
import numpy as np
g = runpy.run_path("onnx_generate.py")
logits = np.random.default_rng(0).normal(size=64)
rng = np.random.default_rng(3)
draws = [g["sample_next"](logits, 0.9, 8, 0.9, rng) for _ in range(5)]
print(json.dumps({"draws": draws, "loaded": sorted(m for m in ("model", "tasks", "mindspore") if m in sys.modules)}))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    logits = np.random.default_rng(0).normal(size=64)
    rng = np.random.default_rng(3)
    assert out == {"draws": [sample_next(logits, 0.9, 8, 0.9, rng) for _ in range(5)], "loaded": []}
    res = subprocess.run(
        [sys.executable, "onnx_generate.py", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0 and "onnxruntime only" in res.stdout, res.stderr[-2000:]


def test_not_a_cache_decoder_is_a_clear_error(tmp_path):
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Identity", ["input_ids"], ["logits"])],
        "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.INT64, [1, 4])],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(tmp_path / "old.onnx"))
    with pytest.raises(ValueError, match="not a KV-cache decoder.*re-export it with `msllm export`"):
        OnnxGenerator(tmp_path / "old.onnx")


def test_int8_variant_is_smaller_and_close(tiny, tmp_path):
    from tasks.deploy.formats import export_int8

    export_int8(tiny["path"], tmp_path / "model.int8.onnx")
    m = onnx.load(str(tmp_path / "model.int8.onnx"))
    ops = {n.op_type for n in m.graph.node}
    assert "MatMulInteger" in ops and "DynamicQuantizeLinear" in ops
    # the attention MatMuls (both inputs computed) stay fp32; every weight MatMul is quantized
    assert sum(n.op_type == "MatMul" for n in m.graph.node) == 2 * 2
    assert (tmp_path / "model.int8.onnx").stat().st_size < 0.6 * tiny["path"].stat().st_size
    q = OnnxGenerator(tmp_path / "model.int8.onnx")
    rows = [[2, 17, 300, 45, 9, 8], [2, 5]]
    got, want = q.logits(rows), tiny["gen"].logits(rows)
    # < 0.05 on any x86: 7-bit weights (reduce_range) cannot saturate onnxruntime's u8 x s8 int16 pair sums,
    # which without VNNI moved these logits by 0.082 with 8-bit weights; per-channel scales keep the accuracy
    assert got.shape == want.shape and 0 < np.abs(got - want).max() < 0.05
    weights = [i for i in m.graph.initializer if i.name.endswith("_quantized")]
    assert weights and all(i.data_type == onnx.TensorProto.INT8 for i in weights)
    w = np.concatenate([onnx.numpy_helper.to_array(i).ravel() for i in weights])
    assert np.abs(w.astype(np.int32)).max() <= 64  # reduce_range: |w| <= 64, so 2 * 255 * 64 < 2^15
    scales = [i for i in m.graph.initializer if i.name.endswith("_scale") and len(i.dims) == 1 and i.dims[0] > 1]
    assert scales  # per-channel scales
    last, state = q.prefill(rows)  # the cache path works the same
    assert np.isfinite(q.step(state, [1, 2])).all()


def _data_stage_tokenizer(tmp_path: Path) -> Path:
    """A tokenizer trained with the data stage's SentencePiece options (tasks/stages/data/tokenizer.py)."""
    import sentencepiece as spm

    from tasks.stages.data.tokenizer import _SPM_OPTIONS

    lines = [ln for ln in SHAKESPEARE.read_text(encoding="utf-8")[:200_000].splitlines() if ln.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        vocab_size=512,
        model_type="bpe",
        character_coverage=1.0,
        **_SPM_OPTIONS,
    )
    (tmp_path / "tokenizer.model").write_bytes(buf.getvalue())
    return tmp_path / "tokenizer.model"


def test_tokenizer_files_give_sentencepiece_ids(tiny, tmp_path):
    """tokenizer.json == tokenizer.model on 100 KB of Shakespeare and awkward lines, in HF tokenizers and in genai."""
    import onnxruntime_genai as og
    import sentencepiece as spm
    from tokenizers import Tokenizer

    sp = spm.SentencePieceProcessor(model_file=str(_data_stage_tokenizer(tmp_path)))
    tok_json, tok_cfg = hf_tokenizer_files((tmp_path / "tokenizer.model").read_bytes())
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok_json), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_cfg), encoding="utf-8")
    (tmp_path / "model.onnx").symlink_to(tiny["path"])
    (tmp_path / "genai_config.json").write_text(
        json.dumps(genai_config(tiny["net"].config.to_dict(), eos_id=2, bos_id=1, pad_id=3))
    )
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    genai = og.Tokenizer(og.Model(str(tmp_path)))
    text = SHAKESPEARE.read_text(encoding="utf-8")[300_000:400_000]  # not the tokenizer's training text
    lines = [
        "'That I can't, 'tis so; they'll've done it.",
        "a  b   c\n\n\td",
        "naïve café — “quotes” ✓ 日本語",
        " leading space",
        "12345 and 6.7",
        "",
        "ROMEO:",
    ]
    for s in [text, *lines]:
        want = sp.encode(s)
        assert hf.encode(s).ids == want and [int(t) for t in genai.encode(s)] == want, s[:60]
    ids = sp.encode(text[:2000])
    assert genai.decode(ids) == sp.decode(ids) == hf.decode(ids)
    assert tok_cfg["eos_token"] == "</s>" and tok_json["model"]["byte_fallback"] is True


def test_a_unigram_tokenizer_gets_no_tokenizer_files(tmp_path):
    """onnxruntime-genai's files are written for BPE SentencePiece models; another type says so (and genai still
    runs from token ids: genai_config.json is written)."""
    import sentencepiece as spm

    from tasks.deploy.formats import write_genai_files

    lines = [ln for ln in SHAKESPEARE.read_text(encoding="utf-8")[:100_000].splitlines() if ln.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=300, model_type="unigram", minloglevel=2
    )
    with pytest.raises(ValueError, match="UNIGRAM SentencePiece model; .* BPE models only"):
        hf_tokenizer_files(buf.getvalue())
    info = {"model": _net().config.to_dict(), "tokenizer": {"eos_id": 2, "bos_id": 1, "pad_id": -1}}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.model").write_bytes(buf.getvalue())
    assert "BPE models only" in write_genai_files(tmp_path, info, tmp_path / "model")
    cfg = json.loads((tmp_path / "genai_config.json").read_text())
    assert cfg["model"]["pad_token_id"] == 2 and not (tmp_path / "tokenizer.json").exists()
