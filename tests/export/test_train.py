"""hlb train: the logged examples, the loss, learning a speed that depends on the device, and a tiny
run end to end through ``hlb export`` into the daemon's GNN policy.

Every test runs torch on one thread: the test machine's cores are few and shared, and torch's
threads then wait on each other (an epoch of the synthetic data takes seconds instead of 0.1 s).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hlb.daemon.decide.gnn import features as feat
from hlb.v1 import events_pb2 as ev
from tests.export import graphs

torch = pytest.importorskip("torch", reason="training needs the export extra: pip install 'hlb[export]'")
pytest.importorskip("tqdm", reason="training needs the export extra: pip install 'hlb[export]'")

from hlb.cli import main  # noqa: E402
from hlb.daemon.decide.gnn.inference import load_model  # noqa: E402
from hlb.export import dataset, recipe, train  # noqa: E402
from hlb.export.dataset import Episode, Example  # noqa: E402
from hlb.export.model import load_checkpoint  # noqa: E402
from hlb.export.train_cli import PRESET_NAMES  # noqa: E402
from hlb.sim.catalogue import load_catalogue  # noqa: E402
from hlb.sim.policies import make_sim_policy  # noqa: E402
from hlb.sim.scenarios import build_cluster, build_workload  # noqa: E402
from hlb.sim.simulator import SimConfig, Simulation  # noqa: E402

TINY = recipe.TINY_STAGES[0]
REFERENCE_PEAK_TFLOPS = 125.0  # nameplate speed 1: the V100 of hlb's profiles


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_presets_match_the_command_line() -> None:
    assert set(PRESET_NAMES) == set(recipe.PRESETS)
    for config in recipe.PRESETS.values():
        recipe.check_stages(config.stages)  # training families on clusters that can be built
    default, few = recipe.PRESETS["default"].stages, recipe.PRESETS["few-gangs"].stages
    assert default[: len(few)] == few  # the recipe shipped before, and gangs
    assert len(default) > len(few)
    assert all(stage.gangs_only for stage in default[len(few) :])


def test_parse_stage_and_check_stages_refuse_bad_or_held_out_stages() -> None:
    assert recipe.parse_stage("mixed:64/gavel/0.8/200") == recipe.Stage("mixed:64", "gavel", 0.8, 200)
    gangs = recipe.parse_stage("mixed:256/gavel/1/600/gangs")
    assert gangs == recipe.Stage("mixed:256", "gavel", 1.0, 600, gangs_only=True)
    assert gangs.label().endswith("gangs only")
    bad_stages = ("mixed:64/gavel/0.8", "mixed:64/gavel/x/200", "mixed:64/gavel/0/200", "mixed:64/gavel/0.8/0")
    for bad in (*bad_stages, "mixed:64/gavel/0.8/200/singles"):
        with pytest.raises(ValueError, match="stage"):
            recipe.parse_stage(bad)
    with pytest.raises(ValueError, match="held out"):
        recipe.check_stages([recipe.Stage("mixed:8", "philly", 0.8, 10)])
    with pytest.raises(ValueError, match="nosuch"):
        recipe.check_stages([recipe.Stage("nosuch:8", "gavel", 0.8, 10)])
    with pytest.raises(ValueError, match="no stages"):
        recipe.check_stages([])


# -- the loss ------------------------------------------------------------------------------------


def test_gaussian_nll_is_log_sigma_plus_half_the_squared_z_score() -> None:
    out = torch.tensor([[0.5, math.log(2.0)], [-1.0, 0.0], [0.0, -1.0]])
    labels = torch.tensor([1.5, -1.0, 0.5])
    by_hand = [
        math.log(2.0) + 0.5 * (1.0 / 2.0) ** 2,  # 1 off, sd 2
        0.0,  # exact, sd 1
        -1.0 + 0.5 * (0.5 / math.exp(-1.0)) ** 2,  # 0.5 off, sd 1/e
    ]
    assert float(train.gaussian_nll(out, labels)) == pytest.approx(sum(by_hand) / 3, rel=1e-6)


def test_gaussian_nll_is_lowest_where_the_sd_equals_the_error() -> None:
    log_sigma = torch.tensor([math.log(0.3)], requires_grad=True)
    out = torch.stack([torch.zeros(1), log_sigma], dim=1)
    train.gaussian_nll(out, torch.tensor([0.3])).backward()  # type: ignore[no-untyped-call]
    assert log_sigma.grad is not None
    assert float(log_sigma.grad) == pytest.approx(0.0, abs=1e-6)
    wider, narrower = (torch.tensor([[0.0, math.log(s)]]) for s in (0.6, 0.15))
    at_error = float(train.gaussian_nll(out.detach(), torch.tensor([0.3])))
    assert at_error < float(train.gaussian_nll(wider, torch.tensor([0.3])))
    assert at_error < float(train.gaussian_nll(narrower, torch.tensor([0.3])))


def test_weighted_gaussian_nll_counts_each_example_as_many_times_as_its_weight() -> None:
    out = torch.tensor([[0.5, math.log(2.0)], [-1.0, 0.0], [0.0, -1.0]])
    labels = torch.tensor([1.5, -1.0, 0.5])
    weights = torch.tensor([1.0, 4.0, 2.0])
    repeated = [0, 1, 1, 1, 1, 2, 2]
    expected = float(train.gaussian_nll(out[repeated], labels[repeated]))
    assert float(train.gaussian_nll(out, labels, weights)) == pytest.approx(expected, rel=1e-6)
    unweighted = float(train.gaussian_nll(out, labels))
    assert float(train.gaussian_nll(out, labels, torch.ones(3))) == pytest.approx(unweighted)


# -- logged simulations --------------------------------------------------------------------------


def logged_tiny_episode(monkeypatch: pytest.MonkeyPatch, seed: int) -> tuple[Episode, Simulation]:
    """``simulate`` on the tiny stage, and the simulation it ran (to read what happened)."""
    ran: list[Simulation] = []

    class Kept(Simulation):
        def run(self) -> Any:
            ran.append(self)
            return super().run()

    monkeypatch.setattr(dataset, "Simulation", Kept)
    episode = dataset.simulate(load_catalogue(), TINY.cluster, TINY.workload, TINY.load, TINY.jobs, seed)
    (sim,) = ran
    return episode, sim


def test_labels_are_the_log_of_prior_over_observed_run_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recomputed from the simulation's records by hand: the prior run time is the work over the
    gang's slowest device's nameplate speed (peak TFLOPS over the V100's), per device of the gang;
    the observed one is from the task's start to its end. Examples come in the order tasks end."""
    seed = 1001
    episode, sim = logged_tiny_episode(monkeypatch, seed)
    catalogue = load_catalogue()
    inventory = build_cluster(TINY.cluster, catalogue)
    work = {t.id: t.work_ref_s for t in build_workload(TINY.workload, seed, TINY.jobs, catalogue, inventory, TINY.load)}
    peak = {d.id: d.peak_tflops for d in inventory.devices}
    finished = sorted((r for r in sim.result().tasks if r.state == "finished"), key=lambda r: r.finish_s)
    assert len(finished) == TINY.jobs  # gavel: one task per job, every one ends
    assert any(r.num_devices > 1 for r in finished)  # a gang among them

    assert len(episode.examples) == len(finished)
    for example, record in zip(episode.examples, finished, strict=True):
        slowest = min(peak[d] for d in record.device_ids) / REFERENCE_PEAK_TFLOPS
        prior_s = work[record.task_id] / record.num_devices / slowest
        observed_s = record.finish_s - record.start_s
        assert example.label == pytest.approx(math.log(prior_s / observed_s), abs=1e-9), record.task_id
        # The head's inputs describe that task on that device.
        assert example.prior_x[0] == pytest.approx(math.log(slowest), abs=1e-6)
        assert example.prior_x[1] == 1.0  # the catalogue's models are all in the profiles
        assert example.shape_x[feat.names(feat.SHAPE_FEATURES).index("gang")] == pytest.approx(
            math.log1p(record.num_devices)
        )

        # Its position names, in its snapshot, the gang's slowest device.
        snapshot = episode.snapshots[example.snapshot]
        assert 0 <= example.position < len(snapshot.device_x)
        row = int(snapshot.device_rows[example.position])
        device_id = sim.scheduler.graph.devices.ids[row]
        assert device_id in record.device_ids
        assert peak[device_id] == min(peak[d] for d in record.device_ids)


