"""Export stage (tasks/stages/export.py): MindIR + the KV-cache ONNX decoder + onnxruntime-genai files (+ int8),
verified.

One real export (child process, as the CLI runs it) of a tiny random model is shared by most
tests. The model artifact descends from a real `tiny` data artifact, so its tokenizer is the
data stage's and the int8 perplexity runs on held-out blocks. Each test re-checks one promise
independently of the stage's own check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks.config.loader import resolve_pipeline
from tasks.config.schema import ConfigError
from tasks.deploy import checked
from tasks.deploy.checks import ExportCheckFailed
from tasks.deploy.formats import export_onnx
from tasks.deploy.model_card import model_card, read_eval
from tasks.runtime.supervise import StageFailed
from tasks.stages import export
from tasks.store.artifacts import ArtifactStore
from tasks.store.errors import ArtifactError
from tests.helpers import logit_tol, run_stage, tiny_model_artifact

REPO = Path(__file__).resolve().parent.parent
SETS = ["export.batch_size=2", "export.seq_length=24", "export.int8=true"]


def _cfg(*extra: str):
    return resolve_pipeline(REPO / "pipelines.yaml", "tiny", [*SETS, *extra])


def model_from_data(store: ArtifactStore, data: Path, seed: int = 0) -> Path:
    """A pretrain-type artifact (random `tiny` weights) whose input is `data` and whose tokenizer is data's."""
    from model.config import ModelConfig
    from model.llama import LlamaForCausalLM
    from tasks.store.model_artifact import load_tokenizer, tokenizer_info, write_model

    mc = ModelConfig.from_name("tiny")
    sp = load_tokenizer(data)
    net = LlamaForCausalLM(mc, seed=seed)
    with store.build(
        "pretrain", f"{seed:020d}", pipeline="test", config={"seed": seed}, inputs=[store.input_ref(data)], code="test"
    ) as b:
        write_model(
            b.dir,
            name="llama",
            config=mc,
            weights={p.name: p.asnumpy() for p in net.trainable_params()},
            tokenizer_model=data / "tokenizer.model",
            tokenizer_info=tokenizer_info(sp),
            seq_length=mc.max_seq_length,
        )
    return b.path


@pytest.fixture(scope="module")
def env(tmp_path_factory):

    root = tmp_path_factory.mktemp("export_root")
    store = ArtifactStore(root)
    model = model_from_data(store, run_stage("data", _cfg(), store, progress=False))
    path = run_stage("export", _cfg(), store, model, progress=False)
    return {"root": root, "store": store, "model": model, "path": path, "manifest": ArtifactStore.read_manifest(path)}


def test_verified_export_recorded_in_manifest(env):
    m, path = env["manifest"], env["path"]
    v = m["verification"]
    # the stage's own bound (export.atol, recorded as v["atol"]): it fails the stage above it, so what it recorded
    # stays within it
    assert v["mindir_max_abs_diff"] <= v["atol"] and v["onnx_max_abs_diff"] <= v["atol"]
    assert v["greedy_tokens_match"] is True and v["onnx_checker"] == "passed"
    assert v["prompts"] == _cfg().export.prompts and len(v["greedy"]) == len(v["prompts"])
    checks = v["onnx_checks"]  # (batch, sequence, past) combinations, each within atol
    combos = {(c["batch"] > 1, c["past"] > 0) for c in checks}
    assert len(checks) >= 4 and combos == {(False, False), (False, True), (True, False), (True, True)}
    assert all(c["max_abs_diff"] <= v["atol"] for c in checks) and v["onnx_kv_steps"] >= 8
    steps = [c for c in checks if "single-token steps" in c["check"]]
    assert steps[0]["sequence"] == 1 and steps[0]["past_last"] - steps[0]["past"] == 7
    assert v["shapes"]["mindir"]["exported"] == [None, None]
    checked = v["shapes"]["mindir"]["checked"]  # several batch sizes and lengths: dynamic both ways
    assert len({s[0] for s in checked}) > 1 and len({s[1] for s in checked}) > 1
    for k in ("mindir_max_abs_diff", "onnx_max_abs_diff", "greedy_tokens_match", "onnx_kv_steps"):
        assert m["metrics"][k] == v[k]
    assert json.loads((path / "export.json").read_text())["verification"] == v
    names = {f["path"] for f in m["files"]}
    assert {
        "model.mindir",
        "model.onnx",
        "model.int8.onnx",
        "genai_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "model.json",
        "MODEL_CARD.md",
        "onnx_generate.py",
        "sampling.py",
    } <= names
    assert (path / "tokenizer.model").read_bytes() == (env["model"] / "tokenizer.model").read_bytes()
    # how the model is asked travels with it: the model artifact's record, which the export's server reads
    assert (path / "prompt_style.json").read_bytes() == (env["model"] / "prompt_style.json").read_bytes()
    assert m["inputs"][0]["key"] == ArtifactStore.read_manifest(env["model"])["key"]
    env["store"].verify(path)  # every file matches its recorded sha256
    card = (path / "MODEL_CARD.md").read_text()
    for heading in (
        "## Model",
        "## Files",
        "## Verification",
        "## Lineage",
        "## Generate with onnxruntime only",
        "## Generate with onnxruntime-genai",
    ):
        assert heading in card
    assert "0.16M" in card and "## Evaluation" not in card and "single-token steps" in card


