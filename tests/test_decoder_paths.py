"""Every path that computes the LLaMA decoder, against the one definition of its math (model/reference.py, numpy
float64), on the same random layer (grouped-query heads, norm weights apart from 1) and the same inputs: the training
cells, their fused kernels, the written-out layer forward of the layer-at-a-time step, the KV-cache decode paths
(functional, the decoder's MindSpore kernels, the fused decode kernel) and the ONNX graph. Each within the float32
bound of its reductions against float64 (tests/helpers.py fp32_tol / logit_tol); a wrong term (RoPE's sign, a
missing scale or residual, another kv head, a norm without its weight) is off by the values' own size."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from helpers import decoder_reduction, fp32_tol, logit_tol, loglikelihood_tol, q8_0_activations
from mindspore import Tensor

from model import reference
from model.config import ModelConfig

CFG = ModelConfig.from_name("tiny", init_std=0.1)  # 2 layers, 4 query heads over 2 kv heads, head_dim 16
T = 20


def _net(fused: bool = False, cfg: ModelConfig = CFG):
    """The build's network (fused cells where asked and built), its norm weights drawn apart from 1; (net, weights,
    the kernel decision)."""
    from tasks.modeling.build import build_network

    built = build_network("llama", cfg, seed=0, fused_kernels=fused)
    rng = np.random.default_rng(3)
    for p in built.net.get_parameters():
        if p.name.endswith("layernorm.weight") or p.name == "norm.weight":
            p.set_data(Tensor(rng.uniform(0.5, 1.5, p.shape).astype(np.float32)))
    built.net.set_train(False)
    return built.net, {p.name: p.asnumpy() for p in built.net.get_parameters()}, built.kernels


def _ids(n: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, CFG.vocab_size, n)]


def _layer_tol(y: np.ndarray, t: int) -> float:
    """One layer's output in float32 against float64: its reductions at t keys (a 1-layer decoder's, less the head)."""
    one = ModelConfig.from_dict({**CFG.to_dict(), "num_layers": 1})
    return fp32_tol(float(np.abs(y).max()), decoder_reduction(one, t))


@pytest.mark.parametrize("fused", [False, True], ids=["plain-cells", "fused-kernels"])
def test_training_cells_equal_the_reference(fused):
    net, weights, kernels = _net(fused)
    if fused and not kernels.fused:
        pytest.skip(f"the fused kernels do not run here: {kernels.model}")
    ids = _ids(T)
    x, cos, sin, mask = net.layer_inputs(Tensor(np.asarray([ids], np.int32)))
    y = net.layers[0](x, cos, sin, mask).asnumpy()[0]
    want, _ = reference.decoder_layer(
        x.asnumpy()[0].astype(np.float64), reference.layer_weights(weights, 0), CFG, np.arange(T)
    )
    np.testing.assert_allclose(y, want, rtol=0, atol=_layer_tol(want, T))
    logits = net(Tensor(np.asarray([ids], np.int32))).asnumpy()[0]
    ref, _ = reference.forward(ids, weights, CFG)
    np.testing.assert_allclose(logits, ref, rtol=0, atol=logit_tol(CFG, T, float(np.abs(ref).max())))


def _written_out(seed: int):
    """The fused build, the layer-at-a-time step's compiled layer functions (skipped where they do not apply) and a
    layer input from its prologue: (net, weights, fn, (x, cos, sin), flag)."""
    from tasks.training.layer_grad import functional_unsupported, layer_functions
    from tasks.training.layerwise import _Graph, _prologue

    net, weights, _ = _net(True)
    fn = layer_functions(net)
    if fn is None:
        pytest.skip(f"the written-out layer needs the fused kernels: {functional_unsupported(net)}")
    flag = Tensor(0, ms.int32)
    (x, cos, sin, _), _ = ms.jit(_Graph(net, _prologue))(Tensor(np.asarray([_ids(T, seed=seed)], np.int32)), flag)
    return net, weights, fn, (x, cos, sin), flag


@pytest.mark.integration  # ~5 s: the layer's forward and the prologue compiled
def test_written_out_layer_forward_equals_the_reference():
    """tasks/training/layer_grad.py's forward (the layer-at-a-time step's; its backward: the next test, and against
    autodiff tests/test_layerwise.py) on one layer's weights as graph inputs."""
    net, weights, fn, (x, cos, sin), flag = _written_out(seed=2)
    y, *_ = fn.forward(x, cos, sin, flag, *[Tensor(p.asnumpy()) for _, p in net.layers[1].parameters_and_names()])
    want, _ = reference.decoder_layer(
        x.asnumpy()[0].astype(np.float64), reference.layer_weights(weights, 1), CFG, np.arange(T)
    )
    np.testing.assert_allclose(y.asnumpy()[0], want, rtol=0, atol=_layer_tol(want, T))


