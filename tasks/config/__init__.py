"""The `pipelines.yaml` schema, validated before any compute.

Importable without MindSpore, so the CLI and the flows validate a pipeline in milliseconds:

    from tasks.config.loader import resolve_pipeline
    cfg = resolve_pipeline("pipelines.yaml", "demo", overrides=["pretrain.train.loop.max_steps=10"])
    cfg.pretrain.train.loop.max_steps  -> 10

Rooms: `schema` (one pydantic model per section, a docstring per field), `yaml12` (YAML 1.2 scalars),
`loader` (the file, `base:`, `--set`, the `train` inheritance, old-key migration errors), `rules` (the
cross-key rules). Every error names its YAML path and a fix; all errors are reported together. Each name is
imported from the module that defines it (this package re-exports nothing).
"""
