"""Finetune stage (tasks/stages/finetune/): response-only labels, resumable batches, the stage, merge, the CLI."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from tasks.config.loader import resolve_pipeline
from tasks.config.schema import ConfigError
from tasks.modeling.merge import base_of, merge
from tasks.prompts import encode_segments, prompt_ids, to_segments
from tasks.runtime.supervise import StageFailed
from tasks.stages.finetune.data import (
    IGNORE,
    Examples,
    example_batches,
    instruction_examples,
    pack_example,
    text_examples,
)
from tasks.store.artifacts import ArtifactStore
from tasks.store.errors import ArtifactError
from tests.helpers import decoder_reduction, fp32_tol, run_stage, tiny_model_artifact

REPO = Path(__file__).resolve().parent.parent
COLOURS = ["red", "green", "blue", "white"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny random base model artifact (real SentencePiece tokenizer) and a toy instruction file."""
    root = tmp_path_factory.mktemp("ft_root")
    base = tiny_model_artifact(root)
    data = root / "toy.jsonl"
    # response = a colour chosen by the first word of the prompt: learnable from the prompt
    rows = [{"prompt": f"{'abcd'[i % 4]}: the colour of cloak {i}?", "response": COLOURS[i % 4]} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, base, data


@pytest.fixture(scope="module")
def sp(env):
    from tasks.store.model_artifact import load_tokenizer

    return load_tokenizer(env[1])


def _cfg(data: Path, *overrides: str):
    base = [
        f"finetune.sources=[{data}]",
        "finetune.train.loop.max_steps=12",
        "finetune.train.loop.micro_batch_size=4",
        "finetune.seq_length=64",
        "finetune.train.optimizer.lr=1.0e-2",
        "finetune.train.schedule.warmup_steps=2",
        "finetune.train.loop.log_steps=1",
        "finetune.train.loop.eval_steps=6",
        "finetune.train.loop.eval_batches=2",
        "finetune.train.loop.save_steps=6",
        "finetune.validation_fraction=0.2",
        "finetune.lora.rank=4",
        # a random tiny model's lm_head caps its logits, so the toy task adapts it too (a regex)
        "finetune.lora.target_modules=q_proj|v_proj|lm_head",
        "pretrain.train.loop.peak_flops=1.0e+11",
    ]
    return resolve_pipeline(REPO / "pipelines.yaml", "tiny", [*base, *overrides])


# ----------------------------------------------------------------------------- data


def test_loss_is_masked_to_the_response_on_a_crafted_example(sp):
    import mindspore as ms

    from model.llama import causal_lm_loss

    eos, pad, T = sp.eos_id(), sp.pad_id(), 48
    tokens, trained, short = encode_segments(
        sp, to_segments({"prompt": "Who loves Juliet?", "response": "Romeo"}, "x"), eos
    )
    p = prompt_ids(sp, "Who loves Juliet?")  # what generation feeds the model
    r = sp.encode("Romeo") + [eos]  # the response, closed by EOS
    assert tokens == p + r and trained == [False] * len(p) + [True] * len(r) and not short
    assert sp.decode(p).startswith("### Instruction:") and sp.decode(p).rstrip().endswith("### Response:")

    ids, labels, cut = pack_example(tokens, trained, T, pad)
    n = len(tokens) - 1
    assert not cut and ids[:n].tolist() == tokens[:-1] and (ids[n:] == pad).all()
    # position t predicts token t+1: only positions whose next token is the response carry a label
    assert labels.tolist() == [IGNORE] * (len(p) - 1) + r + [IGNORE] * (T - n)
    assert sp.decode([t for t in labels.tolist() if t not in (IGNORE, eos)]) == "Romeo"

    # and the loss is the mean cross-entropy over exactly those positions
    logits = np.random.default_rng(0).standard_normal((1, T, sp.get_piece_size())).astype(np.float32)
    got = float(causal_lm_loss(ms.Tensor(logits), ms.Tensor(labels[None])).asnumpy())
    lp = logits[0] - logits[0].max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    pos = np.arange(len(p) - 1, len(p) - 1 + len(r))
    want = float(-lp[pos, r].mean())  # numpy's float32 sums against MindSpore's: the vocabulary, then the mean
    assert abs(got - want) <= fp32_tol(abs(want) + np.abs(logits).max(), logits.shape[-1] + len(r))


def test_chat_messages_train_on_every_assistant_turn_only(sp):
    eos = sp.eos_id()
    rec = {
        "messages": [
            {"role": "system", "content": "Speak like a king."},
            {"role": "user", "content": "Hail"},
            {"role": "assistant", "content": "Good morrow"},
            {"role": "user", "content": "Farewell"},
            {"role": "assistant", "content": "Adieu"},
        ]
    }
    tokens, trained, _ = encode_segments(sp, to_segments(rec, "x"), eos)
    ids, labels, _ = pack_example(tokens, trained, 160, sp.pad_id())
    answers, cur = [], []
    for t in labels.tolist():
        if t == eos:
            answers, cur = answers + [sp.decode(cur)], []
        elif t != IGNORE:
            cur.append(t)
    assert answers == ["Good morrow", "Adieu"] and not cur
    assert (labels == eos).sum() == 2  # each answer closed by a trained EOS
    with pytest.raises(ValueError, match=r"x: messages\[0\].role"):
        to_segments({"messages": [{"role": "bard", "content": "hi"}]}, "x")
    with pytest.raises(ValueError, match="'prompt' and 'response'"):
        to_segments({"instruction": "a", "output": "b"}, "x")


def test_long_examples_lose_prompt_tokens_first_and_keep_the_response(sp, tmp_path):
    f = tmp_path / "long.jsonl"
    long_prompt = " ".join(["the king is dead, long live the king"] * 30)
    rows = [
        {"prompt": long_prompt, "response": "Hamlet"},
        {"prompt": "short", "response": "Lear"},
        {"prompt": "x", "response": " ".join(["very long answer"] * 40)},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ex, stats = instruction_examples([f], sp, 40, sp.eos_id(), sp.pad_id())
    assert stats["examples"] == 3 and stats["shortened_prompts"] == 2 and stats["truncated_responses"] == 1
    assert sp.decode([t for t in ex.labels[0].tolist() if t not in (IGNORE, sp.eos_id())]) == "Hamlet"
    assert (ex.labels[0] != IGNORE).sum() == len(sp.encode("Hamlet")) + 1 and (ex.ids[0] != sp.pad_id()).all()
    assert ex.labels[2][-1] != IGNORE and ex.labels[2][-1] != sp.eos_id()  # the response runs past the end
    with pytest.raises(ValueError, match="dropped 3"):  # not even the template fits
        instruction_examples([f], sp, 4, sp.eos_id(), sp.pad_id())


def test_batches_resume_at_any_sample_and_reshuffle_each_epoch():
    ex = Examples(
        np.arange(10, dtype=np.int32)[:, None].repeat(3, 1), np.arange(10, dtype=np.int32)[:, None].repeat(3, 1)
    )
    full = list(islice(example_batches(ex, 4, seed=7), 6))  # 24 samples: 2.4 epochs
    resumed = list(islice(example_batches(ex, 4, seed=7, start_sample=8), 4))
    for (a, b), (c, d) in zip(full[2:], resumed):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)
    order = np.concatenate([b[:, 0] for b, _ in full])
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:20]) == list(range(10))
    assert order[:10].tolist() != order[10:20].tolist()
    valid = list(example_batches(ex, 4, seed=7, repeat=False, shuffle=False, pad_id=0))
    assert [v[0].shape for v in valid] == [(4, 3)] * 3 and valid[0][0][:, 0].tolist() == [0, 1, 2, 3]
    assert (valid[2][1][2:] == IGNORE).all() and valid[2][0][:2, 0].tolist() == [8, 9]


