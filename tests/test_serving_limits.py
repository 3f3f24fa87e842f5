"""Limits on what a server or a conversion takes in (issue 35): adapter names confined to the server's temporary
directory; chat templates rendered within a time and a size limit (tasks/chat_template/) at convert and at serve;
request bodies capped (--max-body-size, a 413) and tokenized off the event loop; a request of more sequences
than --max-queue a 400, not a 503.

The unit tests run the functions themselves; the `integration` ones a real `msllm serve` child (tests/test_serving.py's
Server) on a tiny model artifact with a tokenizer.json and a chat template, and `msllm convert --from-hf` on a tiny
transformers directory."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import CHATML, train_tiny_hf_tokenizer

# ----------------------------------------------------------------------------- adapter names (unit)


@pytest.mark.parametrize(
    "name", ["../../../../tmp/x/TRAV", "/tmp/x/ABS", "a/b", "..", ".", ".hidden", "a\\b", "ü", "a:b", "x" * 256]
)
def test_an_adapter_name_that_is_not_a_plain_model_id_is_refused(name):
    from tasks.serving.adapters import parse_adapter_flag

    with pytest.raises(ValueError) as err:
        parse_adapter_flag(f"{name}=artifacts/finetune/abc")
    msg = str(err.value)
    assert msg.startswith("--adapter ") and f"the adapter name {name!r}" in msg
    assert "letters, digits, '-', '_' and '.'" in msg and "\n" not in msg


def test_plain_adapter_names_pass():
    from tasks.serving.adapters import parse_adapter_flag

    for name in ("sonnets", "lora-a", "chat_v2", "Qwen2.5-ft", "a" * 255, "0"):
        assert parse_adapter_flag(f"{name}=finetune/abc").name == name


def test_cli_serve_refuses_a_traversing_adapter_name_before_anything(tmp_path, capsys):
    """The issue's command: the name is refused when the flag is parsed (exit 2, one message naming --adapter),
    and no directory appears where it pointed."""
    from tasks.cli import main

    target = tmp_path / "x"
    trav = "../" * len(tmp_path.parts) + str(target / "TRAV").lstrip("/")
    for flag in (f"--adapter={trav}=finetune/abc", f"--adapter={target / 'ABS'}=finetune/abc"):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", str(tmp_path), flag, "--port", "1"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "--adapter" in err and "is a path (it has '/')" in err and "Traceback" not in err
    assert not target.exists()


def test_an_adapters_merged_directory_stays_in_the_servers_temporary_directory(tmp_path):
    """Defense in depth: Adapter.model_dir (what writes `tmp / name` on an export base) refuses a name that leaves
    `tmp`, before any child process runs, even when the flag's check was bypassed."""
    from tasks.serving.adapters import Adapter

    tmp = tmp_path / "serve-tmp"
    tmp.mkdir()
    for name in ("../escaped", str(tmp_path / "abs")):
        with pytest.raises(ValueError, match="--adapter"):
            Adapter(name, tmp_path / "finetune" / "k", "lora", "pretrain/k").model_dir("export", tmp_path, tmp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serve-tmp"] and not any(tmp.iterdir())


def test_check_adapters_refuses_a_bad_name_given_in_code(tmp_path):
    from tasks.serving.adapters import AdapterSpec, check_adapters

    with pytest.raises(ValueError, match=r"--adapter \.\./x=ft: the adapter name '\.\./x' is a path"):
        check_adapters(tmp_path, [AdapterSpec("../x", "ft")], "pretrain/k")


def test_a_bad_max_body_size_is_a_usage_error(capsys):
    from tasks.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "x", "--max-body-size", "lots"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--max-body-size" in err and "is not a size" in err


# ----------------------------------------------------------------------------- chat templates (unit)

MSGS = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
    {"role": "user", "content": "v"},
]

