"""`msllm serve`: a trained model behind the OpenAI HTTP API (completions, chat, streaming).

    msllm serve [ARTIFACT] [--host 127.0.0.1] [--port 8000] [--adapter NAME=FINETUNE ...]

Modules:
    backends.py  what runs the model: an export artifact through onnxruntime with its KV
                 cache (the default: the pipeline's newest export), or a model artifact
                 (pretrain / merged / convert) through MindSpore's `model.generate.Generator`
    engine.py    one worker thread owns the backend: a request queue, up to `max_active`
                 sequences at once, one token each per round (onnxruntime: one batched call
                 for all of them; MindSpore: one call each, in turn), each with its own KV
                 cache and seeded sampler; stop strings, incremental detokenisation
    adapters.py  `--adapter`: LoRA finetunes of the base served as their own model ids (unmerged on a
                 MindSpore base: one network, per-sequence A/B; merged on an export; checked against the
                 base before anything loads)
    app.py       the FastAPI app (request validation with OpenAI's error shape, SSE
                 streaming), `serve()` under uvicorn with a graceful SIGTERM drain,
                 and `cli_serve` for the command line
"""
