"""The eval stage: lm-eval adapter (checked against the model's own logits), perplexity, local tasks, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import REPO, decoder_reduction, fp32_tol, loglikelihood_tol, run_stage, tiny_model_artifact
from mindspore import Tensor

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from model.llama import causal_lm_loss  # noqa: E402
from tasks.cli import main  # noqa: E402
from tasks.config.loader import resolve_pipeline  # noqa: E402
from tasks.stages import evaluate  # noqa: E402
from tasks.stages.evaluate import lm_adapter, perplexity  # noqa: E402
from tasks.store.artifacts import ArtifactStore  # noqa: E402

TEXT = (
    "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
    "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief."
)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def artifact(root) -> Path:
    return tiny_model_artifact(root, init_std=0.3)  # peaked predictions: log-probs far from uniform


@pytest.fixture(scope="module")
def lm(artifact):
    return lm_adapter.MindSporeLM(pretrained=artifact, batch_size=4, progress=False)


@pytest.fixture(scope="module")
def logit_scale(lm) -> float:
    """The largest |logit| of this model on TEXT (~10 at init_std 0.3): the scale of a log-softmax term."""
    ids = [lm.eot_token_id] + lm.sp.encode(TEXT)[: lm.max_length - 1]
    return float(np.abs(lm.net(Tensor(np.asarray([ids], np.int32))).asnumpy()).max())


def ll_tol(lm, logit_scale: float, ll: float, n_tokens: int) -> float:
    """A log-likelihood that sums `n_tokens` log-softmax terms computed another way (another batch, padding or kernel
    path), at up to max_length keys: tests/helpers.py loglikelihood_tol."""
    return loglikelihood_tol(lm.net.config, lm.max_length, n_tokens, logit_scale, ll)


def req(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def direct_loglikelihood(lm, context: str, continuation: str) -> tuple[float, bool]:
    """From the model's logits on the unpadded sequence: the harness's split of (context, continuation)."""
    sp, eos, L = lm.sp, lm.eot_token_id, lm.max_length
    if context:
        whole, ctx = [eos] + sp.encode(context + continuation), [eos] + sp.encode(context)
        cont = whole[len(ctx) :]
    else:
        ctx, cont = [eos], sp.encode(continuation)
        whole = ctx + cont
    whole = whole[-(L + 1) :]
    logp = log_softmax(lm.net(Tensor(np.asarray([whole[:-1]], np.int32))).asnumpy()[0])
    n = len(cont)
    rows = np.arange(len(whole) - 1 - n, len(whole) - 1)
    targets = np.asarray(whole[-n:])
    return float(logp[rows, targets].sum()), bool((logp[rows].argmax(-1) == targets).all())


def test_scorer_splits_calls_by_memory_and_scores_only_what_is_asked(lm):
    """Rows of many lengths go through one dynamic-shape decoder graph (the peak is the largest call's, not one
    graph per length); a call whose activations would exceed max_bytes takes fewer rows; `tails` scores only the
    last positions. Every answer equals log-softmax of the model's own logits on the unpadded row."""
    net = lm.net
    rng = np.random.default_rng(3)
    lengths = [net.config.max_seq_length, 40, 33, 7, 7, 1]
    rows = [
        (list(rng.integers(3, net.config.vocab_size, n)), list(rng.integers(3, net.config.vocab_size, n)))
        for n in lengths
    ]
    full = lm_adapter.TokenScorer(net, batch_size=4)
    one_row = full.max_seq_length * full.bytes_per_token(full.max_seq_length)
    tight = lm_adapter.TokenScorer(net, batch_size=4, max_bytes=one_row)  # the longest row alone per call
    assert tight.rows_per_call(full.max_seq_length) == 1 and tight.rows_per_call(7) == 4
    got, split = full.score(rows), tight.score(rows)
    tails = tight.score(rows, tails=[3] * len(rows))
    assert (1, full.max_seq_length) in tight.shapes_run and (4, full.max_seq_length) in full.shapes_run
    for (inp, tgt), (lp, greedy), (lp2, greedy2), (lp3, _greedy3) in zip(rows, got, split, tails):
        logits = net(Tensor(np.asarray([inp], np.int32))).asnumpy()[0]
        want = log_softmax(logits)
        want_lp, want_greedy = want[np.arange(len(inp)), tgt], want.argmax(-1) == np.asarray(tgt)
        # one log-softmax term each, at this row's keys and logits (loglikelihood_tol of one token)
        tol = loglikelihood_tol(net.config, len(inp), 1, float(np.abs(logits).max()), np.abs(want_lp))
        for a, g in ((lp, greedy), (lp2, greedy2)):
            assert len(a) == len(inp) and (np.abs(a - want_lp) <= tol).all()
            assert ((g == want_greedy) | (np.abs(a - want.max(-1)) <= tol)).all()  # argmax ties within rounding
        assert len(lp3) == min(3, len(inp)) and (np.abs(lp3 - want_lp[-3:]) <= tol[-3:]).all()