def test_every_snapshot_is_used_and_some_decisions_explore(monkeypatch: pytest.MonkeyPatch) -> None:
    explored = 0
    for seed in (1000, 1001, 1002):
        episode, _ = logged_tiny_episode(monkeypatch, seed)
        assert sorted({e.snapshot for e in episode.examples}) == list(range(len(episode.snapshots)))
        explored += sum(e.explored for e in episode.examples)
        assert all(np.isfinite(e.label) for e in episode.examples)
    assert 0 < explored < 3 * TINY.jobs  # exploration 0.2: some, not all


def test_a_gangs_only_simulation_keeps_the_gangs_examples_and_their_snapshots_alone() -> None:
    args = (load_catalogue(), "mixed:16", "gavel", 1.0, 40, 1002)
    every = dataset.simulate(*args)
    gangs = dataset.simulate(*args, gangs_only=True)
    gang = feat.names(feat.SHAPE_FEATURES).index("gang")
    sizes = [round(float(np.expm1(e.shape_x[gang]))) for e in every.examples]
    assert 0 < sum(size > 1 for size in sizes) < len(sizes)  # this workload has both
    assert sorted(e.label for e in gangs.examples) == sorted(
        e.label for e, size in zip(every.examples, sizes, strict=True) if size > 1
    )
    assert sorted({e.snapshot for e in gangs.examples}) == list(range(len(gangs.snapshots)))