@pytest.mark.integration  # ~6 s: the layer's forward, backward and the prologue compiled
def test_written_out_layer_backward_equals_the_reference_derivative():
    """The layer-at-a-time step's written-out backward against the definition's own derivative: along a random
    direction u of the input and every weight, <dx, u_x> + <dw, u_w> equals the central difference of
    <reference layer(x + e u), dy> (float64, e = 1e-4 of the values' scale: its truncation error ~e^2, far below
    the float32 bound)."""
    net, _, fn, (x, cos, sin), flag = _written_out(seed=9)
    named = list(net.layers[1].parameters_and_names())
    ws = [Tensor(p.asnumpy()) for _, p in named]
    y, *saved, _ = fn.forward(x, cos, sin, flag, *ws)
    rng = np.random.default_rng(10)
    dy = rng.normal(size=y.shape).astype(np.float32)
    dx, *dws, _ = fn.backward(x, cos, sin, flag, Tensor(dy), *saved, *ws)
    names = [n for n, _ in named]
    assert len(dws) == len(names)
    x0 = x.asnumpy()[0].astype(np.float64)
    w0 = {n: p.asnumpy().astype(np.float64) for n, p in named}
    ux = rng.normal(size=x0.shape)
    uw = {n: rng.normal(size=w.shape) for n, w in w0.items()}
    parts = [float((dx.asnumpy()[0] * ux).sum())] + [float((g.asnumpy() * uw[n]).sum()) for n, g in zip(names, dws)]
    analytic = sum(parts)

    def f(e: float) -> float:
        out, _ = reference.decoder_layer(x0 + e * ux, {n: w0[n] + e * uw[n] for n in names}, CFG, np.arange(T))
        return float((out * dy[0]).sum())

    e = 1e-4
    numeric = (f(e) - f(-e)) / (2 * e)
    # the float32 gradients' own sums: the layer's reductions forward and back, then the inner product's terms
    terms = float(
        np.abs(dx.asnumpy()[0] * ux).sum() + sum(np.abs(g.asnumpy() * uw[n]).sum() for n, g in zip(names, dws))
    )
    n = (
        2 * decoder_reduction(ModelConfig.from_dict({**CFG.to_dict(), "num_layers": 1}), T)
        + x0.size
        + sum(w.size for w in w0.values())
    )
    assert abs(analytic - numeric) <= fp32_tol(terms, n), (analytic, numeric, fp32_tol(terms, n))
    # the bound catches a wrong term: without any one part (dx, or one weight's gradient) the sum leaves it
    assert all(abs(analytic - part - numeric) > fp32_tol(terms, n) for part in parts), (parts, fp32_tol(terms, n))


def test_the_reference_cache_equals_its_full_forward():
    """The definition's own KV cache: a prompt, then tokens one at a time against the cache, give the full
    forward's logits (float64: to its rounding)."""
    _, weights, _ = _net()
    ids = _ids(12, seed=4)
    full, _ = reference.forward(ids, weights, CFG)
    got, cache = reference.forward(ids[:7], weights, CFG)
    rows = [got]
    for t in ids[7:]:
        step, cache = reference.forward([t], weights, CFG, cache)
        rows.append(step)
    # float64 both ways: fp32_tol's argument with float64's epsilon (2^-52 instead of 2^-23)
    tol = fp32_tol(float(np.abs(full).max()), decoder_reduction(CFG, 12)) * 2.0**-29
    np.testing.assert_allclose(np.concatenate(rows), full, rtol=0, atol=tol)


