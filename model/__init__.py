"""The LLaMA model package: config + presets (`model.config`), the MindSpore model (`model.llama`), and an
explicit registry (`model.registry`). Each name is imported from the module that defines it:

    from model.config import ModelConfig
    from model.registry import build_model
    model = build_model("llama", ModelConfig.from_name("tiny"), seed=0)

`model.config` and `model.registry` import without MindSpore (the pipeline config
validates presets in milliseconds); `model.llama` imports MindSpore.
"""
