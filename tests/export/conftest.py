"""One exported model for the export tests: a seeded random model, its checkpoint and its ONNX files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@dataclass(frozen=True)
class Exported:
    model: Any  # export.model.HlbGnn (torch is imported only when a test asks for this fixture)
    folder: Path


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """A seeded model written as a checkpoint, then exported through ``hlb export --checkpoint``."""
    import torch

    from hlb.cli import main
    from hlb.export.model import HlbGnn, ModelConfig, save_checkpoint

    torch.manual_seed(7)
    model = HlbGnn.random(ModelConfig(hidden=16, rounds=2, scorer_hidden=32))
    model.eval()
    folder = tmp_path_factory.mktemp("gnn")
    save_checkpoint(model, folder / "model.pt", model_version="test-7", training_data="none: seeded random weights")
    assert main(["export", "--checkpoint", str(folder / "model.pt"), "--out", str(folder)]) == 0
    return Exported(model, folder)