def test_text_mode_cuts_the_eos_joined_stream_into_fully_trained_blocks(sp, tmp_path):
    (tmp_path / "a.txt").write_text("To be, or not to be, that is the question. " * 20)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "Whether 'tis nobler in the mind to suffer"}) + "\n")
    ex, stats = text_examples([tmp_path / "a.txt", tmp_path / "b.jsonl"], sp, 16, sp.eos_id(), "text")
    assert stats["documents"] == 2 and stats["examples"] == stats["tokens"] // 17
    np.testing.assert_array_equal(ex.labels[:, :-1], ex.ids[:, 1:])  # labels = the next token, nothing masked
    assert (ex.labels != IGNORE).all()


def test_config_errors_name_the_yaml_path(env):
    root, base, data = env
    store = ArtifactStore(root)
    with pytest.raises(ConfigError, match=r"finetune\.seq_length: 4096 exceeds the base model's max_seq_length=128"):
        run_stage("finetune", _cfg(data, "finetune.seq_length=4096"), store, base, isolate=False)
    with pytest.raises(ConfigError, match=r"finetune\.sources: empty"):
        run_stage("finetune", _cfg(data, "finetune.sources=[]"), store, base, isolate=False)
    with pytest.raises(ConfigError, match=r"finetune\.sources\[0\]: .*plain text"):
        run_stage(
            "finetune",
            _cfg(data, f"finetune.sources=[{REPO / 'data/corpora/tinyshakespeare.txt'}]"),
            store,
            base,
            isolate=False,
        )
    with pytest.raises(ConfigError, match=r"finetune\.train\.schedule\.warmup_steps: 20 > max_steps=12"):
        _cfg(data, "finetune.train.schedule.warmup_steps=20")  # now at load, like every train section's rules


