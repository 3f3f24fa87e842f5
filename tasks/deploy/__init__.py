"""Deployment without MindSpore: the ONNX decoder with a KV cache written from the weights
(`onnx_decoder`, numpy + onnx) and generation with onnxruntime (`onnx_generate`)."""
