"""The speed head (hlb.export.model.Scorer): what an untrained head predicts, its clamps, its batch
form, and the checkpoint format."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlb.daemon.decide.gnn import features as feat

torch = pytest.importorskip("torch", reason="model tests need the export extra: pip install 'hlb[export]'")

from torch import Tensor  # noqa: E402

from hlb.export.model import (  # noqa: E402
    CHECKPOINT_FORMAT,
    MAX_LOG_RATIO,
    MAX_LOG_SIGMA,
    MIN_LOG_SIGMA,
    HlbGnn,
    ModelConfig,
    load_checkpoint,
    save_checkpoint,
)

CONFIG = ModelConfig(hidden=8, rounds=1, scorer_hidden=16)


def head_inputs(candidates: int, seed: int = 0, scale: float = 1.0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        scale * torch.randn(len(feat.SHAPE_FEATURES), generator=g),
        scale * torch.randn(candidates, CONFIG.hidden, generator=g),
        scale * torch.randn(candidates, len(feat.PRIOR_FEATURES), generator=g),
        scale * torch.randn(CONFIG.context_dim, generator=g),
    ]


def test_an_untrained_head_predicts_the_prior_with_unit_spread() -> None:
    torch.manual_seed(0)
    out = HlbGnn(CONFIG).scorer(*head_inputs(5))
    assert out.shape == (5, 2)
    assert torch.equal(out, torch.zeros(5, 2))  # log ratio 0: the prior's speed; log sd 0: sd 1


def test_a_random_head_depends_on_every_input() -> None:
    torch.manual_seed(0)
    head = HlbGnn.random(CONFIG).scorer
    inputs = head_inputs(5)
    base = head(*inputs)
    for i in range(4):
        moved = list(inputs)
        moved[i] = moved[i] + 1.0
        assert not torch.allclose(head(*moved), base), f"input {i} does not reach the output"


def test_outputs_are_clamped_to_the_documented_ranges() -> None:
    torch.manual_seed(0)
    head = HlbGnn.random(CONFIG).scorer
    with torch.no_grad():
        head.heads.weight.mul_(1000.0)
        out = head(*head_inputs(200, scale=100.0))
    assert out[:, 0].abs().max() == MAX_LOG_RATIO  # reached, not exceeded
    assert out[:, 1].min() >= MIN_LOG_SIGMA
    assert out[:, 1].max() <= MAX_LOG_SIGMA
    assert {float(out[:, 1].min()), float(out[:, 1].max())} & {MIN_LOG_SIGMA, MAX_LOG_SIGMA}


def test_a_batch_of_shapes_gives_what_one_call_per_example_gives() -> None:
    """Training feeds [B, S] shapes with [B, E] embeddings; the daemon one shape with C candidates."""
    torch.manual_seed(0)
    head = HlbGnn.random(CONFIG).scorer
    g = torch.Generator().manual_seed(1)
    shapes = torch.randn(6, len(feat.SHAPE_FEATURES), generator=g)
    emb = torch.randn(6, CONFIG.hidden, generator=g)
    prior = torch.randn(6, len(feat.PRIOR_FEATURES), generator=g)
    context = torch.randn(CONFIG.context_dim, generator=g)
    batched = head(shapes, emb, prior, context)
    one_by_one = torch.cat([head(shapes[i], emb[i : i + 1], prior[i : i + 1], context) for i in range(6)])
    torch.testing.assert_close(batched, one_by_one)


def test_a_checkpoint_keeps_the_config_and_weights_and_refuses_an_older_format(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = HlbGnn.random(ModelConfig(hidden=8, rounds=1, message_passing=False))
    save_checkpoint(model, tmp_path / "m.pt", "v1", "synthetic")
    loaded, version, data = load_checkpoint(tmp_path / "m.pt")
    assert (version, data) == ("v1", "synthetic")
    assert loaded.config == model.config
    assert not loaded.training
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name

    document = torch.load(tmp_path / "m.pt", weights_only=True)
    torch.save({**document, "format": "hlb-gnn-checkpoint/2"}, tmp_path / "old.pt")
    with pytest.raises(ValueError, match=CHECKPOINT_FORMAT):
        load_checkpoint(tmp_path / "old.pt")
