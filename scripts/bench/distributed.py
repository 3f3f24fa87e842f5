"""Training throughput of four layouts on this machine: dp=1 vs dp=2 vs dp=2 with optimizer-state sharding
(ZeRO-1) vs tp=2, communication and per-rank peak RSS measured separately.

Same model and the same global batch for every layout (`tiny-llama-bench` by default: vocab 8192,
hidden 256, 4 layers; global batch 8 × seq 256, random tokens, fp32), the same compiled train step
and AdamW as `tasks.training.trainer.fit` builds for a mesh, with the fused CPU kernels as the trainer's
default (`--no-fused`: MindSpore's own ops, pretrain.train.fused_kernels: false):

- dp1: one process, no msrun, OMP_NUM_THREADS = cpu_count;
- dp2: 2 msrun workers, each a micro batch of global/2 (different random tokens per rank),
  gradients averaged with `nn.DistributedGradReducer`;
- dp2zero: dp2 with `parallel.optimizer_shard: true` (tasks/training/zero.py ShardedAdamW): each rank
  keeps the AdamW moments of its half of the flat parameter buffer, updates that half of the parameters
  in place (model/train_kernels.cc ZeroAdamW; without a compiler an fp32 master copy of the half), and the halves
  are AllGathered (world group) back into the parameters after every update;
- tp2: 2 msrun workers, each the whole global batch through its tensor-parallel half of the model.

tokens/s = global batch × seq × steps / rank 0's wall time of `steps` steps after `warmup` steps
(compilation). After the training steps the same workers time their communication alone:
dp2 the gradient all-reduce (a jit'd `DistributedGradReducer` over gradient-shaped tensors),
dp2zero the gradient all-reduce as its step issues it (one AllReduce per gradient, chained) plus the
parameter rebuild as the step runs it (one small graph per chunk: AllGather + assign; `param_rebuild_s`
also times one AllGather of the whole share and an AllReduce of zero-padded shares, what a data-parallel
group that is not the world group would need), tp2 the 4 × num_layers activation AllReduces of [batch, seq, hidden] one
step performs (2 forward + 2 backward per layer) plus the grad-norm scalar; each averaged over `--comm-repeats`.
`comm_share` = comm seconds per step / step seconds. Prints one JSON line (progress on stderr).

    python scripts/bench/distributed.py [--preset tiny-llama-bench] [--batch 8] [--seq 256] [--steps 25] [--warmup 2]
    python scripts/bench/distributed.py --preset tiny --steps 3 --warmup 1      # a smoke run
    # the per-rank memory saving of optimizer sharding, on an ~84M-parameter bench-only model:
    python scripts/bench/distributed.py --preset zero-bench --batch 4 --seq 64 --steps 3 --warmup 1 \
        --comm-repeats 3 --layouts dp2,dp2zero

With 2 workers on 2 cores each worker gets 1 thread where dp1 gets 2, so on such a machine the
ideal speedup is about 1× at best; the numbers measure the parallel overhead, not a gain.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[0] = str(REPO)  # the repo, not scripts/bench (msrun starts this file as a worker script)

from tasks.training.hardware import peak_rss_bytes  # noqa: E402  (after the sys.path change)

LAYOUTS = {"dp1": (1, 1), "dp2": (2, 1), "dp2zero": (2, 1), "tp2": (1, 2)}
ZERO = {"dp2zero"}  # parallel.optimizer_shard: true
# bench-only models (--preset accepts these besides model/config.py's PRESETS)
BENCH_PRESETS = {
    # ~84M parameters, where the AdamW moments (8 bytes per parameter) are hundreds of MB: the per-rank memory
    # saving of optimizer sharding stands clear of the runtime's own ~1 GB. Run it at a short sequence, e.g.
    # --preset zero-bench --batch 4 --seq 64 --steps 3 --warmup 1 --layouts dp2,dp2zero
    "zero-bench": dict(
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=2816,
        num_layers=6,
        num_heads=16,
        num_kv_heads=4,
        max_seq_length=256,
    ),
}


def model_config(name: str):
    from model.config import ModelConfig

    return ModelConfig.from_dict(BENCH_PRESETS[name]) if name in BENCH_PRESETS else ModelConfig.from_name(name)


def _sync(x=None) -> None:
    import mindspore as ms

    try:
        ms.runtime.synchronize()
    except Exception:  # noqa: BLE001 — older runtimes: fall back to reading a result back
        if x is not None:
            x.asnumpy()


def _time_comm(fn, args, repeats: int) -> float:
    """Mean seconds of one call of the jit'd `fn(*args)` (after one untimed compile call), ranks aligned."""
    out = fn(*args)
    _sync(out[-1] if isinstance(out, tuple) else out)
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
        _sync(out[-1] if isinstance(out, tuple) else out)
    return (time.perf_counter() - t0) / repeats