# Templates that would spin or build a value the size of memory: (template, the limit it passes). Each one is
# refused before the value is built (a pre-check on the operation) or as soon as it is (doubling: 2× the limit).
RUNAWAY = {
    "nested range": ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "time"),
    "string * n": ("{{ (messages[-1]['content'] * 300000000)|length }}", "size"),
    "list * n": ("{{ ([messages[0]['content']] * 99999999)|length }}", "size"),
    "int ** n": ("{{ (9 ** 999999999)|string|length }}", "size"),
    "% width": ("{{ '%999999999d' % 1 }}", "size"),
    "format width": ("{{ '{:>999999999}'.format(1) }}", "size"),
    "format_map width": ("{{ '{x:>999999999}'.format_map({'x': 1}) }}", "size"),
    "center": ("{{ 'a'|center(999999999) }}", "size"),
    "ljust": ("{{ 'a'.ljust(999999999) }}", "size"),
    "replace squaring": (
        "{% set ns = namespace(x='aaaa') %}{% for i in range(10) %}"
        "{% set ns.x = ns.x.replace('a', ns.x) %}{% endfor %}{{ ns.x|length }}",
        "size",
    ),
    "~ doubling": (
        "{% set ns = namespace(x='aaaa') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}"
        "{% endfor %}{{ ns.x|length }}",
        "size",
    ),
    "+ doubling": (
        "{% set ns = namespace(x='aaaa') %}{% for i in range(60) %}{% set ns.x = ns.x + ns.x %}"
        "{% endfor %}{{ ns.x|length }}",
        "size",
    ),
    "join doubling": (
        "{% set ns = namespace(x='aaaa') %}{% for i in range(60) %}{% set ns.x = [ns.x, ns.x]|join %}"
        "{% endfor %}{{ ns.x|length }}",
        "size",
    ),
    "str.join doubling": (
        "{% set ns = namespace(x='aaaa') %}{% for i in range(60) %}"
        "{% set ns.x = ''.join([ns.x, ns.x]) %}{% endfor %}{{ ns.x|length }}",
        "size",
    ),
    "tojson indent": ("{{ [1, [2, [3]]]|tojson(indent=999999999) }}", "size"),
    "indent": ("{{ 'a\\nb\\nc'|indent(999999999) }}", "size"),
    "wordwrap": ("{{ ('a ' * 10)|wordwrap(1, wrapstring='b' * 100) }}", "size"),
    "batch fill": ("{{ [1]|batch(999999999, 'x')|list|length }}", "size"),
    "translate": ("{{ ('aaaaa' ~ 'aaaaa').translate({97: 'c'|center(100)}) }}", "size"),
    "lipsum": ("{{ lipsum(99999, max=99999)|length }}", "size"),
    "output": ("{% for i in range(99999) %}a long line of text{% endfor %}", "size"),
    "exponential macro": (
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
        "time",
    ),
}


@pytest.mark.parametrize("name", list(RUNAWAY))
def test_a_runaway_template_stops_at_its_limit_with_one_error(name):
    from tasks.chat_template import TEMPLATE_SECONDS, TemplateLimitError, render_chat_template

    template, kind = RUNAWAY[name]
    t0 = time.perf_counter()
    with pytest.raises(TemplateLimitError) as err:
        render_chat_template(template, MSGS, where="/models/m")
    took = time.perf_counter() - t0
    msg = str(err.value)
    assert msg.startswith("/models/m: the chat template ") and "\n" not in msg
    assert "tokenizer_config.json's chat_template" in msg
    if kind == "time":
        assert f"time limit of {TEMPLATE_SECONDS:g} s" in msg and TEMPLATE_SECONDS <= took < TEMPLATE_SECONDS + 2
    else:
        assert "size limit of" in msg and took < TEMPLATE_SECONDS