@pytest.mark.integration  # ~10 s: each path's prefill and decode graphs compiled
def test_kv_cache_decode_paths_equal_the_reference():
    """A 9-token prompt, then 4 tokens through the cache, on every decode path this machine has: the functional
    cache (LlamaForCausalLM.forward_cached, the server's interleaved sequences), the decoder's MindSpore kernels
    (CachedDecoder) and the fused decode kernel (model/decode_kernel.cc)."""
    from model.generate import Generator

    net, weights, _ = _net()
    prompt, sent = _ids(9, seed=5), _ids(4, seed=6)
    ref, _ = reference.forward(prompt + sent, weights, CFG)
    want = ref[len(prompt) - 1 :]  # [5, V]
    tols = [logit_tol(CFG, len(prompt) + i, float(np.abs(r).max())) for i, r in enumerate(want)]

    def check(name, rows):
        for i, (got, w, tol) in enumerate(zip(rows, want, tols)):
            np.testing.assert_allclose(got, w, rtol=0, atol=tol, err_msg=f"{name}, step {i}")

    k, v = net.init_cache(1, 64)
    rows, at = [], 0
    for chunk in [prompt] + [[t] for t in sent]:
        logits, k, v = net.forward_cached(Tensor(np.asarray([chunk], np.int32)), Tensor(at, ms.int32), k, v)
        rows.append(logits.asnumpy()[0, -1])
        at += len(chunk)
    check("functional", rows)
    paths = {"decoder": Generator(net, fused=False)}
    fused = Generator(net)
    if fused.decode_path == "fused":
        paths["fused"] = fused
    for name, gen in paths.items():
        assert gen.decode_path == name, gen.decode_reason
        steps = gen._cached_steps(prompt)
        rows = [next(steps)] + [steps.send(t) for t in sent]
        steps.close()
        check(name, rows)


def _stored(weights: dict, fmt: str) -> dict:
    """The weights as the fused steps read them in `fmt`: the matrices rounded to binary16, or quantized to Q8_0 and
    dequantized (d · q, exact in float32); the norms as they are."""
    import gguf
    from gguf.quants import dequantize

    from model.fused_decode import q8_0_blocks

    def stored(w):
        if fmt == "fp16":
            return w.astype(np.float16).astype(np.float32)
        return dequantize(q8_0_blocks(w), gguf.GGMLQuantizationType.Q8_0).astype(np.float32)

    matrix = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")
    return {n: stored(w) if n.endswith(matrix) else w for n, w in weights.items()}


def _q8_0_act(x, name):
    """reference.forward's `act` for Q8_0 weights: each row of x as the fused steps' Q8_0 GEMV multiplies it (ggml's
    int8 blocks, tests/helpers.py q8_0_activations), as float64 q * d."""
    q, d = q8_0_activations(x)
    return (q.reshape(*q.shape[:-1], -1, 32) * d[..., None]).reshape(q.shape).astype(np.float64)


