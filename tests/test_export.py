"""Export stage (tasks/export.py) and onnxruntime-only generation (tasks/onnx_generate.py).

One real export of a tiny random model (child process, as the CLI runs it) is shared by
most tests; each test re-checks one promise independently of the stage's own check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks import export
from tasks.artifacts import ArtifactError, ArtifactStore
from tasks.config import ConfigError, resolve_pipeline
from tasks.pretrain import StageFailed
from tests.helpers import tiny_model_artifact

REPO = Path(__file__).resolve().parent.parent
SETS = ["export.batch_size=2", "export.seq_length=16"]  # a batch of 2 also exercises the spare (all-padding) rows


def _cfg(*extra: str):
    return resolve_pipeline(REPO / "pipelines.yaml", "tiny", [*SETS, *extra])  # export.seq_length 16


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_root")
    model = tiny_model_artifact(root)
    store = ArtifactStore(root)
    path = export.run(_cfg(), store, model, progress=False)
    return {"root": root, "store": store, "model": model, "path": path,
            "manifest": ArtifactStore.read_manifest(path)}


def test_verified_pair_recorded_in_manifest(env):
    m, path = env["manifest"], env["path"]
    v = m["verification"]
    assert v["mindir_max_abs_diff"] <= 1e-4 and v["onnx_max_abs_diff"] <= 1e-4
    assert v["greedy_tokens_match"] is True and v["onnx_checker"] == "passed"
    assert v["prompts"] == _cfg().export.prompts and len(v["greedy"]) == len(v["prompts"])
    assert v["shapes"]["onnx"]["exported"] == [2, 16]
    assert v["shapes"]["mindir"]["exported"] == [None, None]
    checked = v["shapes"]["mindir"]["checked"]  # several batch sizes and lengths: dynamic both ways
    assert len({s[0] for s in checked}) > 1 and len({s[1] for s in checked}) > 1
    for k in ("mindir_max_abs_diff", "onnx_max_abs_diff", "greedy_tokens_match"):
        assert m["metrics"][k] == v[k]
    assert json.loads((path / "export.json").read_text())["verification"] == v
    names = {f["path"] for f in m["files"]}
    assert {"model.mindir", "model.onnx", "tokenizer.model", "model.json", "MODEL_CARD.md", "onnx_generate.py"} <= names
    assert (path / "tokenizer.model").read_bytes() == (env["model"] / "tokenizer.model").read_bytes()
    assert m["inputs"][0]["key"] == ArtifactStore.read_manifest(env["model"])["key"]
    env["store"].verify(path)  # every file matches its recorded sha256
    card = (path / "MODEL_CARD.md").read_text()
    for heading in ("## Model", "## Verification", "## Lineage", "## Generate with onnxruntime only"):
        assert heading in card
    assert "0.16M" in card and "## Evaluation" not in card  # no eval artifact given


def test_onnx_passes_checker_with_named_fixed_shape_io(env):
    import onnx

    m = onnx.load(str(env["path"] / "model.onnx"))
    onnx.checker.check_model(m, full_check=True)
    (inp,), (out,) = m.graph.input, m.graph.output
    assert inp.name == "input_ids" and inp.type.tensor_type.elem_type == onnx.TensorProto.INT32
    assert [d.dim_value for d in inp.type.tensor_type.shape.dim] == [2, 16]
    assert out.name == "logits"


def test_mindir_reloads_with_dynamic_shape(env):
    import mindspore as ms

    from tasks.model_artifact import load_model

    net, _ = load_model(env["model"])
    graph = ms.nn.GraphCell(ms.load(str(env["path"] / "model.mindir")))
    for shape in [(3, 11), (1, 40)]:  # neither was checked by the stage
        x = np.random.default_rng(1).integers(0, 512, size=shape, dtype=np.int32)
        got, want = graph(ms.Tensor(x)).asnumpy(), net(ms.Tensor(x)).asnumpy()
        assert got.shape == (*shape, 512) and np.abs(got - want).max() <= 1e-4


def test_onnxruntime_greedy_matches_mindspore_generation(env):
    from model.generate import Generator
    from tasks.model_artifact import load_model, load_tokenizer
    from tasks.onnx_generate import OnnxGenerator, encode_prompt

    net, _ = load_model(env["model"])
    sp = load_tokenizer(env["model"])
    ms_gen, ort_gen = Generator(net, max_len=16), OnnxGenerator(env["path"] / "model.onnx")
    for prompt in ["First Citizen:", "KING HENRY", "a"]:  # not the stage's prompts
        ids = encode_prompt(sp, prompt)
        want = ms_gen.generate(ids, 10, eos_id=sp.eos_id())
        assert ort_gen.generate(ids, 10, eos_id=sp.eos_id()) == want and len(want) > 0
    long = list(range(4, 30))  # longer than the window: keeps the last 15 tokens, then 1 new token
    assert ort_gen.generate(long, 10) == ms_gen.generate(long, 10) and len(ms_gen.generate(long, 10)) == 1


def test_onnx_generation_needs_no_mindspore(env):
    """The README snippet, tasks.onnx_generate and the artifact's copy of it, in a fresh interpreter."""
    from tasks.onnx_generate import SNIPPET

    code = f"""
import contextlib, io, json, runpy, sys
sys.path.insert(0, {str(REPO)!r})
ART = {str(env["path"])!r}
out = io.StringIO()
with contextlib.redirect_stdout(out):
    exec({SNIPPET!r}, {{"ART": ART}})
from tasks.onnx_generate import generate_text
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


def test_rerun_is_a_cache_hit_and_cli_prints_the_path(env, monkeypatch, capsys):
    from tasks import cli, supervise

    def no_child(*a, **k):
        raise AssertionError("a cached export must not start a child")

    monkeypatch.setattr(supervise, "run_child", no_child)
    assert export.run(_cfg(), env["store"], env["model"]) == env["path"]
    rc = cli.main(["export", "--config", str(REPO / "pipelines.yaml"), "--pipeline", "tiny", *[a for s in SETS for a in ("--set", s)],
                   "--artifacts", str(env["root"]), "--from", str(env["model"])])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and out[-1] == str(env["path"])
    assert "onnx_max_abs_diff" in out[-2]


def test_cli_without_a_model_artifact_says_what_to_run(tmp_path, capsys):
    from tasks import cli

    rc = cli.main(["export", "--config", str(REPO / "pipelines.yaml"), "--pipeline", "tiny",
                   "--artifacts", str(tmp_path)])
    assert rc == 1 and "msllm train --pipeline tiny" in capsys.readouterr().err


def test_mismatching_onnx_fails_the_stage_and_leaves_no_artifact(env, monkeypatch):
    """The ONNX file is exported from different weights: logits and greedy tokens must both be caught."""
    orig = export.export_onnx

    def other_weights(net, path, *a, **k):
        for p in net.trainable_params():
            p.set_data(p + 0.05)
        return orig(net, path, *a, **k)

    monkeypatch.setattr(export, "export_onnx", other_weights)
    cfg = _cfg("export.max_new_tokens=4")  # another key than the fixture's artifact
    key = export.stage_key(cfg, env["store"], env["model"])[0]
    with pytest.raises(export.ExportCheckFailed, match=r"ONNX max \|logit diff\| .* > export.atol 0.0001") as e:
        export.run(cfg, env["store"], env["model"], isolate=False, progress=False)
    assert "greedy tokens differ" in str(e.value)
    assert env["store"].lookup("export", key) is None
    assert sorted(p.name for p in (env["root"] / "export").iterdir()) == [env["path"].name]  # no temp dir left


def test_failed_check_in_the_child_fails_the_stage(env):
    """A tolerance below the measured ONNX difference: the child's error reaches the caller first."""
    if env["manifest"]["verification"]["onnx_max_abs_diff"] == 0:
        pytest.skip("onnxruntime reproduced MindSpore exactly; nothing to fail on")
    cfg = _cfg("export.atol=1.0e-12", "export.formats=[onnx]", "export.max_new_tokens=1")
    key = export.stage_key(cfg, env["store"], env["model"])[0]
    with pytest.raises(StageFailed) as e:
        export.run(cfg, env["store"], env["model"], progress=False)
    assert str(e.value).startswith("export verification failed: ONNX max |logit diff|")
    assert env["store"].lookup("export", key) is None


