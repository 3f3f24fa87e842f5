"""The data stage's tokenization fan-out as mapped Prefect tasks on Dask (prefect-dask's DaskTaskRunner).

The corpus is read, cleaned and split into chunks in the flow; each chunk is tokenized by
a mapped `tokenize-chunk` task on a Dask worker; the flow then packs the returned token
streams in chunk order and writes the shards and manifest. The bytes are the same as the
in-process path (same chunks, same order). With `data.dask_address` the tasks run on that
existing cluster (its workers must see the same file system); otherwise on a LocalCluster
of `data.num_workers` processes.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect_dask import DaskTaskRunner

from tasks.config.schema import PipelineConfig
from tasks.stages.data.tokenizer import tokenize_chunk
from tasks.stages.runner import prepare
from tasks.store.artifacts import ArtifactStore


@task(name="tokenize-chunk", cache_policy=NO_CACHE, persist_result=False, result_serializer="json")
def tokenize_chunk_task(spec: dict) -> str:
    return tokenize_chunk(spec)


@flow(name="data-dask", log_prints=True, result_serializer="json")
def data_dask_flow(cfg_json: dict, artifacts: str, tokenizer_model: str | None = None) -> str:
    cfg = PipelineConfig.model_validate(cfg_json)  # a flow parameter: JSON

    def map_fn(fn, specs):
        return [f.result() for f in tokenize_chunk_task.map(specs)]

    return str(prepare("data", ArtifactStore(artifacts), cfg, tokenizer_model=tokenizer_model).run(map_fn=map_fn))


def dask_runner(cfg: PipelineConfig):
    if cfg.data.dask_address:
        return DaskTaskRunner(address=cfg.data.dask_address)
    return DaskTaskRunner(
        cluster_kwargs={
            "n_workers": cfg.data.num_workers,
            "threads_per_worker": 1,
            "processes": True,
            "dashboard_address": None,
        }
    )


def run_on_dask(cfg: PipelineConfig, artifacts: str, tokenizer_model: str | None = None) -> str:
    """Run the data stage with its chunks mapped over Dask; returns the artifact path."""
    flow_ = data_dask_flow.with_options(task_runner=dask_runner(cfg))
    out = flow_(cfg_json=cfg.model_dump(mode="json"), artifacts=artifacts, tokenizer_model=tokenizer_model)
    return out