@pytest.mark.integration  # ~5 s per format: the fused prefill and decode steps compiled
@pytest.mark.parametrize("fmt", ["fp16", "q8_0"])
def test_fused_decode_with_stored_weights_equals_the_reference_on_them(fmt):
    """`Generator(weights="fp16" | "q8_0")`: the fused prefill chunk and decode steps read binary16 copies of the
    weight matrices, or GGUF Q8_0 blocks, and they are not the fp32 weights' logits (a step that silently read the
    fp32 matrices would match those instead).

    fp16 computes in float32: it equals the definition run on the stored weights (rounded to binary16) within the same
    float32 bound as the fp32 path. Q8_0 also rounds each decode GEMV's input to int8 blocks, as llama.cpp does (the
    prefill chunk's GEMMs keep float inputs; its last row's LM head rounds them): the definition with those
    activations (reference.forward's `act`) is what it computes. That rounding is discontinuous, so a value within
    float32's rounding of a .5 boundary may land on either side on another CPU (tests/test_kernel_isa.py checks the
    GEMV's integers exactly); here each step must sit within a quarter of the activations' own rounding effect of
    that definition (the distance to the same weights with float activations), and at least half that effect away
    from the float-activation logits."""
    from model.fused_decode import is_matrix
    from model.generate import Generator

    cfg = ModelConfig.from_dict({**CFG.to_dict(), "intermediate_size": 160})  # Q8_0: rows of 32-weight blocks
    net, weights, _ = _net(cfg=cfg)
    gen = Generator(net, weights=fmt)
    if gen.decode_path != "fused":
        pytest.skip(f"the fused decode kernel does not run here: {gen.decode_reason}")
    assert gen.weights == fmt and f"{fmt} weight matrices" in gen.decode_reason
    assert is_matrix(3, 2) and is_matrix(9, 2) and not is_matrix(8, 2) and not is_matrix(13, 2)
    prompt, sent = _ids(9, seed=5), _ids(4, seed=6)
    stored = _stored(weights, fmt)
    plain = reference.forward(prompt + sent, stored, cfg)[0][len(prompt) - 1 :]
    fp32 = reference.forward(prompt + sent, weights, cfg)[0][len(prompt) - 1 :]
    want = plain
    if fmt == "q8_0":
        at_prompt, cache = reference.forward(
            prompt, stored, cfg, act=lambda x, n: _q8_0_act(x, n) if n == "lm_head" else x
        )
        want = np.concatenate([at_prompt[-1:], reference.forward(sent, stored, cfg, cache=cache, act=_q8_0_act)[0]])
    steps = gen._cached_steps(prompt)
    rows = [next(steps)] + [steps.send(t) for t in sent]
    steps.close()
    far = 0.0
    for i, (got, w, p, w32) in enumerate(zip(rows, want, plain, fp32)):
        tol = logit_tol(cfg, len(prompt) + i, float(np.abs(w).max()))
        if fmt == "q8_0":
            effect = float(np.abs(w - p).max())
            assert effect > 4 * tol, f"step {i}: the activations' rounding moves the logits by {effect:.3g} only"
            tol = max(tol, effect / 4)
            assert float(np.abs(got - p).max()) >= effect / 2, f"step {i}: the activations were not rounded"
        np.testing.assert_allclose(got, w, rtol=0, atol=tol, err_msg=f"{fmt} weights, step {i}")
        far = max(far, float(np.abs(got - w32).max()) / tol)
    assert far > 4, f"the {fmt} path is within {far:.1f} bounds of the fp32 weights' logits: were they read?"


@pytest.mark.integration  # ~6 s: three formats' score steps compiled
def test_scoring_in_each_weight_format_equals_the_reference_on_its_weights():
    """`Generator.score` (the eval scorer's path for stored formats: ScoreStep, the prefill chunk with every row's
    logits) over a sequence longer than two chunks (the last one overlapping) and one shorter than a chunk (padded):
    every row equals the definition on the weights as stored (fp32; binary16; Q8_0's d · q, with float activations as
    the prefill's GEMMs have them) within the float32 bound, and the caches are free again afterwards."""
    from model.generate import Generator

    cfg = ModelConfig.from_dict({**CFG.to_dict(), "intermediate_size": 160})
    net, weights, _ = _net(cfg=cfg)
    for fmt in ("fp32", "fp16", "q8_0"):
        gen = Generator(net, weights=fmt, max_len=128, prefill_chunk=48)
        if not gen.can_score():
            pytest.skip(f"the fused steps do not run here: {gen.decode_reason}")
        for ids in (_ids(120, seed=8), _ids(23, seed=9)):
            want = reference.forward(ids, _stored(weights, fmt) if fmt != "fp32" else weights, cfg)[0]
            got = gen.score(ids)
            assert got.shape == want.shape and gen.can_score()
            for i in range(len(ids)):
                tol = logit_tol(cfg, i + 1, float(np.abs(want[i]).max()))
                np.testing.assert_allclose(got[i], want[i], rtol=0, atol=tol, err_msg=f"{fmt}, row {i} of {len(ids)}")