def test_genai_check_and_tokenizer_ids_in_manifest(env):
    m = env["manifest"]
    g = m["verification"]["genai"]
    assert g["greedy_tokens_match"] is True and m["metrics"]["genai_greedy_tokens_match"] is True
    assert g["tokenizer_ids_match"] is True and g["tokenizer_first_mismatch"] is None and g["text_prefix"] == ""
    assert g["tokenizer_texts"] > 10 and g["tokenizer_tokens"] > 500  # prompts, samples and held-out documents
    assert all(r["onnxruntime_genai"] == r["mindspore"] for r in m["verification"]["greedy"])
    cfg = json.loads((env["path"] / "genai_config.json").read_text())
    assert cfg["model"]["type"] == "llama" and cfg["model"]["decoder"]["filename"] == "model.onnx"
    assert cfg["model"]["eos_token_id"] == 2 and cfg["search"]["past_present_share_buffer"] is False


def test_genai_tokenizer_warning_names_the_tokenizer_json_the_model_has(tmp_path, capsys):
    """A tokenizer.json model (no SentencePiece anywhere) whose tokenizer onnxruntime-genai reads otherwise: genai
    skips tokenizer.json's normalizer (here a Lowercase one, as uncased models have). The export records the first
    mismatch and warns naming the model's tokenizer.json; the log and the card name it too."""
    from model.config import ModelConfig
    from model.llama import LlamaForCausalLM
    from tasks.store.model_artifact import write_model
    from tasks.tokenizer import load_tokenizer
    from tests.helpers import train_tiny_hf_tokenizer

    tok_dir = train_tiny_hf_tokenizer(tmp_path / "tok")
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    (tok_dir / "tokenizer.json").write_text(json.dumps(spec))
    tok, mc = load_tokenizer(tok_dir), ModelConfig.from_name("tiny")
    store = ArtifactStore(tmp_path / "art")
    with store.build("pretrain", "0" * 20, pipeline="test", config={}, inputs=[], code="test") as b:
        write_model(
            b.dir,
            name="llama",
            config=mc,
            tokenizer_model=tok_dir,
            tokenizer_info=tok.info(),
            weights={p.name: p.asnumpy() for p in LlamaForCausalLM(mc, seed=0).trainable_params()},
            seq_length=mc.max_seq_length,
        )
    path = run_stage(
        "export",
        _cfg("export.formats=[onnx]", "export.int8=false", "export.prompts=['ROMEO: Hello']"),
        store,
        b.path,
        isolate=False,
        progress=True,
    )
    err = capsys.readouterr().err
    g = ArtifactStore.read_manifest(path)["verification"]["genai"]
    first = g["tokenizer_first_mismatch"]
    assert g["tokenizer_ids_match"] is False and first["model"] != first["genai"], g
    assert first["model"] == tok.encode(first["text"])[:8]  # the model's own ids, where genai's differ
    (warning,) = [ln for ln in err.splitlines() if "warning:" in ln]
    assert "differs from the model's tokenizer.json (Hugging Face tokenizers)" in warning, warning
    assert str(first["model"]) in warning and str(first["genai"]) in warning, warning
    assert "SentencePiece" not in err, err
    card = (path / "MODEL_CARD.md").read_text()
    assert "| onnxruntime-genai's tokenizer ids == the model's tokenizer.json (Hugging Face tokenizers) | False" in card