# ----------------------------------------------------------------------------- the stage


def test_stage_trains_a_small_adapter_that_names_its_base_and_merges_exactly(env):
    from model.lora import inject_lora
    from tasks.modeling.build import load_network
    from tasks.store.tensors import assign as _assign

    root, base, data = env
    store = ArtifactStore(root)
    base_manifest = store.verify(base)
    cfg = _cfg(data)
    path = run_stage("finetune", cfg, store, base, isolate=False, progress=False)

    assert {f.name for f in path.iterdir()} == {
        "adapter.safetensors",
        "adapter.json",
        "metrics.jsonl",
        "loss_curve.png",
        "manifest.json",
    }
    m = store.read_manifest(path)
    met, ad = m["metrics"], json.loads((path / "adapter.json").read_text())
    from model.kernel_build import kernel_path

    assert met["native_kernels"] == kernel_path()
    assert ad["base"] == {
        "stage": "pretrain",
        "key": base_manifest["key"],
        "digest": base_manifest["digest"],
        "path": str(base),
    }
    assert ad["method"] == "lora" and ad["scaling"] == 16.0 / 4 and len(ad["modules"]) == 2 * 2 + 1
    assert {i.get("digest") or i.get("sha256") for i in m["inputs"]} >= {base_manifest["digest"]}
    assert any(i.get("kind") == "file" and i["path"] == str(data.resolve()) for i in m["inputs"])
    assert met["adapter_bytes"] < 0.1 * (base / "model.safetensors").stat().st_size  # small: adapter only
    assert met["trainable_params"] == 2 * 4 * ((64 + 64) + (64 + 32)) + 4 * (64 + 512)  # q, v per layer; lm_head
    assert 0 < met["trainable_share"] < 0.05 and met["loss_on"] == "response tokens"
    assert met["val_loss"] < met["initial_val_loss"] - 0.5, met  # the response-only loss fell
    assert met["final_train_loss"] < met["first_loss"]
    store.verify(base)  # the base artifact is untouched

    assert run_stage("finetune", cfg, store, base, isolate=False) == path  # cache hit, no training

    merged = merge(store, path)
    assert merge(store, path) == merged  # cached; merging twice gives the same artifact
    assert store.read_manifest(merged)["stage"] == "merged"
    assert (merged / "tokenizer.model").read_bytes() == (base / "tokenizer.model").read_bytes()
    net_m, info = load_network(merged)
    assert info["merged_from"]["base"] == base_manifest["key"]

    import mindspore as ms
    from safetensors.numpy import load_file

    net_b, _ = load_network(base)  # base + the adapter, unmerged, as the stage trained it
    inject_lora(net_b, ad["target_modules"], ad["rank"], ad["alpha"])
    _assign(
        [p for p in net_b.get_parameters() if "lora_" in p.name],
        load_file(str(path / "adapter.safetensors")),
        "adapter",
    )
    ids = ms.Tensor(np.random.default_rng(0).integers(0, 512, (2, 20)).astype(np.int32))
    want = net_b(ids).asnumpy()  # merged W + s·B·A against W x + s·B(A x): float32 sums in another order
    tol = fp32_tol(np.abs(want).max(), decoder_reduction(net_b.config, 20) + ad["rank"])
    np.testing.assert_allclose(net_m(ids).asnumpy(), want, atol=tol, rtol=0)