@pytest.mark.integration  # ~4 s: the 256-token fused steps compiled
def test_prompts_past_256_tokens_prefill_in_256_token_chunks_and_equal_the_reference():
    """A 300-token sequence (past FUSED_PREFILL_CHUNK): the fused prefill and score steps take it in 256-token chunks
    (the second overlapping the first), and the logits equal the definition's within the float32 bound: every row of
    `score`, and the prompt's last row that the first decode step starts from."""
    from model.generate import FUSED_PREFILL_CHUNK, Generator

    cfg = ModelConfig.from_dict({**CFG.to_dict(), "max_seq_length": 320})
    net, weights, _ = _net(cfg=cfg)
    gen = Generator(net, max_len=320)
    if not gen.can_score():
        pytest.skip(f"the fused steps do not run here: {gen.decode_reason}")
    ids = _ids(300, seed=12)
    assert gen._fused_chunk(len(ids)) == FUSED_PREFILL_CHUNK == 256 and gen._fused_chunk(200) == gen.prefill_chunk
    want = reference.forward(ids, weights, cfg)[0]
    got = gen.score(ids)
    steps = gen._cached_steps(ids)
    last = next(steps)
    steps.close()
    for i in list(range(0, 300, 37)) + [255, 256, 299]:
        tol = logit_tol(cfg, i + 1, float(np.abs(want[i]).max()))
        np.testing.assert_allclose(got[i], want[i], rtol=0, atol=tol, err_msg=f"score row {i}")
    np.testing.assert_allclose(last, want[-1], rtol=0, atol=logit_tol(cfg, 300, float(np.abs(want[-1]).max())))


def test_q8_0_weights_need_rows_of_32_and_say_so():
    """A model whose rows are not whole Q8_0 blocks (tiny: MLP 172) keeps fp32 weights, and the decode reason says
    why; an unknown format is a ValueError naming the formats."""
    from model.generate import Generator

    net, _, _ = _net()
    gen = Generator(net, weights="q8_0")
    assert gen.weights == "fp32" and "q8_0 weights" in gen.decode_reason and "stay fp32" in gen.decode_reason
    with pytest.raises(ValueError, match="fp32, fp16, q8_0"):
        Generator(net, weights="q4_0")


@pytest.mark.integration  # ~3 s: the graph written and run on onnxruntime
def test_onnx_graph_equals_the_reference(tmp_path):
    """tasks/deploy/onnx_decoder.py's graph (written from the weights, run by onnxruntime without MindSpore): the
    prompt's logits, then tokens through its past/present key-value inputs."""
    from tasks.deploy.onnx_decoder import build_decoder, save_model
    from tasks.deploy.onnx_generate import OnnxGenerator

    _, weights, _ = _net()
    save_model(build_decoder(CFG, weights), tmp_path / "model.onnx")
    gen = OnnxGenerator(tmp_path / "model.onnx", threads=1)
    prompt, sent = _ids(9, seed=7), _ids(4, seed=8)
    ref, _ = reference.forward(prompt + sent, weights, CFG)
    logits, state = gen.prefill([prompt])
    rows = [logits[0]] + [gen.step(state, [t])[0] for t in sent]
    for i, (got, w) in enumerate(zip(rows, ref[len(prompt) - 1 :])):
        np.testing.assert_allclose(
            got, w, rtol=0, atol=logit_tol(CFG, len(prompt) + i, float(np.abs(w).max())), err_msg=f"step {i}"
        )


