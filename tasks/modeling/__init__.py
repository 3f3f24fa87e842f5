"""Building and loading networks, below training, eval, export and serving: `build_network` (build → weights →
kernel conversion → tensor-parallel split), `load_network` (a model artifact's network for inference), the
tensor-parallel plan (`parallelize`) and merging LoRA adapters into a model artifact (`merge`). Training imports it;
serving, export, eval and predict import it and never tasks/training (tests/test_imports.py)."""