def test_lora_one_layer_at_a_time_trains_the_same_adapter(env, capfd):
    """`finetune.train.layerwise: true` with LoRA on q and v: the stage runs the layer-at-a-time step (the log says
    so; the adapters' gradients written out, base and head frozen) and logs the whole-model step's losses for its
    first three steps to fp32 rounding. B starts at 0, so step 1's loss is the base model's and its update moves only
    B (d A = s (dy B)^T x = 0); steps 2 and 3 run through the updated adapters, so a wrong d B or d A (or scale)
    moves them by ~lr x their gradient. fp32 rounding changes an AdamW update (~lr x sign(g)) only where |g| is
    itself at rounding level, which moves the loss by that g x lr: inside the same bound. (A constant factor on one
    gradient leaves AdamW's update as it was: tests/test_layerwise.py compares the gradient norms too.)"""
    from tasks.store.model_artifact import model_config

    root, base, data = env
    losses = {}
    for layerwise in (False, True):
        store = ArtifactStore(root)
        cfg = _cfg(
            data, "finetune.lora.target_modules=q_proj|v_proj", f"finetune.train.layerwise={str(layerwise).lower()}"
        )
        path = run_stage("finetune", cfg, store, base, isolate=False, progress=False)
        err = capfd.readouterr().err
        assert ("[train] step: layer at a time" in err) == layerwise, err[-2000:]
        rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
        losses[layerwise] = [(r["step"], r["loss"]) for r in rows if "loss" in r and "step" in r]
        assert (path / "adapter.safetensors").is_file()
    (whole, layer) = losses[False], losses[True]
    assert [s for s, _ in whole] == [s for s, _ in layer] and len(whole) >= 12
    cfg = model_config(base)
    n = decoder_reduction(cfg, 64) + cfg.vocab_size + 4 * 64  # the decoder, the log-softmax, the mean over tokens
    for (s, a), (_, b) in zip(whole[:3], layer[:3]):
        assert abs(a - b) <= fp32_tol(abs(a) + 1.0, n), (s, a, b)
    assert all(np.isfinite(v) for _, v in layer) and layer[-1][1] < layer[0][1]


def test_merge_refuses_a_base_that_changed(env, tmp_path):
    import shutil

    root, base, data = env
    store = ArtifactStore(root)
    path = run_stage("finetune", _cfg(data), store, base, isolate=False, progress=False)  # cached from the test above
    moved = store.root / "pretrain" / (base.name + "0")
    shutil.copytree(base, moved)
    ad = json.loads((path / "adapter.json").read_text())
    assert base_of(store, path) == base
    m = json.loads((moved / "manifest.json").read_text())
    m["digest"] = "0" * 64
    (moved / "manifest.json").write_text(json.dumps(m))
    # a finetune artifact whose recorded base is now a different artifact
    fake = tmp_path / "ft"
    fake.mkdir()
    (fake / "adapter.json").write_text(
        json.dumps({**ad, "base": {**ad["base"], "key": moved.name, "path": str(moved)}})
    )
    with pytest.raises(ArtifactError, match="has changed"):
        base_of(store, fake)
    shutil.rmtree(moved)
    with pytest.raises(ArtifactError, match="is gone"):
        base_of(store, fake)


