"""Generation (model/generate.py) and the KV-cache forward (LlamaForCausalLM.forward_cached)."""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
import time

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from model.config import ModelConfig
from model.fused_decode import build_decode_kernel, decode_disabled_reason, decode_kernel_path
from model.generate import Generator
from model.llama import LlamaForCausalLM
from model.sampling import sample_next
from tests.helpers import logit_tol


@pytest.fixture(scope="module")
def net():
    # init_std 0.3: peaked logits, so greedy choices are not decided by float noise
    model = LlamaForCausalLM(ModelConfig.from_name("tiny", init_std=0.3), seed=0)
    model.set_train(False)
    return model


@pytest.fixture(scope="module")
def gen(net):
    return Generator(net)


def ids(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.RandomState(seed).randint(0, 512, size=n)]


def test_forward_cached_matches_full_forward(net):
    """Prefill in two chunks (at position 0 and 5), then one token at a time: logits equal the plain forward."""
    tokens = np.asarray([ids(20, seed=1)], np.int32)
    full = net(Tensor(tokens)).asnumpy()
    k, v = net.init_cache(1, 64)
    got = []
    for start, end in [(0, 5), (5, 12)] + [(p, p + 1) for p in range(12, 20)]:
        logits, k, v = net.forward_cached(Tensor(tokens[:, start:end]), Tensor(start, ms.int32), k, v)
        got.append(logits.asnumpy())
    got = np.concatenate(got, axis=1)
    assert np.abs(full).max() > 1.0
    np.testing.assert_allclose(got, full, rtol=0, atol=logit_tol(net.config, 20, np.abs(full).max()))


def test_prompt_logits_equal_the_full_forward_at_any_length(net, gen, monkeypatch):
    """The server's echo logits: one layer graph and one head graph serve every prompt length (no bucket padding),
    the head over 16 positions per call here, each equal to the plain forward on that prompt; out-of-range prompts
    are refused before any compute."""
    monkeypatch.setattr(gen, "ECHO_HEAD_ROWS", 16)  # 33 positions: three head calls, the last one short
    for n in (1, 7, 33, 70):  # inside one 32-token bucket, across two, and past the tiny model's 64
        if n > gen.max_len:
            with pytest.raises(ValueError, match="max_len"):
                gen.prompt_logits(ids(n, seed=n))
            continue
        full = net(Tensor(np.asarray([ids(n, seed=n)], np.int32))).asnumpy()[0]
        got = gen.prompt_logits(ids(n, seed=n))
        assert got.shape == full.shape == (n, net.config.vocab_size)
        np.testing.assert_allclose(got, full, rtol=0, atol=logit_tol(net.config, n, np.abs(full).max()))
    with pytest.raises(ValueError, match="max_len"):
        gen.prompt_logits([])


@pytest.mark.parametrize(
    "chunk,fused",
    [  # the unit tier runs chunk 8 on the fused op (the default 64 in other tests)
        (8, True),
        pytest.param(64, True, marks=pytest.mark.integration),
        pytest.param(8, False, marks=pytest.mark.integration),
    ],
)  # ~7 s: the chunk graph
def test_prefill_runs_in_fixed_chunks_for_any_prompt_length(net, chunk, fused):
    """The prompt pass is fixed-size chunks (no graph, and no buffer, per prompt length): at lengths below one
    chunk, on its edge, across it, over several chunks (the last one overlapping the one before) and up to the
    cache's end, the logits it yields, and those of the decode step after it, equal the plain forward's, on the
    in-place caches (fused: the whole-model PrefillStep op where the kernel builds; else the decoder's static chunk
    graph with the native chunk attention) and on the functional path (the server's interleaved sequences)."""
    gen = Generator(net, prefill_chunk=chunk, fused=fused)
    assert gen.prefill_chunk == chunk
    assert (gen._fused_prefill is not None) == (fused and build_decode_kernel() is not None)
    for n in sorted({1, 7, chunk, chunk + 1, min(2 * chunk + 3, gen.max_len - 1), gen.max_len - 1}):
        prompt = ids(n, seed=100 + n)
        starts = [s for _, s, _ in gen._chunks(prompt)]
        assert starts[-1] + chunk == max(n, chunk) and starts[-1] >= 0  # the last chunk ends at the prompt's end
        for busy in (False, True):  # busy: the in-place caches are taken, so the functional path runs
            gen._decoder_busy = busy
            steps = gen._cached_steps(prompt)
            first = next(steps)
            tok = int(np.argmax(first))
            second = steps.send(tok)
            steps.close()
            full = net(Tensor(np.asarray([prompt + [tok]], np.int32))).asnumpy()[0]
            # the decoder's fp32 sums at n + 1 keys, reordered (logit_tol)
            np.testing.assert_allclose(
                first, full[n - 1], rtol=0, atol=logit_tol(net.config, n, np.abs(full[n - 1]).max())
            )
            np.testing.assert_allclose(
                second, full[n], rtol=0, atol=logit_tol(net.config, n + 1, np.abs(full[n]).max())
            )
    gen._decoder_busy = False