@pytest.mark.parametrize("fmt", ["fp16", "q8_0"])
def test_a_network_loaded_with_only_its_stored_matrices_runs_as_the_copy_does(tmp_path, fmt, monkeypatch):
    """`load_network(artifact, weights=fmt)` reads each matrix straight into the format (the embedding in blocks of
    rows: CONVERT_CHUNK made smaller than it here) and never allocates the float32 ones: its Generator decodes the
    same greedy tokens and scores the same logits, bit for bit, as a Generator copying the matrices of the whole
    float32 network (the same stored bytes through the same kernel); the paths that would read the float32
    matrices refuse with a DecodeError that says how to load the model for them."""
    from helpers import tiny_model_artifact

    import tasks.store.tensors as tensors
    from model.fused_decode import DecodeError
    from model.generate import Generator
    from tasks.modeling.build import load_network

    art = tiny_model_artifact(tmp_path, intermediate_size=160, vocab_size=512)
    whole, _ = load_network(art)
    copy = Generator(whole, weights=fmt, max_len=64)
    if copy.weights != fmt:
        pytest.skip(f"the fused steps do not run here: {copy.decode_reason}")
    monkeypatch.setattr(tensors, "CONVERT_CHUNK", 512 * 64 * 4 // 3)  # the [512, 64] embedding in 4 blocks of rows
    lean, _ = load_network(art, weights=fmt)
    assert lean.stored_weights.dtype == fmt and lean.stored_weights.nbytes() == copy._weights.nbytes()
    for a, b in zip(lean.stored_weights.get_parameters(), copy._weights.get_parameters(), strict=True):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy(), err_msg=a.name)
    gen = Generator(lean, weights=fmt, max_len=64)
    assert gen.lean and gen.decode_path == "fused" and "only" in gen.decode_reason
    ids = _ids(21, seed=4)
    assert gen.generate(ids, 12) == copy.generate(ids, 12)
    np.testing.assert_array_equal(gen.score(ids), copy.score(ids))
    np.testing.assert_array_equal(gen.prompt_logits(ids), copy.score(ids))  # echo: the score step
    with pytest.raises(DecodeError, match="without the KV cache.*weights='fp32'"):
        gen.generate(ids, 2, use_cache=False)
    first = gen._cached_steps(ids)
    next(first)
    with pytest.raises(DecodeError, match="interleaved"):
        next(gen._cached_steps(ids))
    first.close()
    with pytest.raises(DecodeError, match=f"only {fmt} weight matrices"):
        Generator(lean, weights="fp32")