@pytest.mark.slow
def test_resume_gives_identical_losses(env, tmp_path):
    root, base, data = env
    # with LoRA dropout on: its masks are a function of the input, so a resumed run replays them
    cfg = _cfg(
        data,
        "finetune.train.loop.max_steps=8",
        "finetune.train.loop.save_steps=4",
        "finetune.train.loop.eval_steps=4",
        "finetune.lora.dropout=0.1",
    )

    def losses(store_root: Path) -> list:
        rows = [
            json.loads(x)
            for x in next((store_root / "runs" / "finetune").iterdir())
            .joinpath("metrics.jsonl")
            .read_text()
            .splitlines()
        ]
        return [(r["step"], r.get("loss"), r.get("val_loss")) for r in rows]

    import shutil

    for d in ("a", "b"):
        (tmp_path / d / "pretrain").mkdir(parents=True)
        shutil.copytree(base, tmp_path / d / "pretrain" / base.name)
    a = run_stage(
        "finetune",
        cfg,
        ArtifactStore(tmp_path / "a"),
        tmp_path / "a/pretrain" / base.name,
        isolate=False,
        progress=False,
    )
    with pytest.raises(StageFailed, match="stop_after"):
        run_stage(
            "finetune",
            cfg,
            ArtifactStore(tmp_path / "b"),
            tmp_path / "b/pretrain" / base.name,
            isolate=False,
            progress=False,
            inject={"stop_after": 4},
        )
    b = run_stage(
        "finetune",
        cfg,
        ArtifactStore(tmp_path / "b"),
        tmp_path / "b/pretrain" / base.name,
        isolate=False,
        progress=False,
    )
    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # bit-identical per-step losses
    assert (a / "adapter.safetensors").read_bytes() == (b / "adapter.safetensors").read_bytes()


@pytest.mark.slow
def test_full_finetuning_on_plain_text_stores_and_merges_every_weight(env):
    from safetensors.numpy import load_file

    from tasks.store.tensors import load_weights

    root, base, _ = env
    store = ArtifactStore(root)
    text = REPO / "data/corpora/tinyshakespeare.txt"
    cfg = _cfg(
        text,
        "finetune.method=full",
        "finetune.format=text",
        "finetune.train.loop.max_steps=3",
        "finetune.train.optimizer.lr=1.0e-3",
        "finetune.validation_fraction=0.01",
    )
    path = run_stage("finetune", cfg, store, base, isolate=False, progress=False)
    met = store.read_manifest(path)["metrics"]
    assert met["trainable_share"] == 1.0 and met["method"] == "full" and met["loss_on"] == "all tokens"
    assert met["documents"] == 1 and met["val_loss"] < met["initial_val_loss"]
    trained, base_w = load_file(str(path / "adapter.safetensors")), load_weights(base)
    assert set(trained) == set(base_w) and any((trained[k] != base_w[k]).any() for k in trained)
    merged = load_weights(merge(store, path))
    for k in trained:
        np.testing.assert_array_equal(merged[k], trained[k])


def test_cli_runs_the_stage_in_a_child_and_prints_merged_then_finetune_path(env, capsys):
    from tasks.cli import main

    root, base, data = env
    overrides = [
        f"finetune.sources=[{data}]",
        "finetune.train.loop.max_steps=4",
        "finetune.train.loop.micro_batch_size=4",
        "finetune.seq_length=64",
        "finetune.train.schedule.warmup_steps=1",
        "finetune.train.loop.log_steps=2",
        "finetune.train.loop.eval_steps=4",
        "finetune.train.loop.eval_batches=1",
        "pretrain.train.loop.peak_flops=1.0e+11",
        "finetune.seed=3",
    ]
    argv = [
        "finetune",
        "--config",
        str(REPO / "pipelines.yaml"),
        "--pipeline",
        "tiny",
        "--artifacts",
        str(root),
        "--from",
        str(base),
    ] + [a for o in overrides for a in ("--set", o)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    ft_path, merged_path = Path(lines[-1]), Path(lines[-2])
    store = ArtifactStore(root)
    assert store.read_manifest(ft_path)["stage"] == "finetune" and store.read_manifest(merged_path)["stage"] == "merged"
    assert lines[-3].startswith("# finetune artifact")
    assert main(argv) == 0  # second time: cached, same paths
    assert capsys.readouterr().out.strip().splitlines()[-2:] == lines[-2:]