def test_chunk_attention_op_matches_rope_cache_write_and_masked_attention():
    """model/decode_kernel.cc ChunkAttention: RoPE on the chunk's q (scaled) and k, its k and v written into the
    caches at slots start.., and query i attending slots 0..start+i, as NumPy computes it in fp64, over kv-head
    groups, at chunk sizes that do and do not fill the kernel's 4-query and SIMD blocks; slots outside the
    chunk keep their values; a chunk past the cache's end is refused."""
    from model.fused_decode import chunk_attention_op

    lib = build_decode_kernel()
    if lib is None:
        pytest.skip(f"decode kernel off: {decode_disabled_reason()}")
    op = chunk_attention_op(lib)
    rng = np.random.default_rng(0)
    nkv, n_rep, hd, s, scale = 2, 3, 16, 64, 0.25
    ang = np.arange(s)[:, None] * (1e-2 ** (np.arange(hd // 2) / (hd // 2)))[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], 1)), np.sin(np.concatenate([ang, ang], 1))

    def rope(x, p):  # rotate-half, as model/layers.py
        rot = np.concatenate([-x[hd // 2 :], x[: hd // 2]])
        return x * cos[p] + rot * sin[p]

    for t, start in ((1, 0), (5, 0), (7, 20), (16, 48)):
        q = rng.standard_normal((t, nkv * n_rep * hd)).astype(np.float32)
        k = rng.standard_normal((t, nkv * hd)).astype(np.float32)
        v = rng.standard_normal((t, nkv * hd)).astype(np.float32)
        kc0 = rng.standard_normal((nkv, s, hd)).astype(np.float32)
        vc0 = rng.standard_normal((nkv, s, hd)).astype(np.float32)
        kc, vc = ms.Parameter(Tensor(kc0.copy()), name="kc"), ms.Parameter(Tensor(vc0.copy()), name="vc")
        got = op(
            Tensor(q),
            Tensor(k),
            Tensor(v),
            Tensor(start, ms.int32),
            Tensor(cos.astype(np.float32)),
            Tensor(sin.astype(np.float32)),
            kc,
            vc,
            Tensor(np.array([scale, 2], np.float32)),
        ).asnumpy()
        want_k, want_v = kc0.astype(np.float64), vc0.astype(np.float64)
        for i in range(t):
            for g in range(nkv):
                want_k[g, start + i] = rope(k[i, g * hd : (g + 1) * hd].astype(np.float64), start + i)
                want_v[g, start + i] = v[i, g * hd : (g + 1) * hd]
        # one rounding per RoPE term: a few ulps of |k| ~ 1; untouched slots stay exactly as they were
        np.testing.assert_allclose(kc.asnumpy(), want_k, rtol=0, atol=8 * np.finfo(np.float32).eps * np.abs(k).max())
        np.testing.assert_array_equal(vc.asnumpy(), want_v.astype(np.float32))
        want = np.zeros((t, nkv * n_rep, hd))
        for i in range(t):
            for h in range(nkv * n_rep):
                g = h // n_rep
                qh = rope(q[i, h * hd : (h + 1) * hd].astype(np.float64), start + i) * scale
                sc = want_k[g, : start + i + 1] @ qh
                p = np.exp(sc - sc.max())
                want[i, h] = (p / p.sum()) @ want_v[g, : start + i + 1]
        # fp32 dot products of hd terms and sums of up to s terms, with |v| ~ 1: ~s * eps of the output scale
        np.testing.assert_allclose(got.reshape(t, -1, hd), want, rtol=0, atol=s * np.finfo(np.float32).eps * 4)
    from model.kernel_ops import KernelShapeError

    with pytest.raises(KernelShapeError, match=r"ChunkAttention: q \[T, heads \* head_dim\], k and v"):  # k of one head
        op(
            Tensor(q),
            Tensor(k[:, :hd]),
            Tensor(v),
            Tensor(0, ms.int32),
            Tensor(cos.astype(np.float32)),
            Tensor(sin.astype(np.float32)),
            kc,
            vc,
            Tensor(np.array([scale, 1], np.float32)),
        ).asnumpy()
    with pytest.raises(KernelShapeError, match=r"ChunkAttention: operand 3 must be Int32"):  # a float start
        op(
            Tensor(q),
            Tensor(k),
            Tensor(v),
            Tensor(0.0, ms.float32),
            Tensor(cos.astype(np.float32)),
            Tensor(sin.astype(np.float32)),
            kc,
            vc,
            Tensor(np.array([scale, 1], np.float32)),
        ).asnumpy()
    with pytest.raises(RuntimeError):
        op(
            Tensor(np.zeros((8, nkv * n_rep * hd), np.float32)),
            Tensor(np.zeros((8, nkv * hd), np.float32)),
            Tensor(np.zeros((8, nkv * hd), np.float32)),
            Tensor(s - 4, ms.int32),
            Tensor(cos.astype(np.float32)),
            Tensor(sin.astype(np.float32)),
            kc,
            vc,
            Tensor(np.array([scale, 1], np.float32)),
        ).asnumpy()


@pytest.mark.integration  # ~11 s: a forward graph per bucket
def test_cached_and_uncached_greedy_decoding_produce_the_same_tokens(gen):
    for prompt in (ids(7), ids(45, seed=2)):  # one prefill bucket, and a prompt longer than one bucket (32)
        cached = gen.generate(prompt, 40)
        uncached = gen.generate(prompt, 40, use_cache=False)
        assert len(cached) == 40
        assert cached == uncached
    assert len(set(cached)) > 1  # not a degenerate constant sequence


def test_greedy_is_the_argmax_of_the_full_forward(net, gen):
    prompt = ids(9, seed=3)
    new = gen.generate(prompt, 6)
    seq = list(prompt)
    for tok in new:
        logits = net(Tensor(np.asarray([seq], np.int32))).asnumpy()[0, -1]
        assert tok == int(np.argmax(logits))
        seq.append(tok)


def test_sampling_is_seeded_and_cache_independent(gen):
    prompt = ids(10, seed=4)
    kw = dict(temperature=1.0, top_k=50, top_p=0.95)
    a = gen.generate(prompt, 24, seed=3, **kw)
    assert a == gen.generate(prompt, 24, seed=3, **kw)
    assert a == gen.generate(prompt, 24, seed=3, use_cache=False, **kw)
    assert a != gen.generate(prompt, 24, seed=4, **kw)
    assert a != gen.generate(prompt, 24, seed=3)  # greedy differs from sampling at temperature 1


def test_stops_at_eos_stop_callback_budget_and_cache_size(gen, net):
    prompt = ids(8, seed=5)
    greedy = gen.generate(prompt, 12)
    eos = greedy[4]
    first = greedy.index(eos)
    assert gen.generate(prompt, 12, eos_id=eos) == greedy[: first + 1]  # EOS included, then stop
    assert gen.generate(prompt, 12, stop=lambda new: len(new) == 3) == greedy[:3]
    assert gen.generate(prompt, 5) == greedy[:5]
    s = net.config.max_seq_length  # 128: the sequence never grows past the cache
    long_prompt = ids(s - 4, seed=6)
    assert len(gen.generate(long_prompt, 50)) == 4
    assert gen.generate(long_prompt, 50) == gen.generate(long_prompt, 50, use_cache=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        gen.generate([], 3)


def test_fast_decoder_keeps_parameter_names_and_follows_weight_changes():
    """Generator's batch-1 decoder reads the net's own Parameters: their names stay unprefixed (checkpoints
    keep loading) and a weight change after the first generation reaches the next one."""
    model = LlamaForCausalLM(ModelConfig.from_name("tiny", init_std=0.3), seed=1)
    model.set_train(False)
    names = [p.name for p in model.get_parameters()]
    g = Generator(model)
    assert g._decoder is not None  # fp32, plain projections: the fast path is the one under test
    assert g.decode_path == ("fused" if build_decode_kernel() else "decoder")
    prompt = ids(6, seed=7)
    before = g.generate(prompt, 10)
    assert [p.name for p in model.get_parameters()] == names
    w = model.layers[0].mlp.up_proj.weight
    ms.ops.assign(w, Tensor(w.asnumpy() * -3.0))  # in place, as optimizers update (set_data would swap the
    # tensor, and graphs compiled before keep the old one: true of every jit path, cached or not)
    after = g.generate(prompt, 10)
    assert after == g.generate(prompt, 10, use_cache=False)
    assert after != before


needs_kernel = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None or bool(decode_disabled_reason()),
    reason="no C++ compiler (or MSLLM_FUSED_DECODE/MSLLM_FUSED_KERNELS=0)",
)


@needs_kernel
def test_the_decode_step_builds_where_a_compiler_exists():
    assert build_decode_kernel() is not None, f"a compiler exists but the fused decode step is {decode_kernel_path()}"
    assert decode_kernel_path() in ("avx512", "avx2", "neon", "scalar")


@needs_kernel
@pytest.mark.parametrize(
    "shape",
    [
        dict(init_std=0.3),  # tiny: untied head, hd 16
        # the other shapes compile the same graphs again (~11 s each): integration tier
        pytest.param(dict(init_std=0.3, tie_embeddings=True), marks=pytest.mark.integration),  # tied head
        pytest.param(
            dict(init_std=0.3, hidden_size=48, num_heads=4, num_kv_heads=1, intermediate_size=100),
            marks=pytest.mark.integration,
        ),  # hd 12: scalar tails
    ],
)
def test_fused_decode_step_matches_the_decoder_and_the_full_forward(shape):
    """The one-op decode step and prompt chunk (model/decode_kernel.cc), on one thread and on more threads than
    cores: logits of every step equal the plain forward's, and its greedy tokens equal the MindSpore-kernel
    decoder's and the uncached path's."""
    model = LlamaForCausalLM(ModelConfig.from_name("tiny", **shape), seed=2)
    model.set_train(False)
    plain = Generator(model, fused=False)
    assert plain.decode_path == "decoder"
    prompt = ids(13, seed=11)
    new = plain.generate(prompt, 30)
    assert plain.generate(prompt, 30, use_cache=False) == new
    full = model(Tensor(np.asarray([prompt + new], np.int32))).asnumpy()[0]
    for threads, chunk in ((1, 64), (3, 5)):  # chunk 5: PrefillStep's partial token tiles and overlapping chunks
        fused = Generator(model, threads=threads, prefill_chunk=chunk)
        assert fused.decode_path == "fused" and fused._fused_prefill is not None
        assert fused.generate(prompt, 30) == new, threads
        steps = fused._cached_steps(prompt)
        got = [next(steps)] + [steps.send(t) for t in new[:-1]]
        steps.close()
        tol = logit_tol(model.config, len(full), np.abs(full).max())
        np.testing.assert_allclose(
            np.stack(got), full[len(prompt) - 1 : -1], rtol=0, atol=tol, err_msg=f"threads={threads}, chunk={chunk}"
        )


@pytest.mark.integration  # ~5 s: a chunk graph compiled without the kernel (unit tier under 2 minutes)
def test_without_a_compiler_generation_falls_back_to_the_decoder(net, monkeypatch, caplog):
    """The path is chosen when the Generator is built, with its reason, in the log and on the object."""
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    assert build_decode_kernel() is None
    with caplog.at_level("INFO", logger="msllm.generate"):
        g = Generator(net)
    assert g.decode_path == "decoder" and g.decode_reason.startswith("the fused decode kernel is off: ")
    assert f"[generate] decode path: decoder: {g.decode_reason}" in caplog.text
    prompt = ids(7, seed=12)
    assert g.generate(prompt, 12) == g.generate(prompt, 12, use_cache=False)
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("MSLLM_FUSED_DECODE", "0")
    g = Generator(net)
    assert g.decode_path == "decoder" and g.decode_reason == "the fused decode kernel is off: MSLLM_FUSED_DECODE=0"
    assert Generator(net, fused=False).decode_reason == "the fused decode kernel is off: eval.fused_kernels is false"


def test_the_fused_steps_run_on_the_calling_thread():
    """The whole-model steps are called through ctypes on the caller's thread, the caller its pool's thread 0: not
    as a MindSpore op, which ran on MindSpore's actor thread while the caller slept until its result, and each
    wake-up then waited behind any other process holding that core (docs/KERNELS.md). With one kernel thread the
    calling thread's CPU time is the process's (as an op it was a few percent of it)."""
    cfg = ModelConfig.from_name(
        "tiny", vocab_size=4096, hidden_size=256, intermediate_size=688, num_layers=4, max_seq_length=128
    )
    model = LlamaForCausalLM(cfg, seed=0)
    model.set_train(False)
    g = Generator(model, threads=1)
    if g.decode_path != "fused":
        pytest.skip(f"no fused decode step here: {g.decode_reason}")
    seq = ids(128, seed=2)
    g.score(seq)  # the caches' pages, the heap
    thread, process = time.thread_time(), time.process_time()
    for _ in range(3):
        g.score(seq)  # ScoreStep: 2 chunks of 64 tokens, ~0.5 GFLOP each
        g.generate(seq[:9], 16)  # PrefillStep, then DecodeStep per token
    thread, process = time.thread_time() - thread, time.process_time() - process
    assert thread >= 0.5 * process, (thread, process)


def _other_threads_cpu_s() -> float:
    """CPU seconds of every thread of this process but the calling one (/proc/self/task/*/schedstat)."""
    me, total = str(threading.get_native_id()), 0
    for task in os.listdir("/proc/self/task"):
        if task != me:
            try:
                with open(f"/proc/self/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:  # a thread that ended meanwhile
                pass
    return total / 1e9


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads threads' CPU time from Linux's /proc")
def test_the_kernel_threads_sleep_when_a_sequence_ends():
    """The fused steps' pool threads wait for the next call spinning up to 10 ms (MSLLM_SPIN_US: longer than a
    scheduler tick, so a busy partner keeps its core beside a niced process), but when a sequence ends (generate,
    score, a BatchDecoder's last slot released) they are parked: they sleep at once. Spinning on after it, the
    scheduler then made up for that CPU time to a niced process during the next sequence: 25-45% slower
    (docs/KERNELS.md, "Decoding"). The eval scorer scores its rows back to back (`score(..., park=False)`) and parks
    after the last. Bound: in the 50 ms after, the other threads use less than a fifth of the spin
    that parking cuts short (unparked they take the spin's whole 10 ms where the core is free)."""
    from tasks.stages.evaluate.lm_adapter import StepScorer

    model = LlamaForCausalLM(ModelConfig.from_name("tiny"), seed=0)
    model.set_train(False)
    g = Generator(model, threads=2)
    if g.decode_path != "fused":
        pytest.skip(f"no fused decode step here: {g.decode_reason}")
    seq = ids(40, seed=4)
    batch = g.batch(2)

    def batched():
        slots = [batch.acquire(), batch.acquire()]
        batch.prefill_many(slots, [seq[:5], seq[:7]])
        batch.decode(slots, [5, 7], [1, 2])
        for slot in slots:
            batch.release(slot)

    scorer = StepScorer(g)  # the eval scorer of fp16 / q8_0 weights: its rows back to back, parked after the last
    runs = {
        "generate": lambda: g.generate(seq[:9], 8),
        "score": lambda: g.score(seq),
        "batch": batched,
        "eval scorer": lambda: scorer.score([(seq, seq)] * 3),
    }
    for name, run in runs.items():
        run()  # warm: the pool's threads started, pages touched
        spent = []
        for _ in range(3):  # the least of three: a thread of MindSpore's waking meanwhile is not the pool's spin
            run()
            before = _other_threads_cpu_s()
            time.sleep(0.05)
            spent.append(_other_threads_cpu_s() - before)
        assert min(spent) < 0.2 * 0.010, (name, spent)


def test_a_weight_set_to_new_data_between_sequences_is_read_where_it_now_is():
    """The fused steps take their operands' addresses when a sequence starts: a Parameter given new memory between
    two sequences (`set_data`, as a reload does) is read there by the next one, as a Generator built afresh reads it."""
    model = LlamaForCausalLM(ModelConfig.from_name("tiny", init_std=0.3), seed=6)
    model.set_train(False)
    g = Generator(model)
    if g.decode_path != "fused":
        pytest.skip(f"no fused decode step here: {g.decode_reason}")
    prompt = ids(7, seed=3)
    before = g.generate(prompt, 10)
    w = model.layers[0].mlp.down_proj.weight
    at = w.data_ptr()
    w.set_data(Tensor.from_numpy(np.random.default_rng(1).normal(0, 0.3, w.shape).astype(np.float32)))
    assert w.data_ptr() != at  # new memory (the old may be freed: reading it would be a bug, not just stale)
    after = g.generate(prompt, 10)
    assert after == Generator(model).generate(prompt, 10) and after != before


def test_a_fused_step_that_fails_mid_sequence_is_an_error_not_a_slower_path(net):
    """The fused decode op raising in the middle of a sequence (it failed to load or run) stops that sequence with
    a DecodeError naming the path, the position and how to choose another; the Generator keeps its path (no silent
    switch to the decoder: the speed a user measured is the speed they get)."""
    from model.fused_decode import DecodeError

    g = Generator(net)
    if g.decode_path != "fused":
        pytest.skip(f"no fused decode step here: {g.decode_reason}")
    assert "model/decode_kernel.cc" in g.decode_reason
    calls = []
    step = g._fused

    def failing(n, ptrs, *rest):  # the kernel's entry point, as ctypes calls it: it returns a code
        calls.append(ctypes.cast(ptrs[1], ctypes.POINTER(ctypes.c_int32))[0])  # operand 1: the position
        return 3

    step._fn = failing
    prompt = ids(7, seed=12)
    with pytest.raises(
        DecodeError,
        match=r"the fused decode step failed at position 7 \(the fused decode kernel .*"
        r"fused kernel DecodeStep returned 3: an operand's shape; MSLLM_FUSED_DECODE=0",
    ):
        g.generate(prompt, 4)
    assert calls == [7] and g._fused is step and g.decode_path == "fused"


@pytest.mark.integration  # ~9 s: a LoRA net's decoder and fused step compiled
def test_a_lora_net_decodes_on_the_decoder_and_takes_the_fused_step_only_for_base_only_sequences():
    """Unmerged LoRA layers: the decoder (it calls the projection Cells) applies B·A, so tokens equal the uncached
    forward's; the fused step reads only the base weights, so it runs a sequence only with `base_only=True` (the
    server's base requests, whose LoRA updates are zero), where it gives the plain base model's tokens."""
    from model.lora import LoRASlots

    model = LlamaForCausalLM(ModelConfig.from_name("tiny", init_std=0.3), seed=4)
    model.set_train(False)
    plain = Generator(model)
    prompt = ids(9, seed=13)
    base_tokens = plain.generate(prompt, 12)
    rng = np.random.default_rng(0)
    adapter = {}
    for p in model.get_parameters():
        if p.name.endswith(("q_proj.weight", "v_proj.weight")):
            out_f, in_f = p.shape
            adapter[p.name[:-6] + "lora_A"] = rng.normal(0, in_f**-0.5, (4, in_f)).astype(np.float32)
            adapter[p.name[:-6] + "lora_B"] = rng.normal(0, 1.0, (out_f, 4)).astype(np.float32)
    slots = LoRASlots(model, {"a": (adapter, 2.0)})
    g = Generator(model)
    slots.use("a")
    assert g._decoder is not None and g.decode_path == "decoder"
    new = g.generate(prompt, 12)
    assert new == g.generate(prompt, 12, use_cache=False) and new != base_tokens
    if g._fused is not None:
        calls = []
        kernel = g._fused._fn
        g._fused._fn = lambda *a: calls.append(1) or kernel(*a)
        slots.use(None)
        steps = g._cached_steps(prompt, base_only=True)
        got = [int(np.argmax(next(steps)))]
        while len(got) < 12:
            got.append(int(np.argmax(steps.send(got[-1]))))
        steps.close()
        assert got == base_tokens and len(calls) == 11
        slots.use("a")
        assert g.generate(prompt, 12) == new and len(calls) == 11  # not base_only: never the fused step


def test_interleaved_sequences_keep_their_own_caches(gen):
    """The server decodes several sequences in turn on one Generator: each must see only its own cache."""
    prompts = [ids(5, seed=8), ids(11, seed=9), ids(3, seed=10)]
    alone = [gen.generate(p, 8) for p in prompts]
    coros = [gen._cached_steps(p) for p in prompts]
    logits = [next(c) for c in coros]
    got = [[] for _ in prompts]
    for _ in range(8):
        for i, c in enumerate(coros):
            got[i].append(int(np.argmax(logits[i])))
            logits[i] = c.send(got[i][-1])
    for c in coros:
        c.close()
    assert got == alone
    assert not gen._decoder_busy  # released: the next generation takes the fast path again


def test_sample_next_temperature_top_k_top_p():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert sample_next(logits, 0.0) == 0
    assert all(sample_next(logits, 1.0, top_k=1, rng=rng) == 0 for _ in range(20))
    assert all(sample_next(logits, 1.0, top_p=0.4, rng=rng) == 0 for _ in range(20))  # 0.5 alone reaches 0.4
    draws = np.array([sample_next(logits, 1.0, top_p=0.75, rng=rng) for _ in range(4000)])
    assert set(draws) == {0, 1}  # 0.5 + 0.3 >= 0.75: the nucleus is the first two
    assert abs((draws == 0).mean() - 0.5 / 0.8) < 0.03
    draws = np.array([sample_next(logits, 1.0, top_k=3, rng=rng) for _ in range(4000)])
    assert set(draws) == {0, 1, 2}
    assert abs((draws == 2).mean() - 0.15 / 0.95) < 0.03
    hot = np.array([sample_next(logits, 100.0, rng=rng) for _ in range(4000)])  # high temperature: ~uniform
    assert abs((hot == 3).mean() - 0.25) < 0.04


@pytest.mark.slow  # ~13 s: the bench's every path and HF's process; keeps unit + integration under 10 minutes
def test_generate_benchmark_smoke():
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench" / "generate.py"
    out = subprocess.run(
        [sys.executable, str(script), "--preset", "tiny", "--new-tokens", "8", "--requests", "8", "--results", ""],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for k in ("tokens_per_s", "uncached_tokens_per_s", "kv_speedup", "eval_requests_per_s"):
        assert res[k] > 0, k
    assert res["same_tokens"] is True
    assert (
        res["decode_path"] == ("fused" if build_decode_kernel() else "decoder") and res["decode_reason"]
    )  # logged, chosen once
    if res["decode_path"] == "fused":  # the fused step on binary16 matrices, timed beside it
        assert res["fp16_tokens_per_s"] > 0 and 0 <= res["fp16_same_tokens_prefix"] <= 8
        assert 0 < res["fp16_fraction_of_bandwidth_limit"] <= 1
    # peak RSS beside the tokens/s: ours holds at least the fp32 weights a token reads; HF's process its own copy
    assert res["peak_rss_gb"] * 1e9 >= res["weight_mb_per_token"] * 1e6 and "cached" in res["peak_rss_scope"]
    if "hf_tokens_per_s" in res:
        assert res["hf_peak_rss_gb"] * 1e9 >= res["weight_mb_per_token"] * 1e6


@pytest.mark.integration
def test_memory_benchmark_smoke():
    """scripts/bench/memory.py runs both sides (ours and HF generate) over a prompt ladder and random-length
    requests, and reports each side's peaks against the weights + KV + 1 GiB budget it derives."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench" / "memory.py"
    out = subprocess.run(
        [sys.executable, str(script), "--preset", "tiny", "--context", "128", "--requests", "10", "--results", ""],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    cfg = ModelConfig.from_name("tiny")
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * 128 * (cfg.hidden_size // cfg.num_heads) * 4 / 1e9
    assert res["kv_cache_gb"] == round(kv, 3)
    for side in ("ours", "hf"):
        r = res[side]
        assert "error" not in r, r
        assert [x["prompt_tokens"] for x in r["ladder"]] == [16, 64, 128 - 8]
        assert r["requests"] == 10 and 0 < r["loaded_rss_gb"] <= r["peak_rss_gb"]
    assert res["ours"]["decode_path"] == ("fused" if build_decode_kernel() else "decoder")
    assert res["within_budget"] == (res["peak_rss_gb"] <= res["budget_gb"])


@pytest.mark.slow  # ~12 s: a server per side; keeps unit + integration under 10 minutes
def test_serve_memory_benchmark_smoke(tmp_path):
    """scripts/bench/serve_memory.py serves one model artifact on both backends (real `msllm serve` processes) and
    HF generate beside them: each side's RSS after the ladder and the requests, the budget from the served context."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import tiny_model_artifact

    model = tiny_model_artifact(tmp_path)
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench" / "serve_memory.py"
    out = subprocess.run(
        [
            sys.executable,
            str(script),
            "--model",
            str(model),
            "--longest",
            "100",
            "--new-tokens",
            "6",
            "--requests",
            "10",
            "--hf-requests",
            "5",
            "--results",
            "",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    cfg = ModelConfig.from_name("tiny")
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.max_seq_length * cfg.head_dim * 4 / 1e9
    assert res["context"] == cfg.max_seq_length and res["kv_cache_gb"] == round(kv, 3)
    assert res["budget_gb"] == round(res["weights_gb"] + round(kv, 3) + 2**30 / 1e9, 3)
    for side, n in (("mindspore", 10), ("onnxruntime", 10), ("hf", 5)):
        r = res[side]
        assert [x["prompt_tokens"] for x in r["ladder"]] == [16, 64, 100], side
        assert r["requests"] == n and 0 < r["loaded_rss_gb"] <= r["peak_rss_gb"], side
        assert all(0 < x["tokens"] <= 6 for x in r["ladder"]), side
    for side in ("mindspore", "onnxruntime"):
        r = res[side]
        assert r["within_budget"] == (r["peak_rss_gb"] <= res["budget_gb"])
        assert r["rss_vs_hf"] == round(r["peak_rss_gb"] / res["hf"]["peak_rss_gb"], 2)
        assert 0 <= r["same_text"] <= r["of"] == 3