def test_stored_matrices_load_refuses_a_bad_file_and_a_misfit_model_loads_whole(tmp_path, capsys):
    """Loading only the stored matrices checks what the float32 load checks: a NaN in a matrix names the tensor
    (before it is converted), and a model whose rows are not whole Q8_0 blocks (tiny: MLP 172) loads its float32
    weights, saying why on stderr."""
    from helpers import tiny_model_artifact
    from safetensors.numpy import load_file, save_file

    import tasks.store.tensors as tensors
    from tasks.modeling.build import load_network
    from tasks.store.tensors import CheckpointError

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    misfit = tiny_model_artifact(tmp_path / "a")
    net, _ = load_network(misfit, weights="q8_0")
    assert getattr(net, "stored_weights", None) is None and "Q8_0 rows need a multiple of 32" in capsys.readouterr().err
    art = tiny_model_artifact(tmp_path / "b", intermediate_size=160)
    w = load_file(str(art / "model.safetensors"))
    w["layers.1.mlp.down_proj.weight"][3, 5] = np.nan
    save_file(w, str(art / "model.safetensors"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tensors, "verify_published", lambda p: None)  # past the manifest's digest: the NaN check itself
        with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.down_proj\.weight"):
            load_network(art, weights="fp16")


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "q8_0"])
def test_batched_decoding_gives_each_sequence_the_logits_it_gets_alone(fmt):
    """`BatchDecoder` (the server's continuous batching): three sequences of different prompt lengths (one past a
    prefill chunk) prefilled into their slots together (`prefill_many`: the two short ones in one PackedPrefillStep),
    decoded together one token each per step, one leaving and another
    joining its freed slot midway: every row's logits equal, bit for bit, what the Generator's own fused steps give
    that sequence alone (the same prefill chunks; each row of BatchDecodeStep summed in DecodeStep's order), in
    every weight format; and a decode past the slots or into a slot twice is refused."""
    from model.fused_decode import DecodeError
    from model.generate import Generator

    cfg = ModelConfig.from_dict({**CFG.to_dict(), "intermediate_size": 160})
    net, _, _ = _net(cfg=cfg)
    gen = Generator(net, weights=fmt, max_len=96, prefill_chunk=16)
    if gen.decode_path != "fused" or gen.weights != fmt:
        pytest.skip(f"the fused steps do not run here: {gen.decode_reason}")
    prompts = [_ids(5, seed=20), _ids(23, seed=21), _ids(9, seed=22), _ids(14, seed=23)]
    steps = 7

    def alone(ids):  # the prompt's logits, then each step's after feeding the argmax
        co = gen._cached_steps(list(ids))
        out = [next(co)]
        for _ in range(steps):
            out.append(co.send(int(np.argmax(out[-1]))))
        co.close()
        return out

    want = [alone(p) for p in prompts]
    batch = gen.batch(3)
    running = {}  # sequence -> [slot, position, logits so far]
    slots = [batch.acquire() for _ in range(3)]
    first = batch.prefill_many(slots, prompts[:3])  # 5 and 9 tokens packed in one pass, 23 (past a chunk) alone
    for i in range(3):
        running[i] = [slots[i], len(prompts[i]), [first[i]]]
    assert batch.free == 0
    with pytest.raises(DecodeError, match="all 3 decode slots"):
        batch.acquire()
    for step in range(2 * steps):
        if step == 3:  # sequence 0 leaves; sequence 3 joins in its slot
            batch.release(running.pop(0)[0])
            slot = batch.acquire()
            running[3] = [slot, len(prompts[3]), [batch.prefill(slot, prompts[3])]]
        live = [i for i in running if len(running[i][2]) <= steps]
        if not live:
            break
        rows = batch.decode(
            [running[i][0] for i in live],
            [running[i][1] for i in live],
            [int(np.argmax(running[i][2][-1])) for i in live],
        )
        for i, row in zip(live, rows, strict=True):
            running[i][1] += 1
            running[i][2].append(row)
    for i, (_, _, got) in running.items():
        assert len(got) == steps + 1
        for k, (a, b) in enumerate(zip(got, want[i], strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"{fmt}: sequence {i}, step {k}")
    s0, s1 = running[1][0], running[2][0]
    with pytest.raises(DecodeError):  # the same slot twice in one step
        batch.decode([s0, s0], [30, 31], [1, 2])
    with pytest.raises(DecodeError):  # a position past the slot
        batch.decode([s1], [96], [1])


@pytest.mark.parametrize("fmt", ["fp16", "q8_0"])
def test_a_formats_perplexity_change_is_its_rounding_and_nothing_else(fmt):
    """Scoring in `fmt` instead of fp32 changes the log-likelihood of a sequence (its perplexity: docs/SERVING.md
    states the change per format on SmolLM2-135M, scripts/bench/quality.py measures it beside llama.cpp's) by exactly
    what the format's rounding of the weights changes in the definition (model/reference.py in float64 on the stored
    weights), within the float32 bound of the two scored sequences (helpers.loglikelihood_tol, one per side); and the
    format moves it by more than that bound, so a path that scored in fp32 instead (a change of 0) fails."""
    from model.generate import Generator

    cfg = ModelConfig.from_dict({**CFG.to_dict(), "intermediate_size": 160})
    net, weights, _ = _net(cfg=cfg)
    ids = _ids(97, seed=31)
    x, y = ids[:-1], ids[1:]
    n = len(x)

    def definition(w):  # (log-likelihood of y given x, the largest |logit|)
        z = reference.forward(x, w, cfg)[0]
        m = z.max(-1)
        lse = m + np.log(np.exp(z - m[:, None]).sum(-1))
        return float((z[np.arange(n), y] - lse).sum()), float(np.abs(z).max())

    ll32, z32 = definition(weights)
    llf, zf = definition(_stored(weights, fmt))
    got = {}
    for w in ("fp32", fmt):
        gen = Generator(net, weights=w, max_len=128)
        if gen.weights != w or not gen.can_score():
            pytest.skip(f"the fused steps do not run here: {gen.decode_reason}")
        got[w] = float(gen.score(x, y)[0].sum())
    tol = loglikelihood_tol(cfg, n, n, z32, ll32) + loglikelihood_tol(cfg, n, n, zf, llf)
    assert abs((got[fmt] - got["fp32"]) - (llf - ll32)) <= tol, (got, ll32, llf, tol)
    assert abs(llf - ll32) > tol, (llf - ll32, tol)
