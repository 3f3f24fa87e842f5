"""Artifacts at rest: the content-addressed store (`artifacts`), lineage, model artifacts, the MindRecord
block reader (`reader`), code versions computed from the import graph (`codeversion`) and TensorBoard event
files (`tensorboard`: training's scalars, eval's scores)."""