def test_scorer_runs_the_decoder_one_layer_at_a_time_as_the_whole_decoder_does(lm):
    """The scorer's decoder runs one layer at a time through ONE compiled layer graph (its buffers are one layer's,
    not every layer's: docs/MEMORY.md), each call loading that layer's own weights: the same outputs as the
    whole-decoder graph for every shape, and the net's weights untouched."""
    import mindspore as ms

    from model.runtime import dynamic_graph, layerwise_hidden_states

    net = lm.net
    assert lm.scorer.layers_held == 1  # the eval stage's scorer takes the layer-at-a-time path
    run = layerwise_hidden_states(net)

    def hidden(n, ids):
        return n.hidden_states(ids)

    whole = dynamic_graph(net, hidden, ms.Tensor(shape=[None, None], dtype=ms.int32))
    before = {p.name: p.asnumpy().copy() for p in net.get_parameters()}
    rng = np.random.default_rng(5)
    for b, t in [(2, 37), (3, net.config.max_seq_length), (1, 1), (2, 37)]:
        ids = Tensor(rng.integers(3, net.config.vocab_size, (b, t)).astype(np.int32))
        got, want = run(ids).asnumpy(), whole(ids).asnumpy()
        assert got.shape == want.shape == (b, t, net.config.hidden_size)
        # the same kernels in the same order; the bound only allows another blocking of the same sums
        assert np.abs(got - want).max() <= fp32_tol(np.abs(want).max(), decoder_reduction(net.config, t))
    assert all(np.array_equal(p.asnumpy(), before[p.name]) for p in net.get_parameters())


def test_loglikelihood_equals_sum_of_log_softmax_of_the_logits(lm, logit_scale):
    long_context = " ".join([TEXT] * 4)  # > max_length tokens: truncated from the left
    pairs = [
        ("ROMEO:", " But soft"),
        ("Question: What is the east?\nAnswer:", " Juliet is the sun."),
        ("", "Arise, fair sun"),
        ("It is the ", "east"),
        (long_context, " and pale with grief."),
        ("a", " b"),
        (TEXT[:60], TEXT[60:140]),
    ]
    assert len(lm.tok_encode(long_context)) > lm.max_length
    got = lm.loglikelihood([req("loglikelihood", c, x) for c, x in pairs])  # one call: mixed lengths, padded batches
    assert len(lm.scorer.shapes_run) >= 2
    for (c, x), (ll, greedy) in zip(pairs, got):
        want_ll, want_greedy = direct_loglikelihood(lm, c, x)
        n = len(lm._encode_pair(c, x)[1]) if c else len(lm.tok_encode(x))
        assert abs(ll - want_ll) <= ll_tol(lm, logit_scale, want_ll, n), (c[:30], x, ll, want_ll)
        assert greedy == want_greedy
    assert all(ll < 0 for ll, _ in got)