# Templates in the shapes real models ship (a system message taken out of the loop, a namespace, a list grown one
# message per iteration, selectattr, tojson with an indent, trim, split): the limits leave them exactly as
# transformers renders them, for short and long conversations.
REAL_SHAPES = {
    "chatml": CHATML,
    "header turns": (
        "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content']|trim %}"
        "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
        "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}"
        "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
        "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    ),
    "alternation check": (
        "{%- set loop_messages = messages[1:] if messages[0]['role'] == 'system' else messages %}"
        "{%- set users = loop_messages | selectattr('role', 'equalto', 'user') | list %}"
        "{%- set kept = [] %}{%- for m in loop_messages %}{%- if m['role'] != 'tool' %}"
        "{%- set kept = kept + [m] %}{%- endif %}{%- endfor %}"
        "{%- for m in kept %}{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{- raise_exception('roles must alternate') }}{%- endif %}{%- endfor %}"
        "{{- bos_token }}[{{ users|length }} users]{%- for m in loop_messages %}{%- if m['role'] == 'user' %}"
        "{{- '[INST]' + m['content'] + '[/INST]' }}{%- else %}{{- m['content'].split('</think>')[-1] + eos_token }}"
        "{%- endif %}{%- endfor %}{{- (messages[:1] | tojson(indent=2)) if messages[0]['role'] == 'system' }}"
    ),
    "namespace": (
        "{%- set ns = namespace(system='', n=0) %}{%- for m in messages %}{%- if m['role'] == 'system' %}"
        "{%- set ns.system = m['content'] %}{%- endif %}{%- set ns.n = ns.n + 1 %}{%- endfor %}"
        "{{ bos_token }}{{ ns.system }}{%- for m in messages if m['role'] != 'system' %}"
        "{{ '<|' ~ m['role'] ~ '|>' ~ m['content'] ~ ('%s' % eos_token) }}{%- endfor %}"
        "{{ '<|assistant|>' if add_generation_prompt }}{{ '{}/{}'.format(ns.n, messages|length) }}"
    ),
}


@pytest.mark.parametrize("shape", list(REAL_SHAPES))
def test_templates_of_real_shapes_render_as_transformers_renders_them(shape, hf_tok):
    from transformers import PreTrainedTokenizerFast

    from tasks.chat_template import render_chat_template

    ref = PreTrainedTokenizerFast(
        tokenizer_file=str(hf_tok / "tokenizer.json"), bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    for n in (2, 401):
        msgs = [{"role": "system", "content": " Be brief. "}] + [
            {"role": ("user", "assistant")[i % 2], "content": f"turn {i}: " + "words and more words " * (i % 7)}
            for i in range(n)
        ]
        for gen in (True, False):
            want = ref.apply_chat_template(
                msgs, chat_template=REAL_SHAPES[shape], tokenize=False, add_generation_prompt=gen
            )
            assert (
                render_chat_template(REAL_SHAPES[shape], msgs, gen, bos_token="<|im_start|>", eos_token="<|im_end|>")
                == want
            )


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory) -> Path:
    """A trained tokenizer.json directory (ChatML) for the module's tests."""
    return train_tiny_hf_tokenizer(tmp_path_factory.mktemp("limits_tok") / "tok")


def _with_template(base: Path, dst: Path, template: str) -> Path:
    import shutil

    shutil.copytree(base, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("name", ["nested range", "string * n"])
def test_the_convert_time_check_refuses_the_issues_templates(name, tmp_path, hf_tok):
    """check_chat_template (what convert runs before writing anything) on the issue's two templates: the first spun
    for more than 120 s, the second passed and built 6 GB at serve time."""
    from tasks.chat_template import TEMPLATE_SECONDS, TemplateLimitError
    from tasks.tokenizer import check_chat_template, load_tokenizer

    tok = load_tokenizer(_with_template(hf_tok, tmp_path / "t", RUNAWAY[name][0]))
    t0 = time.perf_counter()
    with pytest.raises(TemplateLimitError, match="tokenizer_config.json's chat_template"):
        check_chat_template(tok)
    assert time.perf_counter() - t0 < TEMPLATE_SECONDS + 2


# ----------------------------------------------------------------------------- convert --from-hf (integration)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["nested range", "string * n"])
def test_convert_from_hf_refuses_a_runaway_template_in_one_line(name, tmp_path, hf_tok, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tasks.chat_template import TEMPLATE_SECONDS
    from tasks.cli import main

    hf = tmp_path / "hf"
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(hf)
    _with_template(hf_tok, tmp_path / "tok", RUNAWAY[name][0])
    for f in (tmp_path / "tok").iterdir():
        (hf / f.name).write_bytes(f.read_bytes())
    capsys.readouterr()  # transformers' progress bar
    t0 = time.perf_counter()
    rc = main(["convert", "--from-hf", str(hf), "--artifacts", str(tmp_path / "artifacts")])
    took = time.perf_counter() - t0
    err = capsys.readouterr().err.strip()
    assert rc == 1 and took < TEMPLATE_SECONDS + 30, (rc, took, err)
    assert len(err.splitlines()) == 1 and "tokenizer_config.json's chat_template" in err, err
    assert ("time limit" if RUNAWAY[name][1] == "time" else "size limit") in err
    assert not (tmp_path / "artifacts" / "convert").exists() or not any((tmp_path / "artifacts" / "convert").iterdir())


@pytest.mark.integration
def test_convert_from_gguf_refuses_a_runaway_template_naming_its_key(tmp_path, hf_tok, capsys):
    """The same check on a GGUF's tokenizer.chat_template: one line naming the file and that key."""
    import numpy as np

    from model.config import ModelConfig
    from model.convert import key_pairs
    from model.gguf import write_gguf
    from tasks.cli import main
    from tasks.deploy.gguf_export import tokenizer_meta
    from tasks.tokenizer import load_tokenizer

    tmeta = tokenizer_meta(load_tokenizer(_with_template(hf_tok, tmp_path / "tok", RUNAWAY["string * n"][0])))
    cfg = ModelConfig(
        vocab_size=len(tmeta["tokenizer.ggml.tokens"]),
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        max_seq_length=32,
        tie_embeddings=False,
    )
    rng = np.random.default_rng(0)
    write_gguf(
        tmp_path / "m.gguf",
        cfg,
        {ours: (0.1 * rng.standard_normal(shape)).astype(np.float32) for _, ours, shape in key_pairs(cfg)},
        tmeta,
        qtype="F32",
    )
    capsys.readouterr()
    assert main(["convert", "--from-gguf", str(tmp_path / "m.gguf"), "--artifacts", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path / "m.gguf") in err and "size limit" in err, err
    assert "fix tokenizer.chat_template" in err and "tokenizer_config.json" not in err, err


# ----------------------------------------------------------------------------- the server (integration)

TRAPS = (
    "{% if messages[-1]['content'] == 'grow' %}{{ (messages[-1]['content'] * 30000000)|length }}"
    "{% elif messages[-1]['content'] == 'spin' %}{% for i in range(99999) %}{% for j in range(99999) %}"
    "{% endfor %}{% endfor %}{% else %}" + CHATML + "{% endif %}"
)
MAX_QUEUE = 4
MAX_BODY = 2 * 2**20


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory, hf_tok):
    """A tiny model artifact (random weights) whose tokenizer is a tokenizer.json with TRAPS as its chat template:
    a template that passes the convert-time check (four one-character messages) and runs away on some messages,
    as a model converted before the limits existed would have."""
    from model.config import ModelConfig
    from model.llama import LlamaForCausalLM
    from tasks.store.artifacts import ArtifactStore
    from tasks.store.model_artifact import write_model
    from tasks.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("limits_serve")
    tok_dir = _with_template(hf_tok, root / "tok", TRAPS)
    tok = load_tokenizer(tok_dir)
    mc = ModelConfig.from_name("tiny")
    net = LlamaForCausalLM(mc, seed=0)
    store = ArtifactStore(root / "artifacts")
    key = store.key("pretrain", {"preset": "tiny", "tokenizer": "traps"}, [], "test")
    with store.build("pretrain", key, pipeline="test", config={"preset": "tiny"}, inputs=[], code="test") as b:
        write_model(
            b.dir,
            name="llama",
            config=mc,
            weights={p.name: p.asnumpy() for p in net.trainable_params()},
            tokenizer_model=tok_dir,
            tokenizer_info=tok.info(),
            seq_length=mc.max_seq_length,
        )
    return b.path


@pytest.fixture(scope="module")
def server(hf_model, tmp_path_factory):
    from tests.test_serving import Server

    srv = Server(
        hf_model,
        tmp_path_factory.mktemp("limits_logs"),
        "--max-queue",
        str(MAX_QUEUE),
        "--max-body-size",
        str(MAX_BODY),
        "--head-timeout",
        str(HEAD_TIMEOUT),
    )
    yield srv
    srv.stop()


def _request(
    srv, path: str, body: bytes | None = None, *, chunked: bool = False, timeout: float = 120
) -> tuple[int, dict, float]:
    """(status, JSON body, seconds) of one request on its own connection; a chunked body is sent in 64 KB chunks."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        if body is None:
            conn.request("GET", path)
        elif chunked:
            conn.request(
                "POST",
                path,
                body=(body[i : i + 65536] for i in range(0, len(body), 65536)),
                headers={"Content-Type": "application/json"},
                encode_chunked=True,
            )
        else:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}"), time.perf_counter() - t0
    finally:
        conn.close()


def _post(srv, path: str, obj: dict, **kw) -> tuple[int, dict, float]:
    return _request(srv, path, json.dumps(obj).encode(), **kw)


@pytest.mark.integration
def test_a_body_over_the_limit_is_a_413_naming_it_before_any_work(server):
    big = {"model": server.model, "prompt": "the king speaks. " * (MAX_BODY // 16), "max_tokens": 1}
    for path, body in (("/v1/completions", big), ("/tokenize", {"prompt": big["prompt"]})):
        for chunked in (False, True):  # Content-Length refused before reading; a chunked body while it is read
            status, out, took = _post(server, path, body, chunked=chunked)
            assert status == 413, (path, chunked, status, out)
            msg = out["error"]["message"]
            assert f"{MAX_BODY:,} bytes, --max-body-size" in msg and out["error"]["code"] == "request_too_large"
            assert took < 5, took
    status, out, _ = _post(server, "/tokenize", {"prompt": "the king speaks. " * 1000})
    assert status == 200 and out["count"] > 1000  # under the limit: read and answered
    assert _request(server, "/health")[0] == 200


@pytest.mark.integration
def test_health_answers_while_a_large_prompt_is_tokenized(server):
    """A /tokenize body just under the limit takes seconds to tokenize; /health, polled meanwhile, answers at once
    (tokenization runs in a worker thread). Before, the event loop tokenized and every poll waited for it."""
    text = "the king speaks. " * ((MAX_BODY - 1000) // 17)
    result: dict = {}

    def tokenize():
        result["t0"] = time.perf_counter()
        result["status"], out, _ = _post(server, "/tokenize", {"prompt": text})
        result["count"] = out.get("count")
        result["t1"] = time.perf_counter()

    th = threading.Thread(target=tokenize)
    th.start()
    polls = []
    while th.is_alive():
        t = time.perf_counter()
        status, _, took = _request(server, "/health", timeout=60)
        polls.append((t, t + took, status))
        time.sleep(0.05)
    th.join()
    assert result["status"] == 200 and result["count"] > len(text) // 17
    assert result["t1"] - result["t0"] > 1.0, "the tokenization was too quick to show anything; use a longer text"
    during = [p for p in polls if result["t0"] + 0.2 < p[0] and p[1] < result["t1"] - 0.3]
    assert len(during) >= 2 and all(s == 200 for _, _, s in during), (polls, result)


@pytest.mark.integration
def test_more_sequences_than_the_queue_holds_is_a_400_naming_max_queue(server):
    base = {"model": server.model, "max_tokens": 1, "temperature": 0}
    status, out, _ = _post(server, "/v1/completions", {**base, "prompt": ["To be"] * (MAX_QUEUE + 1)})
    assert status == 400 and out["error"]["param"] == "prompt", out
    assert f"--max-queue {MAX_QUEUE}" in out["error"]["message"] and "retry" not in out["error"]["message"]
    status, out, _ = _post(server, "/v1/completions", {**base, "prompt": "To be", "n": MAX_QUEUE + 1})
    assert status == 400 and out["error"]["param"] == "n" and f"--max-queue {MAX_QUEUE}" in out["error"]["message"]
    status, out, _ = _post(
        server, "/v1/chat/completions", {**base, "n": MAX_QUEUE + 1, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert status == 400 and out["error"]["param"] == "n"
    status, out, _ = _post(server, "/v1/completions", {**base, "prompt": ["To be"] * MAX_QUEUE})
    assert status == 200 and len(out["choices"]) == MAX_QUEUE  # as many as the queue holds: served


@pytest.mark.integration
def test_a_runaway_chat_template_is_a_400_for_that_request_and_the_server_goes_on(server):
    def chat(content: str):
        return _post(
            server,
            "/v1/chat/completions",
            {
                "model": server.model,
                "max_tokens": 2,
                "temperature": 0,
                "messages": [{"role": "user", "content": content}],
            },
        )

    status, out, took = chat("grow")
    assert status == 400 and out["error"]["param"] == "messages", out
    assert "size limit of" in out["error"]["message"] and "chat_template" in out["error"]["message"]
    assert took < 5
    from tasks.chat_template import TEMPLATE_SECONDS

    status, out, took = chat("spin")
    assert status == 400 and f"time limit of {TEMPLATE_SECONDS:g} s" in out["error"]["message"], out
    assert took < TEMPLATE_SECONDS + 5
    status, out, _ = chat("Speak, friend.")
    assert status == 200 and out["usage"]["prompt_tokens"] > 3
    assert _request(server, "/health")[0] == 200


@pytest.mark.integration
def test_a_chat_rendering_longer_than_the_context_can_hold_stops_there(server):
    """The server's size limit for a chat rendering is what its context can hold (context × the longest token),
    so a conversation that could never fit is refused as the template renders it, naming the context."""
    from tasks.store.model_artifact import load_tokenizer

    card = _request(server, "/v1/models")[1]["data"][0]
    ctx = card["context_length"]
    tok = load_tokenizer(Path(card["artifact"]))
    piece = max(len(tok.id_to_piece(i)) for i in range(tok.vocab_size))
    status, out, _ = _post(
        server,
        "/v1/chat/completions",
        {"model": server.model, "messages": [{"role": "user", "content": "x" * (ctx * piece + 1)}]},
    )
    assert status == 400 and out["error"]["param"] == "messages", out
    assert f"context of {ctx} tokens" in out["error"]["message"]


@pytest.mark.integration
def test_a_deeply_nested_body_is_a_400_without_a_traceback(server):
    """A prompt nesting 200,000 arrays (past json's own recursion limit) and one nesting 100 (under it, but deeper
    than any OpenAI request): 400 naming the depth limit, on every JSON endpoint, no traceback in the server log.
    Before: HTTP 500 "internal error: RecursionError" and two tracebacks (issue 53)."""
    from tasks.serving.bodies import MAX_JSON_DEPTH

    for depth in (200_000, 100, MAX_JSON_DEPTH + 1):
        nested = b"[" * depth + b"1" + b"]" * depth
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            body = b'{"model": "%s", "prompt": %s}' % (server.model.encode(), nested)
            status, out, _ = _request(server, path, body)
            assert status == 400, (depth, path, status, out)
            assert f"more than {MAX_JSON_DEPTH} levels deep" in out["error"]["message"], out
    # the deepest body a client sends (chat content parts; token-id lists) is still read
    status, out, _ = _post(server, "/tokenize", {"prompt": [[1, 2, 3]]})
    assert status != 400 or "levels deep" not in out["error"]["message"], out
    assert "Traceback" not in server.log() and "RecursionError" not in server.log()
    assert _request(server, "/health")[0] == 200


HEAD_TIMEOUT = 2.0  # the server fixture's --head-timeout (the default is 10 s)


@pytest.mark.integration
def test_slow_loris_connections_are_closed_and_health_answers(server):
    """Connections that never finish a request head (half a request line; headers a byte at a time) are closed
    --head-timeout seconds after they opened, and one idle after its response as well; /health answers throughout,
    and a client that sends its head at once is not affected. Before: held open for as long as the client liked
    (issue 53)."""
    import socket

    def connect() -> socket.socket:
        c = socket.create_connection(("127.0.0.1", server.port), timeout=HEAD_TIMEOUT * 4)
        return c

    def closed_within(c: socket.socket, limit: float) -> float:
        t0 = time.perf_counter()
        try:
            while c.recv(4096):  # a server that answered (408, 400) still closes; data before EOF is allowed
                pass
        except ConnectionResetError:
            pass
        dt = time.perf_counter() - t0
        assert dt < limit, f"still open after {dt:.1f} s"
        return dt

    half, trickle = connect(), connect()
    half.sendall(b"POST /v1/completions HT")
    t_open = time.perf_counter()
    for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ":  # one byte every 0.2 s: past the deadline
        try:
            trickle.sendall(bytes([b]))
        except OSError:
            break
        time.sleep(0.2)
        if time.perf_counter() - t_open > HEAD_TIMEOUT * 2:
            break
    assert _request(server, "/health")[0] == 200  # served beside them
    closed_within(half, HEAD_TIMEOUT * 3)
    closed_within(trickle, HEAD_TIMEOUT * 3)
    # keep-alive: after a complete response the next head has the same deadline
    ka = connect()
    ka.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ka.recv(4096).startswith(b"HTTP/1.1 200")
    ka.sendall(b"GET /heal")
    closed_within(ka, HEAD_TIMEOUT * 3)
    assert "no complete request head" in server.log() and "Traceback" not in server.log()


def test_head_timeout_must_be_positive(capsys):
    from tasks.cli import main

    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", ".", "--head-timeout", bad])
        assert exit_.value.code == 2 and "--head-timeout" in capsys.readouterr().err


def test_json_depth_counts_levels_without_recursion():
    from tasks.serving.bodies import MAX_JSON_DEPTH, json_depth

    assert [json_depth(v, 32) for v in (1, {}, {"a": 1}, {"prompt": [[1, 2]]}, [[[]]])] == [0, 1, 1, 3, 3]
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert json_depth(chat, MAX_JSON_DEPTH) == 5
    deep: list = []
    for _ in range(100_000):  # far past Python's recursion limit: counted level by level, stopping past the limit
        deep = [deep]
    assert json_depth(deep, MAX_JSON_DEPTH) == MAX_JSON_DEPTH + 1
