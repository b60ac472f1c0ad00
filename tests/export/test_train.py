"""hlb train: its pieces (losses, returns, DAgger labels) and a tiny run end to end through export.

The end-to-end test is what CI trains: the ``tiny`` preset for a few steps, exported with
``hlb export``, then the ONNX model in the daemon's GNN policy must make the very decisions the
torch model made in the same simulation (so ``hlb eval`` measures what training produced).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="training needs the export extra: pip install 'hlb[export]'")
pytest.importorskip("tqdm", reason="training needs the export extra: pip install 'hlb[export]'")

from hlb.cli import main  # noqa: E402
from hlb.export import imitation, recipe, reinforce, train  # noqa: E402
from hlb.export.model import HlbGnn, ModelConfig, load_checkpoint  # noqa: E402
from hlb.export.student import TorchGnnPolicy, decision_scores  # noqa: E402
from hlb.export.train_cli import PRESET_NAMES  # noqa: E402
from hlb.sim.catalogue import load_catalogue  # noqa: E402
from hlb.sim.lookahead import LookaheadPolicy  # noqa: E402
from hlb.sim.metrics import compute_metrics  # noqa: E402
from hlb.sim.policies import make_sim_policy  # noqa: E402
from hlb.sim.result import SimResult, TaskRecord  # noqa: E402
from hlb.sim.scenarios import build_cluster, build_workload  # noqa: E402
from hlb.sim.simulator import SimConfig, Simulation  # noqa: E402

STAGE = recipe.Stage("mixed:8", "gavel", 0.8, 14)


def run_stage(policy: object, stage: recipe.Stage = STAGE, seed: int = 1001) -> Simulation:
    catalogue = load_catalogue()
    inventory = build_cluster(stage.cluster, catalogue)
    tasks = build_workload(stage.workload, seed, stage.jobs, catalogue, inventory, stage.load)
    sim = Simulation(catalogue, inventory, tasks, policy, seed, SimConfig())  # type: ignore[arg-type]
    sim.run()
    return sim


def test_presets_match_the_command_line() -> None:
    assert set(PRESET_NAMES) == set(recipe.PRESETS)


def test_plackett_luce_probabilities_of_all_orderings_sum_to_one() -> None:
    scores = torch.tensor([0.3, -1.0, 2.0, 0.5])
    for size in (1, 2, 3):
        total = sum(
            math.exp(float(reinforce.plackett_luce_log_prob(scores, np.array(p), 0.7)))
            for p in itertools.permutations(range(4), size)
        )
        assert total == pytest.approx(1.0, abs=1e-5)
    # The first draw alone is the softmax at the temperature.
    first = float(reinforce.plackett_luce_log_prob(scores, np.array([2]), 0.7))
    assert first == pytest.approx(float(torch.log_softmax(scores / 0.7, 0)[2]), abs=1e-6)


def record(arrival: float, finish: float) -> TaskRecord:
    return TaskRecord("t", "j", "training", "c", 1, arrival, (), 1.0, 1.0, state="finished", finish_s=finish)


def test_returns_to_go_count_the_flow_time_still_to_come() -> None:
    result = SimResult("p", 0, [record(0.0, 10.0), record(5.0, 20.0)], 1, 30.0, 0.0, 0.0, 1.0, None, 0, 0, 0)  # type: ignore[arg-type]
    got = reinforce.returns_to_go(result, np.array([0.0, 5.0, 12.0, 25.0]))
    # t=0: 10 + 15; t=5: 5 + 15; t=12: 0 + 8; t=25: nothing left.
    np.testing.assert_allclose(got, [-25.0, -20.0, -8.0, 0.0])


def test_parse_stage_and_check_stages_refuse_bad_or_held_out_stages() -> None:
    assert recipe.parse_stage("mixed:64/gavel/0.8/200") == recipe.Stage("mixed:64", "gavel", 0.8, 200)
    for bad in ("mixed:64/gavel/0.8", "mixed:64/gavel/x/200", "mixed:64/gavel/0/200", "mixed:64/gavel/0.8/0"):
        with pytest.raises(ValueError, match="stage"):
            recipe.parse_stage(bad)
    with pytest.raises(ValueError, match="held out"):
        recipe.check_stages([recipe.Stage("mixed:8", "philly", 0.8, 10)])
    with pytest.raises(ValueError, match="nosuch"):
        recipe.check_stages([recipe.Stage("nosuch:8", "gavel", 0.8, 10)])


def test_train_command_reports_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--out", str(tmp_path), "--stage", "mixed:8/philly/0.8/10"]) == 2
    assert "held out" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path), "--preset", "tiny", "--rl-iterations", "-1"]) == 2
    for bad in ("1", "-0.1", "nan"):
        assert main(["train", "--out", str(tmp_path), "--preset", "tiny", "--min-improvement", bad]) == 2
        assert "--min-improvement" in capsys.readouterr().err
    for bad in ("1", "-0.1", "nan"):
        assert main(["train", "--out", str(tmp_path), "--preset", "tiny", "--rl-clip", bad]) == 2
        assert "--rl-clip" in capsys.readouterr().err
    assert not (tmp_path / "best.pt").exists()


def test_the_clipped_surrogate_stops_pushing_a_probability_past_the_clip() -> None:
    def loss_and_grad(ratio: float, advantage: float) -> tuple[float, float]:
        log_prob = torch.tensor(math.log(ratio), requires_grad=True)
        loss = reinforce.clipped_surrogate(log_prob, 0.0, advantage, 0.2)
        loss.backward()  # type: ignore[no-untyped-call]
        assert log_prob.grad is not None
        return float(loss), float(log_prob.grad)

    # At the sampling model's probability it is REINFORCE's loss and gradient: -A log p has -A.
    assert loss_and_grad(1.0, 2.0) == pytest.approx((-2.0, -2.0))
    assert loss_and_grad(1.0, -2.0) == pytest.approx((2.0, 2.0))
    # Past 1 + clip a good decision is pushed no further; past 1 - clip a bad one neither.
    assert loss_and_grad(1.5, 2.0) == pytest.approx((-2.4, 0.0))
    assert loss_and_grad(0.5, -2.0) == pytest.approx((1.6, 0.0))
    # Moved the wrong way, the gradient still pulls it back, unclipped.
    assert loss_and_grad(0.5, 2.0) == pytest.approx((-1.0, -1.0))
    assert loss_and_grad(1.5, -2.0) == pytest.approx((3.0, 3.0))


def test_a_later_epoch_replaces_the_best_only_by_the_minimum_improvement(tmp_path: Path) -> None:
    trainer = train.Trainer(recipe.TrainConfig(min_improvement=0.02), tmp_path, lambda _: None, progress=False)
    ratios = iter([0.650, 0.640, 0.600, 0.590, 0.585])  # against hetero-greedy's 1.0
    trainer.validate = lambda: (next(ratios), 1.0)  # type: ignore[method-assign]
    kept = []
    for _ in range(5):
        trainer.finish_epoch("test", 0, 0.0, 0.0, {})
        _, version, _ = load_checkpoint(tmp_path / "best.pt")
        kept.append(int(version.rsplit("-e", 1)[1]))
    # 0.640 is 1.5% below 0.650: not enough; 0.600 is; 0.590 is 1.7% below 0.600; 0.585 is 2.5% below.
    assert kept == [0, 0, 2, 2, 4]
    assert trainer.best_ratio == 0.585


def test_dagger_with_beta_one_decides_as_the_teacher_and_labels_every_choice() -> None:
    teacher_only = run_stage(LookaheadPolicy(k=2, horizon_s=1800.0))
    student = TorchGnnPolicy(HlbGnn(ModelConfig(hidden=8, rounds=1)))
    dagger = imitation.DaggerPolicy(student, LookaheadPolicy(k=2, horizon_s=1800.0), beta=1.0, seed=0)
    mixed = run_stage(dagger)
    assert [p.device_ids for p in mixed.scheduler.ledger.since(1)] == [
        p.device_ids for p in teacher_only.scheduler.ledger.since(1)
    ]
    assert dagger.data, "no decision was labelled"
    for decision in dagger.data:
        assert len(decision.positions) == len(decision.pair_x) >= 2
        assert decision.chosen.min() >= 0
        assert decision.chosen.max() < len(decision.positions)


def test_imitation_learns_the_teachers_choices() -> None:
    torch.manual_seed(0)
    model = HlbGnn(ModelConfig(hidden=8, rounds=1))
    dagger = imitation.DaggerPolicy(TorchGnnPolicy(model), LookaheadPolicy(k=2, horizon_s=1800.0), 1.0, 0)
    run_stage(dagger)
    data = dagger.data
    weights = torch.tensor([1.0, 0.0, 0.0])

    def loss_over_data() -> Any:
        cache: dict[int, tuple[Any, Any]] = {}
        terms = [imitation.imitation_loss(decision_scores(model, d, weights, cache), d.chosen) for d in data]
        return torch.stack(terms).mean()

    def mean_loss() -> float:
        with torch.no_grad():
            return float(loss_over_data())

    before = mean_loss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):
        loss = loss_over_data()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert mean_loss() < 0.8 * before


def test_tiny_training_exports_a_model_that_decides_as_the_torch_one(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--preset", "tiny", "--no-progress"]) == 0
    log = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    tiny = recipe.PRESETS["tiny"]
    phases = ["init"] + ["dagger"] * tiny.dagger_iterations + ["reinforce"] * tiny.rl_iterations
    assert [e["phase"] for e in log] == phases
    for entry in log:
        if entry["phase"] != "init":  # epoch 0 validates the untrained model: no samples, no loss
            assert entry["samples"] > 0
            assert math.isfinite(entry["loss"])
        assert entry["val_ratio"] > 0
    assert len(list((out / "checkpoints").glob("epoch-*.pt"))) == len(log)
    model, version, description = load_checkpoint(out / "best.pt")
    assert version.startswith("hlb-gnn-")
    assert "DAgger" in description
    assert "REINFORCE x1 (PPO clip 0.2)" in description  # the preset's clip

    folder = tmp_path / "onnx"
    assert main(["export", "--checkpoint", str(out / "best.pt"), "--out", str(folder)]) == 0
    # Under each set of rules (waiting for a faster device, shortest-first order and services where
    # they meet their SLO, or none), the daemon's ONNX policy decides as the torch student; the
    # mixed workload has services that declare their load.
    waited = 0
    rules_of = {
        "gnn-no-rules": {},
        "gnn": {
            "wait_for_faster": True,
            "queue_order": "shortest-first",
            "fit_services": True,
            "gang_wait_factor": 0.5,
        },
    }
    for workload in ("gavel", "mixed"):
        busy = recipe.Stage("mixed:8", workload, 1.2, 20)  # loaded enough that tasks have devices to wait for
        for variant, rules in rules_of.items():
            waited += _same_decisions(model, folder, variant, rules, busy)
    assert waited > 0  # the wait path was taken


def test_plain_reinforce_without_the_ppo_clip_trains_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--preset", "tiny", "--dagger-iterations", "0", "--rl-clip", "0"]
    assert main([*args, "--no-progress"]) == 0
    log = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert [e["phase"] for e in log] == ["init"] + ["reinforce"] * recipe.PRESETS["tiny"].rl_iterations
    assert all(e["samples"] > 0 and math.isfinite(e["loss"]) for e in log[1:])
    _, _, description = load_checkpoint(out / "checkpoints" / f"epoch-{len(log) - 1:03d}.pt")
    assert "REINFORCE x1;" in description


def _same_decisions(model: Any, folder: Path, variant: str, rules: dict[str, Any], stage: Any) -> int:
    """Run ``stage`` with the torch student under ``rules`` and the ONNX policy ``variant``: the
    same placements, waits and mean JCT. Returns the waits decided."""
    with_torch = run_stage(TorchGnnPolicy(model, **rules), stage, seed=1002)
    with_onnx = run_stage(make_sim_policy(variant, model=str(folder)), stage, seed=1002)
    assert [(p.task_id, p.device_ids) for p in with_onnx.scheduler.ledger.since(1)] == [
        (p.task_id, p.device_ids) for p in with_torch.scheduler.ledger.since(1)
    ]
    assert with_onnx.scheduler.waits_decided == with_torch.scheduler.waits_decided
    assert compute_metrics(with_onnx.result())["jct_mean_s"] == pytest.approx(
        compute_metrics(with_torch.result())["jct_mean_s"]
    )
    waits: int = with_onnx.scheduler.waits_decided
    return waits