def test_is_greedy_true_for_the_models_own_continuation(lm):
    ctx = "ROMEO: But soft"
    ids = [lm.eot_token_id] + lm.sp.encode(ctx)
    for _ in range(3):  # append the argmax token three times
        logits = lm.net(Tensor(np.asarray([ids], np.int32))).asnumpy()[0, -1]
        ids.append(int(np.argmax(logits)))
    cont_ids = ids[-3:]
    ((ll, greedy),) = lm._loglikelihood_tokens([(None, ids[:-3], cont_ids)])
    assert greedy and ll < 0


def test_trailing_context_space_moves_to_the_continuation(lm, logit_scale):
    ctx, cont = lm._encode_pair("It is the ", "east")
    assert (ctx, cont) == lm._encode_pair("It is the", " east")  # the same tokens, split at the same place
    (a, ga), (b, gb) = lm.loglikelihood(
        [req("loglikelihood", "It is the ", "east"), req("loglikelihood", "It is the", " east")]
    )
    # Two rows of one batch: equal on AVX-512, but with oneDNN capped at AVX2 the rows' MatMul blocking differs
    # and they came out -28.418428 and -28.418430 (float32 sums in another order), so the bound, not ==.
    assert ga == gb and abs(a - b) <= ll_tol(lm, logit_scale, a, len(cont)), (a, b)


def test_rolling_loglikelihood_agrees_with_the_perplexity_function(artifact, logit_scale):
    small = lm_adapter.MindSporeLM(pretrained=artifact, batch_size=4, max_length=16, progress=False)
    docs = [TEXT, TEXT[:50], "x"]
    n_tokens = [len(small.tok_encode(d, add_special_tokens=False)) for d in docs]
    assert n_tokens[0] > 3 * 16 and n_tokens[0] % 16 != 0  # several windows, a partial last one
    rolling = small.loglikelihood_rolling([req("loglikelihood_rolling", d) for d in docs])
    ppl = perplexity.documents_perplexity(small, docs)
    assert ppl["tokens"] == sum(n_tokens)
    # the same tokens scored in other windows and batches: the summed log-likelihoods differ by at most ll_tol,
    # which moves exp(-sum / N) by that over N, relatively (and bits per byte by that over bytes * ln 2)
    total, n = -sum(rolling), sum(n_tokens)
    rel = ll_tol(small, logit_scale, total, n) / n
    assert ppl["perplexity"] == pytest.approx(math.exp(total / n), rel=2 * rel)
    assert ppl["bits_per_byte"] == pytest.approx(total / math.log(2) / len("".join(docs).encode()), rel=rel * n / total)


def test_perplexity_in_one_window_is_exp_of_the_model_loss(lm, logit_scale):
    ids = [lm.eot_token_id] + lm.sp.encode(TEXT[:120])
    assert len(ids) - 1 <= lm.max_length
    x, y = np.asarray([ids[:-1]], np.int32), np.asarray([ids[1:]], np.int32)
    loss = float(causal_lm_loss(lm.net(Tensor(x)), Tensor(y)).asnumpy())
    # the scorer's graph vs the loss's: the mean log-likelihood differs by ll_tol / N, exp(.) relatively by that
    n = len(ids) - 1
    rel = ll_tol(lm, logit_scale, n * loss, n) / n
    assert perplexity.documents_perplexity(lm, [TEXT[:120]])["perplexity"] == pytest.approx(math.exp(loss), rel=2 * rel)


def test_token_byte_lengths_count_utf8_bytes(lm):
    tb = lm_adapter.token_byte_lengths(lm.sp)
    text = "Arise, fair sun — café!"
    ids = lm.sp.encode(text)
    dummy_prefix = 1 if lm.sp.id_to_piece(ids[0]).startswith("\u2581") else 0  # this test tokenizer adds "▁"
    assert tb[ids].sum() == len(text.encode("utf-8")) + dummy_prefix
    assert tb[lm.eot_token_id] == 0


def test_generate_until_cuts_at_stop_strings(lm):
    free = lm.generate_text("ROMEO:", max_gen_toks=12)
    assert isinstance(free, str) and free
    stop = free[3:5] if len(free) >= 5 else free[-1]
    out = lm.generate_until([req("generate_until", "ROMEO:", {"until": [stop], "max_gen_toks": 12})])
    assert out == [free.split(stop)[0]]