def test_no_exploration_logs_none_and_full_exploration_logs_all() -> None:
    args = (load_catalogue(), TINY.cluster, TINY.workload, TINY.load, TINY.jobs, 1001)
    assert not any(e.explored for e in dataset.simulate(*args, explore=0.0).examples)
    assert all(e.explored for e in dataset.simulate(*args, explore=1.0).examples)


def test_batches_group_examples_by_snapshot_and_drop_edges_without_message_passing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    episode, _ = logged_tiny_episode(monkeypatch, 1001)
    with_graph = train.to_batches([episode], message_passing=True)
    without = train.to_batches([episode], message_passing=False)
    assert len(with_graph) == len(episode.snapshots)
    assert all(float(w) == 1.0 for b in with_graph for w in b.weights)
    weighted = train.to_batches([episode], message_passing=True, weight_gangs=True)
    column = feat.names(feat.SHAPE_FEATURES).index("gang")
    gangs = sorted(int(np.rint(np.expm1(e.shape_x[column]))) for e in episode.examples)
    assert sorted(int(w) for b in weighted for w in b.weights) == gangs
    assert max(gangs) > 1  # the tiny workload has gangs
    np.testing.assert_allclose(
        sorted(float(x) for b in with_graph for x in b.labels), sorted(e.label for e in episode.examples), atol=1e-6
    )
    names = feat.encoder_feed_names()
    masks = [i for i, name in enumerate(names) if name.endswith("_mask")]
    assert any(float(with_graph[0].feeds[i].sum()) > 0 for i in masks)  # the tiny cluster has edges
    for batch in without:
        assert all(float(batch.feeds[i].sum()) == 0 for i in masks)
        assert batch.shape_x.shape == (len(batch.labels), len(feat.SHAPE_FEATURES))
        assert batch.prior_x.shape == (len(batch.labels), len(feat.PRIOR_FEATURES))


# -- learning ------------------------------------------------------------------------------------