def test_settings_the_model_cannot_take_are_config_errors(env):
    short = tiny_model_artifact(env["root"], max_seq_length=32)  # the pipeline's own model would allow 64
    with pytest.raises(ConfigError, match=r"pipelines.tiny.export.seq_length: 64 exceeds the model's max_seq_length=32"):
        export.run(_cfg("export.seq_length=64"), env["store"], short)
    with pytest.raises(ConfigError, match=r"export.prompts"):
        _cfg("export.prompts=[]")


def test_finetune_artifact_is_merged_before_export(env):
    """A (full) finetune artifact resolves to its merged model; stage_key refuses the unmerged one."""
    from safetensors.numpy import save_file

    from tasks.checkpoint import load_weights

    store, base = env["store"], env["model"]
    with store.build("finetune", "f" * 20, pipeline="test", config={}, inputs=[store.input_ref(base)], code="test") as b:
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
    results = {"results": {"local_arc_easy": {"alias": "arc", "acc,none": 0.25, "acc_stderr,none": 0.04,
                                              "acc_norm,none": 0.3, "odd,none": "n/a"}, "broken": 3},
               "perplexity": {"held-out": {"tokens": 1000, "bytes": 4000, "perplexity": 12.5, "bits_per_byte": 0.9},
                              "bad": None}}
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
    card = export.model_card(info=json.loads((model / "model.json").read_text()), parameters=123, pipeline="tiny",
                             model_ref=store.input_ref(model), verification=ver, lineage=lineage,
                             evaluation=export._read_eval(b.path), artifact_path=env["path"])
    assert "| held-out | 1000 | 12.5 | 0.9 |" in card
    assert "| local_arc_easy | acc | 0.25 | 0.04 |" in card and "| local_arc_easy | acc_norm | 0.3 | – |" in card
    assert "| /data/corpus.txt | 10 | `" + "ab" * 32 + "` |" in card
    (tmp_path / "results.json").write_text("{not json")
    assert "unreadable" in export._read_eval(tmp_path)["error"]