def test_int8_variant_in_manifest(env):
    m = env["manifest"]
    q = m["verification"]["int8"]
    assert q["file"] == "model.int8.onnx" and q["bytes"] == (env["path"] / "model.int8.onnx").stat().st_size
    assert q["size_ratio"] < 0.6 and m["metrics"]["int8_size_ratio"] == q["size_ratio"]
    assert q["perplexity_source"].startswith("held-out: 8 valid blocks")  # the data artifact of the model's lineage
    assert 1 < q["fp32_perplexity"] and abs(q["perplexity_change_pct"]) < 5  # random weights: ppl near the vocab
    assert q["decode_tokens_per_s"] > 0 and q["fp32_decode_tokens_per_s"] > 0
    assert 0 < q["max_abs_diff"] < 0.1
    for k in ("perplexity", "fp32_perplexity", "perplexity_change_pct", "decode_tokens_per_s", "bytes"):
        assert m["metrics"][f"int8_{k}"] == q[k]


def test_onnx_io_names_and_dynamic_axes(env):
    import onnx

    m = onnx.load(str(env["path"] / "model.onnx"))
    onnx.checker.check_model(m, full_check=True)
    ins = {i.name: i for i in m.graph.input}
    assert list(ins)[:3] == ["input_ids", "attention_mask", "position_ids"] and len(ins) == 3 + 2 * 2
    assert ins["input_ids"].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert [d.dim_param for d in ins["input_ids"].type.tensor_type.shape.dim] == ["batch_size", "sequence_length"]
    assert [o.name for o in m.graph.output][:2] == ["logits", "present.0.key"]
    io = json.loads((env["path"] / "export.json").read_text())["onnx"]
    assert io["inputs"]["past_key_values.1.value"] == "float32 [batch, 2, past, 16]"


def test_mindir_reloads_with_dynamic_shape(env):
    import mindspore as ms

    from tasks.modeling.build import load_network

    net, _ = load_network(env["model"])
    graph = ms.nn.GraphCell(ms.load(str(env["path"] / "model.mindir")))
    for shape in [(3, 11), (1, 40)]:  # neither was checked by the stage
        x = np.random.default_rng(1).integers(0, 512, size=shape, dtype=np.int32)
        got, want = graph(ms.Tensor(x)).asnumpy(), net(ms.Tensor(x)).asnumpy()
        tol = logit_tol(net.config, shape[1], float(np.abs(want).max()))  # another graph of the same ops
        assert got.shape == (*shape, 512) and np.abs(got - want).max() <= tol


def test_onnxruntime_kv_generation_matches_mindspore(env):
    from model.generate import Generator
    from tasks.deploy.onnx_generate import OnnxGenerator, encode_prompt
    from tasks.modeling.build import load_network
    from tasks.store.model_artifact import load_tokenizer

    net, _ = load_network(env["model"])
    sp = load_tokenizer(env["model"])
    ms_gen, ort_gen = Generator(net), OnnxGenerator(env["path"] / "model.onnx")
    assert ort_gen.max_len == 128 and ort_gen.eos_id == sp.eos_id()
    for prompt in ["First Citizen:", "KING HENRY", "a"]:  # not the stage's prompts; a longer run than its check
        ids = encode_prompt(sp, prompt)
        want = ms_gen.generate(ids, 40, eos_id=sp.eos_id())
        assert ort_gen.generate(ids, 40, eos_id=sp.eos_id()) == want and len(want) > 8