def synthetic_episode(seed: int) -> Episode:
    """One snapshot of a mixed graph (three device models, random metrics), an example per device
    whose label is a known function of the device's peak TFLOPS plus a little noise. The prior
    input is the same for every device, so only the device's embedding can tell them apart."""
    rng = np.random.default_rng(100 + seed)
    graph = graphs.mixed(seed)
    inputs = feat.encoder_inputs(graph)
    peak = graph.devices.peak_tflops[inputs.device_rows]
    labels = 1.5 * np.log(peak / REFERENCE_PEAK_TFLOPS) - 0.4 + rng.normal(0.0, 0.05, len(peak))
    spec = ev.TaskSpec(id="t", kind=ev.TASK_KIND_TRAINING, num_devices=1, workload_class="resnet50-bs64")
    shape = feat.shape_features(spec)
    prior = np.zeros(len(feat.PRIOR_FEATURES), dtype=np.float32)
    examples = [Example(0, position, shape, prior, float(label), False) for position, label in enumerate(labels)]
    return Episode([inputs], examples)


def test_training_learns_a_speed_that_depends_on_the_device(tmp_path: Path) -> None:
    data = tmp_path / "data.pt"
    document = {
        "format": train.DATA_FORMAT,
        "description": "synthetic: 1.5 log(peak / 125) - 0.4",
        "train": [synthetic_episode(seed) for seed in range(8)],
        "validation": [synthetic_episode(seed) for seed in (8, 9)],
    }
    torch.save(document, data)
    config = recipe.TrainConfig(epochs=16, batch_snapshots=2, learning_rate=5e-3, hidden=8, rounds=1, seed=0)
    trainer = train.Trainer(config, tmp_path / "run", lambda _: None, progress=False, data=data)
    best = trainer.run()

    start, end = trainer.history[0], trainer.history[-1]
    assert start.val_error == start.prior_error  # an untrained head predicts the prior
    assert end.prior_error > 0.5  # the labels are far from the prior...
    assert end.val_error < 0.25 * end.prior_error  # ...and the model finds them on unseen graphs
    assert trainer.best_nll < start.val_nll - 1.0
    assert end.within_2sd > 0.7  # its spread is about right, not merely wide
    _, version, description = load_checkpoint(best)
    assert version.startswith("hlb-gnn-")
    assert "with message passing" in description


def test_logging_in_worker_processes_gives_the_same_examples(tmp_path: Path) -> None:
    tiny = recipe.PRESETS["tiny"]

    def logged(workers: int) -> tuple[list[dataset.Episode], list[dataset.Episode]]:
        return train.Trainer(tiny, tmp_path / str(workers), lambda _: None, progress=False, workers=workers).episodes()

    here, pooled = logged(1), logged(2)
    for one, two in zip(here, pooled, strict=True):  # training, then validation episodes, in order
        assert len(one) == len(two) > 0
        for a, b in zip(one, two, strict=True):
            assert [(e.snapshot, e.position, e.label, e.explored) for e in a.examples] == [
                (e.snapshot, e.position, e.label, e.explored) for e in b.examples
            ]
            assert all(np.array_equal(x.shape_x, y.shape_x) for x, y in zip(a.examples, b.examples, strict=True))
            assert len(a.snapshots) == len(b.snapshots)