def worker(a: argparse.Namespace) -> None:
    """One rank of one layout: timed training steps, then communication alone; writes OUT/<layout>_rank<r>.json."""
    import numpy as np

    from model.runtime import setup_mindspore

    setup_mindspore(seed=0)  # ms.set_device("CPU") before Mesh.init
    import mindspore as ms
    from mindspore import nn, ops

    from tasks.modeling.build import build_network
    from tasks.runtime.mesh import Mesh
    from tasks.training.layerwise import causal_lm_train_step

    dp, tp = LAYOUTS[a.layout]
    mesh = Mesh.init(dp, tp, a.layout in ZERO) if dp * tp > 1 else Mesh()
    cfg = model_config(a.preset)
    seq = min(a.seq, cfg.max_seq_length)
    micro = a.batch // dp
    # as the trainer (pretrain.train.fused_kernels): the fused CPU kernels in the model and the in-place AdamW update
    built = build_network("llama", cfg, seed=0, fused_kernels=not a.no_fused, mesh=mesh)
    net = built.net
    params = net.trainable_params()
    # the trainer's defaults (AdamW, clip 1.0), gradients averaged over dp, clipped by the norm over tp slices
    step_fn = causal_lm_train_step(net, params, mesh=mesh, in_place=built.kernels.optimizer)
    # data-parallel replicas read different batches, tensor-parallel ranks the same ones
    rng = np.random.default_rng(1000 + mesh.dp_index)
    total = a.warmup + a.steps
    data = rng.integers(0, cfg.vocab_size, (total, micro, seq + 1)).astype(np.int32)
    batches = [[(d[:, :-1], d[:, 1:])] for d in data]

    log = lambda msg: print(f"[{a.layout} rank {mesh.rank}] {msg}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    for s in range(a.warmup):
        step_fn(batches[s], 1e-4, s + 1)
    warmup_s = time.perf_counter() - t0
    log(f"{a.warmup} warm-up steps in {warmup_s:.1f}s, peak RSS {peak_rss_bytes() / 2**20:.0f} MiB")
    mesh.barrier()
    t0 = time.perf_counter()
    for s in range(a.warmup, total):
        loss = step_fn(batches[s], 1e-4, s + 1)[0]  # float(): waits for the step
    dt = time.perf_counter() - t0
    step_s = dt / a.steps
    train_rss = peak_rss_bytes()  # the training's own peak, before the communication timing below allocates its buffers
    log(f"{a.steps} steps in {dt:.2f}s ({step_s:.3f} s/step), loss {loss:.4f}")

    comm, rebuild = None, None
    if a.layout in ("dp2", "dp2zero"):
        reducer = nn.DistributedGradReducer(params, mean=True, degree=mesh.dp, group=mesh.dp_group)
        grad_sum = ops.AllReduce(group=mesh.dp_group)

        @ms.jit
        def reduce_grads(grads):
            if a.layout == "dp2":
                return reducer(grads)
            out, prev = [], None  # as TrainStep issues them under ZeRO-1: chained, the same order on every rank
            for g in grads[::-1]:
                r = grad_sum(g if prev is None else ops.depend(g, prev))
                prev = r
                out.append(r * 0.5)
            return tuple(out[::-1])

        grads = ms.mutable(tuple(ops.ones_like(p) for p in params))
        mesh.barrier()
        comm = _time_comm(reduce_grads, (grads,), a.comm_repeats)
        del grads
        n_bytes = sum(int(np.prod(p.shape)) * 4 for p in params)
        log(
            f"gradient all-reduce ({len(params)} tensors, {n_bytes / 1e6:.1f} MB"
            f"{', chained' if a.layout == 'dp2zero' else ''}): {comm * 1e3:.1f} ms"
        )
    if a.layout == "dp2zero":
        from mindspore.communication import GlobalComm

        gather = ops.AllGather(group=GlobalComm.WORLD_COMM_GROUP)
        world_sum = ops.AllReduce(group=GlobalComm.WORLD_COMM_GROUP)

        @ms.jit
        def all_gather(x):
            return gather(x)

        @ms.jit
        def all_reduce_padded(x):
            return world_sum(x)

        shard = step_fn.optimizer.shard
        mesh.barrier()
        step_rebuild_s = _time_comm(step_fn._rebuild, (), a.comm_repeats)  # what the step runs: chunk by chunk
        mesh.barrier()
        gather_s = _time_comm(all_gather, (ms.Tensor(np.zeros(shard, np.float32)),), a.comm_repeats)
        mesh.barrier()
        padded_s = _time_comm(all_reduce_padded, (ms.Tensor(np.zeros(shard * mesh.dp, np.float32)),), a.comm_repeats)
        comm += step_rebuild_s
        rebuild = {
            "step_rebuild": step_rebuild_s,
            "allgather": gather_s,
            "allreduce_zero_padded": padded_s,
            "shard_elements": shard,
            "chunks": len(step_fn.optimizer.chunks),
        }
        log(
            f"parameter rebuild of {shard} elements per rank: as the step runs it ({len(step_fn.optimizer.chunks)} "
            f"chunks, AllGather + assign) {step_rebuild_s * 1e3:.1f} ms; one AllGather of the whole share "
            f"{gather_s * 1e3:.1f} ms, AllReduce of zero-padded shares {padded_s * 1e3:.1f} ms"
        )
    elif a.layout == "tp2":
        all_reduce = ops.AllReduce(group=mesh.tp_group)
        n = 4 * cfg.num_layers  # per layer: attention + MLP outputs forward, their inputs' gradients backward

        @ms.jit
        def activations(x):
            for _ in range(n):  # a chain (zeros stay zeros), as in the step: no two calls can be merged
                x = all_reduce(x)
            return x

        @ms.jit
        def grad_norm(x):
            return all_reduce(x)

        x = ms.Tensor(np.zeros((micro, seq, cfg.hidden_size), np.float32))
        mesh.barrier()
        act = _time_comm(activations, (x,), a.comm_repeats)
        scalar = _time_comm(grad_norm, (ms.Tensor(np.zeros((1,), np.float32)),), a.comm_repeats)
        comm = act + scalar
        log(
            f"{n} activation all-reduces of {[micro, seq, cfg.hidden_size]}: {act * 1e3:.1f} ms, "
            f"grad-norm scalar: {scalar * 1e3:.2f} ms"
        )
    mesh.barrier()
    out = {
        "rank": mesh.rank,
        "fused_kernels": built.kernels.fused,
        "step_s": step_s,
        "wall_s": dt,
        "warmup_s": warmup_s,
        "loss": loss,
        "comm_s_per_step": comm,
        "param_rebuild_s": rebuild,
        "peak_rss_bytes": train_rss,
    }
    (Path(a.out) / f"{a.layout}_rank{mesh.rank}.json").write_text(json.dumps(out))


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):  # held open together: n distinct ports
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-llama-bench")
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over dp ranks)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--comm-repeats", type=int, default=10)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of " + ",".join(LAYOUTS))
    ap.add_argument(
        "--no-fused",
        action="store_true",
        help="MindSpore's own ops only (pretrain.train.fused_kernels: false; a machine without g++)",
    )
    # a worker's own flags: none may be a prefix of one of msrun's (--worker_num, --rank_table_file, ...),
    # since msrun's argparse reads abbreviations from the script's arguments too
    ap.add_argument("--run-layout", dest="layout", choices=list(LAYOUTS), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.batch % 2:
        ap.error("--batch must be even (dp=2 splits it over 2 ranks)")
    if a.layout:
        worker(a)
        return

    from tasks.config.schema import ParallelSection
    from tasks.runtime.distributed import run_msrun

    layouts = [x for x in a.layouts.split(",") if x]
    if not layouts or set(layouts) - set(LAYOUTS):
        ap.error(f"--layouts: choose from {','.join(LAYOUTS)}")
    cfg = model_config(a.preset)
    seq = min(a.seq, cfg.max_seq_length)
    tmp = Path(tempfile.mkdtemp(prefix="bench_distributed_"))
    out = tmp / "out"
    out.mkdir()
    common = [
        "--preset",
        a.preset,
        "--batch",
        str(a.batch),
        "--seq",
        str(a.seq),
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
        "--comm-repeats",
        str(a.comm_repeats),
        "--out",
        str(out),
        *(["--no-fused"] if a.no_fused else []),
    ]
    me = str(Path(__file__).resolve())
    cpus = os.cpu_count() or 1
    ports = dict(zip(("dp2", "dp2zero", "tp2"), _free_ports(3)))
    res, wall = {}, {}
    for layout in layouts:
        dp, tp = LAYOUTS[layout]
        print(
            f"[bench] {layout}: preset {a.preset}, global batch {a.batch} × seq {seq}, "
            f"{a.warmup} warm-up + {a.steps} steps",
            file=sys.stderr,
            flush=True,
        )
        t0 = time.perf_counter()
        args = [me, "--run-layout", layout, *common]
        if layout == "dp1":
            env = dict(os.environ, GLOG_v=os.environ.get("GLOG_v", "3"), OMP_NUM_THREADS=str(cpus))
            proc = subprocess.run([sys.executable, *args], env=env, cwd=str(REPO))
            err = None if proc.returncode == 0 else f"dp1 worker exited with code {proc.returncode}"
        else:
            par = ParallelSection(data_parallel=dp, tensor_parallel=tp, device_num=dp * tp, master_port=ports[layout])
            err = run_msrun(args, par, tmp / f"logs_{layout}", label=layout, relay=False)
        if err:
            print(f"[bench] {layout} failed:\n{err}", file=sys.stderr, flush=True)
            sys.exit(1)
        wall[layout] = time.perf_counter() - t0
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob(f"{layout}_rank*.json"))]
        res[layout] = {
            "rank0": next(r for r in ranks if r["rank"] == 0),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
            "rank_peak_rss_bytes": [r["peak_rss_bytes"] for r in sorted(ranks, key=lambda r: r["rank"])],
        }
        print(
            f"[bench] {layout}: {res[layout]['rank0']['step_s']:.3f} s/step ({wall[layout]:.0f}s in all)",
            file=sys.stderr,
            flush=True,
        )
    shutil.rmtree(tmp, ignore_errors=True)

    tokens = a.batch * seq
    r0 = {k: v["rank0"] for k, v in res.items()}
    tps = {k: tokens / v["step_s"] for k, v in r0.items()}
    multi = [k for k in ("dp2", "dp2zero", "tp2") if k in res]
    from tasks.training.memory import Layout, estimate

    out = {
        "bench": "distributed",
        "preset": a.preset,
        "params": cfg_params(cfg),
        "global_batch": a.batch,
        "seq": seq,
        "steps": a.steps,
        "warmup": a.warmup,
        "cpu_count": cpus,
        "fused_kernels": all(v["rank0"]["fused_kernels"] for v in res.values()),
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "step_s": {k: round(v["step_s"], 4) for k, v in r0.items()},
        "comm_s_per_step": {k: round(r0[k]["comm_s_per_step"], 5) for k in multi},
        "comm_share": {k: round(r0[k]["comm_s_per_step"] / r0[k]["step_s"], 3) for k in multi},
    }
    if "dp1" in res:
        out["speedup"] = {k: round(tps[k] / tps["dp1"], 3) for k in multi}
    for k in ("dp2", "dp2zero"):
        if k in res:
            out.setdefault("rank_peak_rss_bytes", {})[k] = res[k]["rank_peak_rss_bytes"]
            est = estimate(
                cfg,
                micro_batch=a.batch // 2,
                seq=seq,
                layout=Layout(dp=2, optimizer_shard=k == "dp2zero"),
                fused_kernels=not a.no_fused,
            )
            out.setdefault("plan_estimate_bytes", {})[k] = est.total
            out.setdefault("plan_error", {})[k] = round(est.total / max(res[k]["rank_peak_rss_bytes"]) - 1, 3)
    if "dp2zero" in res:
        out["dp2zero_param_rebuild_s"] = {
            k: (round(v, 5) if isinstance(v, float) else v) for k, v in r0["dp2zero"]["param_rebuild_s"].items()
        }
    if "dp2" in res and "dp2zero" in res:
        saving = max(res["dp2"]["rank_peak_rss_bytes"]) - max(res["dp2zero"]["rank_peak_rss_bytes"])
        n = out["params"]
        out["zero_rss_saving_bytes"] = saving
        # what sharding can save per rank at dp=2: half the moments (4N) with the in-place kernel; 2N on the
        # fallback path, whose fp32 master share takes back 2N
        out["zero_rss_saving_of_4n"] = round(saving / (4 * n), 3)
        out["zero_rss_saving_of_2n"] = round(saving / (2 * n), 3)
    print(
        json.dumps(
            {
                **out,
                "warmup_s": {k: round(v["warmup_s"], 1) for k, v in r0.items()},
                "loss": {k: round(v["loss"], 4) for k, v in r0.items()},
                "peak_rss_bytes": {k: v["peak_rss_bytes"] for k, v in res.items()},
                "wall_s": {k: round(v, 1) for k, v in wall.items()},
                "note": (
                    f"{cpus} cores: dp1 is one process with {cpus} threads; dp2/dp2zero/tp2 are 2 msrun workers "
                    "sharing the same "
                    f"cores (OMP_NUM_THREADS={max(1, cpus // 2)} each), so the ideal speedup here is at most ~1x. "
                    "comm_s_per_step is timed alone after training (no overlap with compute); peak_rss_bytes is "
                    "per process (max over ranks), VmHWM after the training steps (before the communication timing)."
                ),
            }
        )
    )


def cfg_params(cfg) -> int:
    """Trainable parameters of the unsplit model (embedding, layers, final norm, untied head)."""
    h, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return cfg.num_layers * per_layer + cfg.vocab_size * h * (1 if cfg.tie_embeddings else 2) + h


if __name__ == "__main__":
    main()
