"""The pipeline's work, in rooms (MindSpore is imported only where a room computes):

    tasks/config/     the pipelines.yaml schema, validated before any compute
    tasks/stages/     the stage table, and one module (or package) per stage: data, pretrain, finetune,
                      evaluate, export, convert; each exposes stage_key(...) and run(...)
    tasks/store/      the artifact store, lineage, model artifacts, the MindRecord reader, code versions
    tasks/training/   the shared training loop, optimizer, checkpoints, memory planner, TensorBoard events
    tasks/runtime/    the child-process supervisor, msrun launch and rank layout
    tasks/deploy/     the ONNX decoder builder and onnxruntime generation (no MindSpore)
    tasks/serving/    the OpenAI-compatible HTTP server
    tasks/cli/        `msllm`: argument parsing and commands; nothing imports it

Layering (tests/test_imports.py): model/ imports neither tasks/ nor flows/; tasks/ never imports
flows/; nothing in tasks/ imports tasks/cli; no import cycles.
"""