def test_register_is_idempotent_and_simple_evaluate_takes_the_name(artifact):
    import lm_eval
    from lm_eval.api.registry import get_model

    lm_adapter.register()
    lm_adapter.register()
    assert get_model("msllm") is lm_adapter.MindSporeLM
    assert get_model("dummy") is not None  # the harness's own models stay reachable
    res = lm_eval.simple_evaluate(
        model="msllm",
        model_args=f"pretrained={artifact},batch_size=4",
        tasks=["local_arc_easy"],
        limit=2,
        task_manager=evaluate.task_manager(["local_arc_easy"]),
        bootstrap_iters=10,
    )
    assert 0.0 <= res["results"]["local_arc_easy"]["acc,none"] <= 1.0


def test_task_run_returns_the_harness_result_structure(lm, logit_scale):
    tasks = ["local_arc_easy", "local_winogrande", "local_truthfulqa_mc2", "local_lambada_openai"]
    res = evaluate.run_tasks(lm, tasks, limit=3)
    for key in ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples", "samples"):
        assert key in res
    for t in tasks:
        r = res["results"][t]
        assert 0.0 <= r["acc,none"] <= 1.0 and "acc_stderr,none" in r
        assert res["n-samples"][t]["effective"] == 3 and len(res["samples"][t]) == 3
    assert res["results"]["local_lambada_openai"]["perplexity,none"] > 1.0
    # the harness's recorded log-likelihoods are the adapter's, request by request
    s = res["samples"]["local_arc_easy"][0]
    again = lm.loglikelihood([req("loglikelihood", *a) for a in s["arguments"]])
    # scored again in other batches (other padding, other MatMul blocking): float32 sums in another order, within
    # ll_tol of a log-likelihood (~ -280 here) of len(continuation) log-softmax terms, not an absolute 1e-6
    for (ctx, cont), r, a in zip(s["arguments"], s["resps"], again):
        assert abs(r[0][0] - a[0]) <= ll_tol(lm, logit_scale, a[0], len(lm._encode_pair(ctx, cont)[1]))
    m = evaluate.main_metrics(res)
    assert set(m) == {f"{t}.acc" for t in tasks}


# ---- local tasks mirror the harness's own definitions --------------------------------------------


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")


def _yaml(path: Path) -> dict:
    cfg = yaml.load(path.read_text(), Loader=_Loader)
    if "include" in cfg:
        cfg = {**_yaml(path.parent / cfg.pop("include")), **cfg}
    return cfg


HARNESS = Path(__import__("lm_eval").__file__).parent / "tasks"