def test_tiny_training_writes_its_files_and_a_second_run_reuses_the_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = tmp_path / "first"
    assert main(["train", "--out", str(first), "--preset", "tiny", "--no-progress", "--threads", "1"]) == 0
    assert {p.name for p in first.iterdir()} >= {"config.json", "data.pt", "train.jsonl", "best.pt", "final.pt"}
    tiny = recipe.PRESETS["tiny"]
    log = [json.loads(line) for line in (first / "train.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in log] == list(range(tiny.epochs + 1))
    assert log[0]["samples"] == 0
    assert log[0]["loss"] is None  # epoch 0 validates the untrained model: no loss (NaN, written as null)
    assert log[0]["val_error"] == log[0]["prior_error"]
    for entry in log[1:]:
        assert entry["samples"] > 0
        assert math.isfinite(entry["loss"])
        assert 0.0 <= entry["within_1sd"] <= entry["within_2sd"] <= 1.0
    best_nll = min(e["val_nll"] for e in log[1:])
    assert f"best validation NLL {best_nll:.3f}" in capsys.readouterr().out

    second = tmp_path / "second"
    args = ["train", "--out", str(second), "--preset", "tiny", "--no-progress", "--threads", "1"]
    assert main([*args, "--data", str(first / "data.pt"), "--no-graph"]) == 0
    assert f"data: read {first / 'data.pt'}" in capsys.readouterr().out
    assert not (second / "data.pt").exists()
    reused = [json.loads(line) for line in (second / "train.jsonl").read_text().splitlines()]
    assert [e["samples"] for e in reused] == [e["samples"] for e in log]
    assert reused[0]["prior_error"] == log[0]["prior_error"]  # the same validation examples
    model, version, description = load_checkpoint(second / "best.pt")
    assert model.config.message_passing is False
    # The shapes training saw are recorded: the tiny stage's gavel jobs are all training tasks.
    assert model.config.trained_kinds == ("training",)
    assert set(model.config.trained_families) <= set(feat.WORKLOAD_FAMILIES)
    assert model.config.trained_families
    assert "-no-graph-" in version
    assert "without message passing" in description

    # Exported, the daemon's ONNX model predicts what training's torch model predicts, one task
    # shape per call where training batched them, and the GNN policy runs on it without falling back.
    folder = tmp_path / "onnx"
    assert main(["export", "--checkpoint", str(second / "best.pt"), "--out", str(folder)]) == 0
    onnx_model = load_model(folder, providers=["CPUExecutionProvider"])
    assert onnx_model.message_passing is False
    assert not onnx_model.trained_on(ev.TaskSpec(id="s", kind=ev.TASK_KIND_INFERENCE, workload_class="lm-bs5"))
    document = torch.load(first / "data.pt", weights_only=False)
    names = feat.encoder_feed_names()
    for batch in train.to_batches(document["validation"], message_passing=False):
        with torch.no_grad():
            want = train.predict(model, batch).numpy()
        emb, context = onnx_model.encoder.session.run(
            None, {n: f.numpy() for n, f in zip(names, batch.feeds, strict=True)}
        )
        got = np.concatenate(
            [
                onnx_model.predict(
                    batch.shape_x[i].numpy(), emb[[p]], batch.prior_x[i : i + 1].numpy(), np.asarray(context)
                )
                for i, p in enumerate(batch.positions.tolist())
            ]
        )
        assert np.abs(got - want).max() <= 1e-4

    catalogue = load_catalogue()
    inventory = build_cluster(TINY.cluster, catalogue)
    tasks = build_workload(TINY.workload, 3, TINY.jobs, catalogue, inventory, TINY.load)
    policy = make_sim_policy("gnn-no-graph", model=str(folder))
    result = Simulation(catalogue, inventory, tasks, policy, 3, SimConfig()).run()
    assert all(r.state == "finished" for r in result.tasks)


def test_train_command_reports_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "run")
    assert main(["train", "--out", out, "--stage", "mixed:8/philly/0.8/10"]) == 2
    assert "held out for hlb eval" in capsys.readouterr().err
    assert main(["train", "--out", out, "--stage", "mixed:8/gavel/0.8"]) == 2
    assert "CLUSTER/WORKLOAD/LOAD/JOBS" in capsys.readouterr().err
    assert main(["train", "--out", out, "--preset", "tiny", "--epochs", "0"]) == 2
    assert "--epochs >= 1" in capsys.readouterr().err
    assert main(["train", "--out", out, "--preset", "tiny", "--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err
    assert main(["train", "--out", out, "--preset", "tiny", "--episodes", "-1"]) == 2
    assert "--episodes" in capsys.readouterr().err
    assert main(["train", "--out", out, "--preset", "tiny", "--data", str(tmp_path / "missing.pt")]) == 2
    assert "missing.pt: no such file" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything was written

    other = tmp_path / "other.pt"
    torch.save({"format": "something else"}, other)
    assert main(["train", "--out", out, "--preset", "tiny", "--data", str(other)]) == 2
    assert "not hlb training data" in capsys.readouterr().err
    assert not (tmp_path / "run" / "train.jsonl").exists()


def test_a_second_run_into_the_same_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train.jsonl").write_text("{}\n")
    assert main(["train", "--out", str(tmp_path), "--preset", "tiny", "--no-progress"]) == 2
    assert "holds an earlier run" in capsys.readouterr().err
    assert (tmp_path / "train.jsonl").read_text() == "{}\n"
