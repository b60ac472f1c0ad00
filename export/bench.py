"""Time the exported GNN on CPU with onnxruntime and print JSON.

    python -m hlb.export.bench [--devices 1000 10000] [--candidates 64] [--threads 1] [--repeats 30]

Exports a randomly initialised model of the default size, builds mixed clusters from the
simulator's catalogue (with 20% of devices running a task and 200 pending tasks), and reports
per size: feature building (numpy), the encoder run, and the speed head over ``--candidates``
devices and over every device (what one new task shape costs; prior features included), as p50 and
p99 in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.gnn.inference import GnnModel, load_model
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import default_profiles
from hlb.export.model import HlbGnn
from hlb.export.onnx_export import ExportInfo, export_model
from hlb.sim.catalogue import load_catalogue
from hlb.sim.topology import mixed_cluster
from hlb.v1 import events_pb2 as ev

MODELS = ("V100-SXM2-16GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "T4", "TPU-v4", "Gaudi2-HL225H")


def cluster(devices: int, pending: int = 200, seed: int = 0) -> InfraGraph:
    catalogue = load_catalogue()
    per_model = {m: devices // len(MODELS) for m in MODELS if m in catalogue.profiles}
    graph = InfraGraph()
    for event in mixed_cluster(catalogue, per_model).to_events("c0"):
        graph.apply_telemetry(event)
    rng = np.random.default_rng(seed)
    rows = graph.devices.live_rows()
    for i, row in enumerate(rng.choice(rows, size=len(rows) // 5, replace=False)):
        task = graph.add_task(ev.TaskSpec(id=f"run{i}", memory_per_device_gb=4, work_ref_s=3600), "c0")
        graph.bind(task, [int(row)])
    for i in range(pending):
        spec = ev.TaskSpec(id=f"wait{i}", num_devices=int(rng.choice([1, 2, 4, 8])), work_ref_s=600)
        graph.add_task(spec, "c0")
    return graph


def timed(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    fn()  # warm-up: onnxruntime plans memory per shape on the first run
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000.0)
    return {"p50_ms": float(np.percentile(times, 50)), "p99_ms": float(np.percentile(times, 99))}


def measure(model: GnnModel, devices: int, candidates: int, repeats: int) -> dict[str, object]:
    """Feature building, encoder and scorer times on one cluster size."""
    graph = cluster(devices)
    inputs = feat.encoder_inputs(graph)
    emb, context = model.encode(inputs)
    spec = ev.TaskSpec(id="new", num_devices=2, memory_per_device_gb=8, work_ref_s=600, workload_class="lm-bs20")
    rows = graph.feasible_rows(spec)[:candidates]
    shape_x = feat.shape_features(spec)
    profiles = default_profiles()

    def predict() -> object:
        prior = feat.prior_features(spec, graph, rows, profiles)
        return model.predict(shape_x, emb[inputs.device_positions(rows)], prior, context)

    def predict_all() -> object:
        every = inputs.device_rows
        return model.predict(shape_x, emb, feat.prior_features(spec, graph, every, profiles), context)

    return {
        "devices": len(graph.devices),
        "hosts": len(graph.hosts),
        "tasks": len(inputs.task_ids),
        "widest_list": max(n.index.shape[1] for n in inputs.lists.values()),
        "features": timed(lambda: feat.encoder_inputs(graph), repeats),
        "encoder": timed(lambda: model.encode(inputs), repeats),
        "scorer_with_prior_features": timed(predict, repeats * 10),
        "scorer_every_device": timed(predict_all, repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m hlb.export.bench")
    parser.add_argument("--devices", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        export_model(HlbGnn.random(), Path(folder), ExportInfo("bench", "none: randomly initialised"))
        model = load_model(Path(folder), intra_op_threads=args.threads, providers=["CPUExecutionProvider"])
        sizes = [measure(model, n, args.candidates, args.repeats) for n in args.devices]
    print(json.dumps({"threads": args.threads, "candidates": args.candidates, "sizes": sizes}, indent=2))


if __name__ == "__main__":
    main()