def test_onnx_generation_needs_no_mindspore(env):
    """The README snippet (KV cache), tasks.deploy.onnx_generate and the artifact's copy of it, in a fresh
    interpreter."""
    from tasks.deploy.onnx_generate import SNIPPET

    code = f"""
import contextlib, io, json, runpy, sys
sys.path.insert(0, {str(REPO)!r})
ART = {str(env["path"])!r}
out = io.StringIO()
with contextlib.redirect_stdout(out):
    exec({SNIPPET!r}, {{"ART": ART}})
from tasks.deploy.onnx_generate import generate_text
completion = generate_text(ART, "ROMEO:", 64)
copy = runpy.run_path(ART + "/onnx_generate.py")["generate_text"](ART, "ROMEO:", 64)
print(json.dumps({{"snippet": out.getvalue(), "completion": completion, "copy": copy,
                  "mindspore": "mindspore" in sys.modules, "onnxruntime": "onnxruntime" in sys.modules}}))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["mindspore"] is False and r["onnxruntime"] is True
    assert r["snippet"] == "ROMEO:" + r["completion"] + "\n" and r["copy"] == r["completion"]
    assert len(r["completion"]) > 0


def test_onnx_generate_cli(env, capsys):
    from tasks.deploy import onnx_generate

    assert onnx_generate.main([str(env["path"]), "ROMEO:", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    assert onnx_generate.main([str(env["model"]), "x"]) == 2  # a model artifact, not an export
    assert "no model.onnx" in capsys.readouterr().err


def test_rerun_is_a_cache_hit_and_cli_prints_the_path(env, monkeypatch, capsys):
    from tasks import cli
    from tasks.runtime import supervise

    def no_child(*a, **k):
        raise AssertionError("a cached export must not start a child")

    monkeypatch.setattr(supervise, "run_child", no_child)
    assert run_stage("export", _cfg(), env["store"], env["model"]) == env["path"]
    rc = cli.main(
        [
            "export",
            "--config",
            str(REPO / "pipelines.yaml"),
            "--pipeline",
            "tiny",
            *[a for s in SETS for a in ("--set", s)],
            "--artifacts",
            str(env["root"]),
            "--from",
            str(env["model"]),
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and out[-1] == str(env["path"])
    assert "onnx_max_abs_diff" in out[-2] and "greedy_tokens_match=True" in out[-2]


def test_cli_without_a_model_artifact_says_what_to_run(tmp_path, capsys):
    from tasks import cli

    rc = cli.main(
        ["export", "--config", str(REPO / "pipelines.yaml"), "--pipeline", "tiny", "--artifacts", str(tmp_path)]
    )
    assert rc == 1 and "msllm train --pipeline tiny" in capsys.readouterr().err


def test_mismatching_onnx_fails_the_stage_and_leaves_no_artifact(env, monkeypatch):
    """The ONNX file is written from different weights: logits and greedy tokens must both be caught."""
    orig = export_onnx

    def other_weights(info, weights, path, *a, **k):
        return orig(info, {n: w + np.float32(0.05) for n, w in weights.items()}, path, *a, **k)

    monkeypatch.setattr(checked, "export_onnx", other_weights)  # the ONNX writer the export stage checks
    cfg = _cfg("export.max_new_tokens=4", "export.int8=false", "export.formats=[onnx]")  # another key
    key = export.stage_key(cfg, env["store"], env["model"])[0]
    with pytest.raises(ExportCheckFailed, match=r"ONNX max \|logit diff\| .* > export.atol 0.0001") as e:
        run_stage("export", cfg, env["store"], env["model"], isolate=False, progress=False)
    assert "greedy tokens differ" in str(e.value) and "onnxruntime_genai" in str(e.value)
    assert env["store"].lookup("export", key) is None
    assert not [p for p in (env["root"] / "export").iterdir() if p.name.startswith(".tmp")]  # no temp dir left


def test_failed_check_in_the_child_fails_the_stage(env):
    """A tolerance below the measured ONNX difference: the child's error reaches the caller first."""
    if env["manifest"]["verification"]["onnx_max_abs_diff"] == 0:
        pytest.skip("onnxruntime reproduced MindSpore exactly; nothing to fail on")
    cfg = _cfg("export.atol=1.0e-12", "export.formats=[onnx]", "export.max_new_tokens=1", "export.int8=false")
    key = export.stage_key(cfg, env["store"], env["model"])[0]
    with pytest.raises(StageFailed) as e:
        run_stage("export", cfg, env["store"], env["model"], progress=False)
    assert str(e.value).startswith("export verification failed: ONNX max |logit diff|")
    assert env["store"].lookup("export", key) is None


def test_settings_the_model_cannot_take_are_config_errors(env):
    short = tiny_model_artifact(env["root"], max_seq_length=32)  # the pipeline's own model would allow 64
    with pytest.raises(
        ConfigError, match=r"pipelines.tiny.export.seq_length: 64 exceeds the model's max_seq_length=32"
    ):
        run_stage("export", _cfg("export.seq_length=64"), env["store"], short)
    with pytest.raises(ConfigError, match=r"export.seq_length: 8; the ONNX checks need at least 13 positions"):
        run_stage("export", _cfg("export.seq_length=8"), env["store"], short)
    with pytest.raises(ConfigError, match=r"export.int8: true needs the onnx format"):
        run_stage("export", _cfg("export.formats=[mindir]"), env["store"], short)
    with pytest.raises(ConfigError, match=r"export.prompts"):
        _cfg("export.prompts=[]")


def test_finetune_artifact_is_merged_before_export(env):
    """A (full) finetune artifact resolves to its merged model; stage_key refuses the unmerged one."""
    from safetensors.numpy import save_file

    from tasks.store.tensors import load_weights

    store, base = env["store"], env["model"]
    with store.build(
        "finetune", "f" * 20, pipeline="test", config={}, inputs=[store.input_ref(base)], code="test"
    ) as b:
        (b.dir / "adapter.json").write_text(json.dumps({"method": "full", "base": store.input_ref(base)}))
        save_file(load_weights(base), str(b.dir / "adapter.safetensors"))
    merged = export.resolve_model(store, b.path)
    assert store.read_manifest(merged)["stage"] == "merged" and (merged / "model.json").is_file()
    with pytest.raises(ArtifactError, match="finetune artifact"):
        export.stage_key(_cfg(), store, b.path)
    with pytest.raises(ArtifactError, match="not a model"):
        export.resolve_model(store, env["path"])  # an export artifact is no model


