"""Artifacts at rest: the content-addressed store (`artifacts`), lineage, model artifacts, the MindRecord
block reader (`reader`) and code versions computed from the import graph (`codeversion`)."""