@pytest.mark.parametrize(
    "local, harness",
    [
        ("local_arc_easy", "arc/arc_easy.yaml"),
        ("local_arc_challenge", "arc/arc_challenge.yaml"),
        ("local_piqa", "piqa/piqa.yaml"),
        ("local_boolq", "super_glue/boolq/default.yaml"),
        ("local_lambada_openai", "lambada/lambada_openai.yaml"),
        ("local_truthfulqa_mc1", "truthfulqa/truthfulqa_mc1.yaml"),
        ("local_truthfulqa_mc2", "truthfulqa/truthfulqa_mc2.yaml"),
        ("local_winogrande", "winogrande/default.yaml"),
    ],
)
def test_local_task_prompts_mirror_the_harness(local, harness):
    ours, theirs = _yaml(evaluate.LOCAL_TASKS / f"{local}.yaml"), _yaml(HARNESS / harness)
    fields = ["output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "num_fewshot", "target_delimiter"]
    if local == "local_winogrande":  # same partial scoring, written for MosaicML's pre-split records
        fields = ["output_type"]
    for f in fields:
        assert ours.get(f) == theirs.get(f), f
    assert [m["metric"] for m in ours["metric_list"]] == [m["metric"] for m in theirs["metric_list"]]


def test_local_loaders_reproduce_the_source_records():
    from tasks.stages.evaluate.lm_tasks import utils

    root = REPO / "tasks" / "stages" / "evaluate" / "benchmarks"
    raw = [json.loads(ln) for ln in (root / "boolq" / "boolq.jsonl").read_text().splitlines()]
    rows = utils.read_boolq(root)
    assert [f"Passage: {r['passage']}\nQuestion: {r['question']}?" for r in rows] == [r["query"] for r in raw]
    arc = utils.read_arc(root, "arc_challenge")
    assert len(arc) == 1172 and all(r["answerKey"] in r["choices"]["label"] for r in arc)
    piqa = utils.read_piqa(root)
    assert len(piqa) == 1838 and {r["label"] for r in piqa} == {0, 1}
    tqa = utils.read_truthfulqa(root)
    assert len(tqa) == 817 and all(
        r["mc1_targets"]["labels"][0] == 1 and sum(r["mc1_targets"]["labels"]) == 1 for r in tqa
    )
    assert tqa[0]["question"].startswith("What is the smallest country in the world")
    for name in ("arc_easy", "arc_challenge", "piqa", "boolq", "winogrande", "lambada_openai", "truthfulqa_mc"):
        assert (root / name / "SOURCE.txt").is_file()


# ---- the stage and its command line ----------------------------------------------------------------


def test_eval_stage_writes_the_artifact_and_caches(root, artifact, tmp_path):
    text = tmp_path / "sample.txt"
    text.write_text(TEXT * 3, encoding="utf-8")
    cfg = resolve_pipeline(
        REPO / "pipelines.yaml",
        "tiny",
        [
            "eval.tasks=[local_piqa, local_boolq]",
            "eval.limit=2",
            "eval.max_new_tokens=5",
            "eval.prompts=['ROMEO:']",
            f"eval.perplexity_files=['{text}']",
        ],
    )
    store = ArtifactStore(root)
    path = run_stage("eval", cfg, store, artifact, progress=False)
    m = store.verify(path)
    assert m["stage"] == "eval" and m["inputs"][0]["key"] == artifact.name
    for k in ("local_piqa.acc", "local_boolq.acc", "sample.txt.perplexity", "sample.txt.bits_per_byte"):
        assert k in m["metrics"]
    results = json.loads((path / "results.json").read_text())
    assert set(results["results"]) == {"local_piqa", "local_boolq"} and "samples" not in results
    assert results["perplexity"]["sample.txt"]["perplexity"] == m["metrics"]["sample.txt.perplexity"]
    assert len((path / "samples" / "local_piqa.jsonl").read_text().splitlines()) == 2
    gens = [json.loads(ln) for ln in (path / "generations.jsonl").read_text().splitlines()]
    assert [g["prompt"] for g in gens] == ["ROMEO:"]
    report = (path / "report.md").read_text()
    assert "## Perplexity" in report and "local_piqa" in report and "ROMEO:" in report
    assert run_stage("eval", cfg, store, artifact, progress=False) == path  # cache hit
    table = evaluate.compare_table(path, path)
    assert "| local_piqa.acc |" in table and "+0.0000" in table


def test_eval_report_shows_the_base_models_perplexity_on_the_same_blocks(tmp_path):
    """A model continued from another (its manifest's model input): the report puts the base's held-out perplexity,
    on the same blocks, beside the evaluated model's, each row saying which model it is; the base's own eval (it
    has no base) shows no such row and gives the same figure."""
    from model.config import ModelConfig
    from model.llama import LlamaForCausalLM
    from tasks.store.model_artifact import load_tokenizer, write_model

    cfg = resolve_pipeline(
        REPO / "pipelines.yaml", "tiny", ["eval.tasks=[]", "eval.prompts=[]", "eval.heldout_blocks=6"]
    )
    store = ArtifactStore(tmp_path)
    held_out = run_stage("data", cfg, store, progress=False)
    mc, tok = ModelConfig.from_name("tiny", init_std=0.3), load_tokenizer(held_out)

    def model(seed: int, *inputs: Path) -> Path:
        with store.build(
            "pretrain",
            f"{seed:020d}",
            pipeline="tiny",
            config={"seed": seed},
            inputs=[store.input_ref(i) for i in inputs],
            code="test",
        ) as b:
            write_model(
                b.dir,
                name="llama",
                config=mc,
                tokenizer_model=held_out,
                tokenizer_info=tok.info(),
                weights={p.name: p.asnumpy() for p in LlamaForCausalLM(mc, seed=seed).trainable_params()},
                seq_length=mc.max_seq_length,
            )
        return b.path

    base = model(0, held_out)
    continued = model(1, held_out, base)  # as pretrain with init_from records it: data, then the model
    assert (
        perplexity.base_chain(store, continued) == [(base, "continued from")]
        and perplexity.base_chain(store, base) == []
    )
    path = run_stage("eval", cfg, store, continued, held_out, progress=False)
    own = run_stage("eval", cfg, store, base, held_out, progress=False)
    res, base_res = (json.loads((p / "results.json").read_text()) for p in (path, own))
    b = res["base_perplexity"]
    assert (
        b["model"] == f"pretrain/{base.name}"
        and b["chain"] == f"pretrain/{continued.name} ← continued from pretrain/{base.name}"
    )
    assert b["held-out"]["tokens"] == res["perplexity"]["held-out"]["tokens"]  # the same blocks
    # the same model on the same blocks through the same scorer and batch shapes: the same sums in the same order
    # (1e-9 relative: float64 formatting, not a float32 bound)
    assert b["held-out"]["perplexity"] == pytest.approx(base_res["perplexity"]["held-out"]["perplexity"], rel=1e-9)
    assert b["held-out"]["perplexity"] != pytest.approx(res["perplexity"]["held-out"]["perplexity"], rel=1e-3)
    assert ArtifactStore.read_manifest(path)["metrics"]["base_perplexity"] == b["held-out"]["perplexity"]
    report = (path / "report.md").read_text()
    rows = [ln for ln in report.splitlines() if ln.startswith("| held-out |")]
    assert [r.split(" | ")[1] for r in rows] == [
        f"evaluated: `pretrain/{continued.name}`",
        f"base: `pretrain/{base.name}`",
    ]
    assert rows[1].split(" | ")[4] == evaluate._fmt(b["held-out"]["perplexity"])
    assert "chain started from" in report and "base:" not in (own / "report.md").read_text()
    assert "base_perplexity" not in base_res


def test_cli_eval_compare_and_predict(root, artifact, tmp_path, capsys):
    common = ["--config", str(REPO / "pipelines.yaml"), "--pipeline", "tiny", "--artifacts", str(root)]
    paths = []
    for seed in (0, 1):
        assert (
            main(
                [
                    "eval",
                    *common,
                    "--from",
                    str(artifact),
                    "--set",
                    "eval.tasks=[local_winogrande]",
                    "--set",
                    "eval.limit=2",
                    "--set",
                    "eval.max_new_tokens=4",
                    "--set",
                    f"eval.seed={seed}",
                ]
            )
            == 0
        )
        out = capsys.readouterr().out.strip().splitlines()
        assert out[-2].startswith("# eval artifact") and "local_winogrande.acc=" in out[-2]
        paths.append(out[-1])
    assert paths[0] != paths[1] and all(Path(p).is_dir() for p in paths)
    assert main(["eval", "compare", paths[0], paths[1], "--artifacts", str(root)]) == 0
    assert "| local_winogrande.acc |" in capsys.readouterr().out
    assert main(["eval", "compare", paths[0], "--artifacts", str(root)]) == 1
    assert "usage: msllm eval compare" in capsys.readouterr().err

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("JULIET:\nTo be\n")
    assert (
        main(["predict", *common, "--from", str(artifact), "--set", "eval.max_new_tokens=4", "ROMEO:", f"@{prompts}"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("ROMEO:") and "\nJULIET:" in out and "\nTo be" in out and out.count("-" * 40) == 2


@pytest.mark.slow  # indexes lm-eval's ~14,700 built-in tasks (~17 s)
def test_unknown_task_names_the_local_ones():
    with pytest.raises(ValueError, match="unknown task.*local_nope.*local_arc_easy"):
        evaluate.task_manager(["local_nope"])
    assert "arc_easy" in evaluate.task_manager(["arc_easy"]).all_tasks  # standard names pass through


@pytest.mark.integration  # ~10 s: the fused score steps compiled, two eval runs
def test_eval_weights_score_and_decode_in_the_stored_format(artifact, lm, logit_scale, caplog):
    """eval.weights fp16: the harness's loglikelihoods come from the fused steps on binary16 matrices (StepScorer):
    they equal the fp32 scorer run on a copy of the model whose matrices were rounded to binary16, within the
    float32 bound, and they are not the fp32 model's; q8_0 on a model whose rows are not whole 32-weight blocks
    (tiny: MLP 172) scores in fp32 and says why. The eval stage keys, records and reports the format."""
    from tasks.modeling.build import load_network

    lm16 = lm_adapter.MindSporeLM(pretrained=artifact, batch_size=4, progress=False, weights="fp16")
    if lm16.weights != "fp16":
        pytest.skip(f"the fused steps do not run here: {lm16.generator.decode_reason}")
    assert isinstance(lm16.scorer, lm_adapter.StepScorer)
    assert lm16.net.stored_weights.dtype == "fp16"  # loaded with only its binary16 matrices: no float32 copy
    net, _ = load_network(artifact)
    for p in net.get_parameters():
        if p.name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight")):
            p.set_data(Tensor(p.asnumpy().astype(np.float16).astype(np.float32)))
    rounded = lm_adapter.MindSporeLM(net=net, tokenizer=lm.sp, batch_size=4, progress=False)
    reqs = [req("loglikelihood", "To be, or not", " to be"), req("loglikelihood", "", TEXT[:200])]
    got, want, fp32 = (m.loglikelihood(reqs) for m in (lm16, rounded, lm))
    moved = close = 0.0
    for (a, _), (b, _), (c, _), r in zip(got, want, fp32, reqs):
        n = len(lm.sp.encode(r.arguments[1]))
        tol = ll_tol(lm, logit_scale, b, n)
        assert abs(a - b) <= tol, (a, b, tol)
        moved, close = max(moved, abs(a - c)), max(close, abs(a - b))
    # the rounding moves the scores; the two fp32 computations of the rounded model agree far closer than that
    assert moved > 4 * close, f"the fp16 scores are as near the fp32 model's ({moved:.3g}) as the rounded one's"
    assert lm16.generate_text("To be", max_gen_toks=4) == rounded.generate_text("To be", max_gen_toks=4)

    with caplog.at_level("WARNING", logger="msllm.eval"):
        lm8 = lm_adapter.MindSporeLM(pretrained=artifact, batch_size=4, progress=False, weights="q8_0")
    assert lm8.weights == "fp32" and isinstance(lm8.scorer, lm_adapter.TokenScorer)
    assert "scoring in fp32 instead" in caplog.text and "q8_0" in caplog.text

    cfg = resolve_pipeline(REPO / "pipelines.yaml", "tiny", ["eval.tasks=[]", "eval.prompts=[]"])
    cfg16 = resolve_pipeline(REPO / "pipelines.yaml", "tiny", ["eval.tasks=[]", "eval.prompts=[]", "eval.weights=fp16"])
    store = ArtifactStore(artifact.parent.parent)  # the store the model artifact lives in
    keys = {evaluate.stage_key(c, store, artifact, None)[0] for c in (cfg, cfg16)}
    assert len(keys) == 2  # the format is part of the key: fp16 scores are not fp32's cache hit
    path = run_stage("eval", cfg16, store, artifact, progress=False)
    assert json.loads((path / "results.json").read_text())["weights"] == "fp16"
    assert "Scored with fp16 weight matrices" in (path / "report.md").read_text()