def test_eval_results_reach_the_model_card(env, tmp_path):
    store, model = env["store"], env["model"]
    results = {
        "results": {
            "local_arc_easy": {
                "alias": "arc",
                "acc,none": 0.25,
                "acc_stderr,none": 0.04,
                "acc_norm,none": 0.3,
                "odd,none": "n/a",
            },
            "broken": 3,
        },
        "perplexity": {
            "held-out": {"tokens": 1000, "bytes": 4000, "perplexity": 12.5, "bits_per_byte": 0.9},
            "bad": None,
        },
    }
    with store.build("eval", "e" * 20, pipeline="test", config={}, inputs=[store.input_ref(model)], code="test") as b:
        (b.dir / "results.json").write_text(json.dumps(results))
    assert export.matching_eval(store, model) == b.path
    assert export.matching_eval(store, env["path"]) is None
    export._check_eval(store, b.path, model)
    with pytest.raises(ArtifactError, match="evaluated another model"):
        export._check_eval(store, b.path, env["path"])
    assert export.stage_key(_cfg(), store, model, b.path)[0] != env["manifest"]["key"]

    ver = env["manifest"]["verification"]
    lineage = {"text": "pretrain/abc", "raw": [{"path": "/data/corpus.txt", "size": 10, "sha256": "ab" * 32}]}
    card = model_card(
        info=json.loads((model / "model.json").read_text()),
        parameters=123,
        pipeline="tiny",
        model_ref=store.input_ref(model),
        verification=ver,
        lineage=lineage,
        evaluation=read_eval(b.path),
        artifact_path=env["path"],
    )
    assert "| held-out | 1000 | 12.5 | 0.9 |" in card
    assert "| local_arc_easy | acc | 0.25 | 0.04 |" in card and "| local_arc_easy | acc_norm | 0.3 | – |" in card
    assert "| /data/corpus.txt | 10 | `" + "ab" * 32 + "` |" in card
    (tmp_path / "results.json").write_text("{not json")
    assert "unreadable" in read_eval(tmp_path)["error"]


@pytest.mark.slow
def test_onnxruntime_genai_greedy_matches_mindspore(env):
    """onnxruntime-genai on the export directory, in a fresh interpreter without MindSpore: the README example,
    and greedy tokens of longer runs on new prompts equal MindSpore's KV-cache generation."""
    from model.generate import Generator
    from tasks.deploy.onnx_generate import GENAI_SNIPPET, encode_prompt
    from tasks.modeling.build import load_network
    from tasks.store.model_artifact import load_tokenizer

    net, _ = load_network(env["model"])
    sp = load_tokenizer(env["model"])
    prompts = ["First Citizen:", "KING HENRY", "a", "To be, or not to be, that is the question:"]
    code = f"""
import contextlib, io, json, sys
sys.path.insert(0, {str(REPO)!r})
import onnxruntime_genai as og
from tasks.deploy.checks import genai_generate
ART = {str(env["path"])!r}
out = io.StringIO()
with contextlib.redirect_stdout(out):
    exec({GENAI_SNIPPET!r}, {{"ART": ART}})
model = og.Model(ART)
tok = og.Tokenizer(model)
ids = [[2] + [int(t) for t in tok.encode(p)] for p in {prompts!r}]
print(json.dumps({{"snippet": out.getvalue(), "ids": ids, "new": [genai_generate(model, i, 60) for i in ids],
                  "mindspore": "mindspore" in sys.modules}}))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["mindspore"] is False
    gen = Generator(net)
    for p, ids, new in zip(prompts, r["ids"], r["new"]):
        assert ids == encode_prompt(sp, p)  # genai's tokenizer gives SentencePiece's ids
        assert new == gen.generate(ids, 60, eos_id=sp.eos_id()) and len(new) > 8
    # the README example runs (its text can differ from sentencepiece's decode only where a random model's byte
    # tokens form invalid UTF-8: genai's decoder stops there, sentencepiece writes U+FFFD)
    assert r["snippet"].startswith("ROMEO:") and r["snippet"].endswith("\n")
