"""The GNN: a heterogeneous message-passing encoder and a per-candidate scorer.

Node types are device, host, switch (rack) and task; the edge types are the padded neighbour
lists of :data:`hlb.daemon.decide.gnn.features.NEIGHBOUR_LISTS`. Every aggregation *gathers* source embeddings
over a padded list and reduces with a mask (Gather, Mul, ReduceSum, ReduceMax in ONNX): no
scatter, no index_put, no index_add, because onnxruntime runs ScatterElements(add) about 8x slower
and ScatterND(add) gives wrong sums with more than one intra-op thread when indices repeat
(docs/design.md §4). ``tests/export`` checks the exported op inventory.

The model predicts run time, not decisions: for a task on a device, the log of the ratio of the
rate it will run at to the rate the device profiles (the prior) give, and how sure it is. The
``gnn`` preset's rules and hetero-greedy's earliest-finish score then decide with the corrected
run times (``hlb.daemon.decide.gnn.speeds``), so comparing it with ``rules`` measures the
prediction alone. Two graphs, so that a decision does not pay for a full pass:

- :class:`Encoder`: whole graph -> device embeddings [D, E] and a global context [G], refreshed
  off the request path;
- :class:`Scorer` (the speed head): one task shape, its candidates' embeddings [C, E], their prior
  features [C, 2] and the context -> [C, 2] (log speed ratio, log standard deviation).

Trained supervised (``hlb.export.train``): Gaussian negative log-likelihood of the log ratio of
observed to prior rate of tasks that ran in simulations with hidden truth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hlb.daemon.decide.gnn import features as feat

CHECKPOINT_FORMAT = "hlb-gnn-checkpoint/3"
# The head's outputs are clipped: a speed ratio within e**±4 (about 55x) of the prior's, and a
# standard deviation of its log between e**-4 and e**2.
MAX_LOG_RATIO = 4.0
MIN_LOG_SIGMA = -4.0
MAX_LOG_SIGMA = 2.0
_TYPE_DIMS: dict[str, int] = {
    "device": len(feat.DEVICE_FEATURES),
    "host": len(feat.HOST_FEATURES),
    "switch": len(feat.SWITCH_FEATURES),
    "task": len(feat.TASK_FEATURES),
}
_PENDING_COLUMN = feat.names(feat.TASK_FEATURES).index("pending")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the model. ``hidden`` is the embedding width E; ``rounds`` the message-passing depth."""

    hidden: int = 32
    rounds: int = 2
    scorer_hidden: int = 64
    message_passing: bool = True  # False: every neighbour list empty, in training and in the daemon
    # The task shapes training saw (hlb.export.train fills them from its data): the daemon predicts
    # only for these and leaves any other family or kind to the prior. Empty: not recorded (all).
    trained_families: tuple[str, ...] = ()  # declared workload families; "" for none or unknown
    trained_kinds: tuple[str, ...] = ()  # training, inference, batch_stage, unspecified

    @property
    def context_dim(self) -> int:
        """G: mean device embedding, mean pending-task embedding, log device and pending counts."""
        return 2 * self.hidden + 2

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class GatherAggregation(nn.Module):
    """Base of every message-passing layer: aggregate sources over a padded neighbour list.

    Padding slots hold the source count ``N_src``; a zero row is appended to the sources so those
    slots gather zeros, and the mask removes them from the mean and the max.

    Shapes: src [N_src, E], index int64 [N, K] in [0, N_src], mask float32 [N, K].
    """

    @staticmethod
    def gather(src: Tensor, index: Tensor, mask: Tensor) -> Tensor:
        """Masked neighbour embeddings. -> [N, K, E]."""
        padded = torch.cat([src, src.new_zeros(1, src.shape[1])], dim=0)
        rows = torch.index_select(padded, 0, index.reshape(-1))
        return rows.reshape(index.shape[0], index.shape[1], src.shape[1]) * mask.unsqueeze(-1)

    @classmethod
    def mean_max(cls, src: Tensor, index: Tensor, mask: Tensor) -> Tensor:
        """Mean and max over real neighbours, zeros for a node without any. -> [N, 2E]."""
        gathered = cls.gather(src, index, mask)
        count = mask.sum(dim=1, keepdim=True)
        mean = gathered.sum(dim=1) / torch.clamp(count, min=1.0)
        real = mask.unsqueeze(-1) > 0
        top = torch.where(real, gathered, torch.full_like(gathered, float("-inf"))).amax(dim=1)
        top = torch.where(count > 0, top, torch.zeros_like(top))
        return torch.cat([mean, top], dim=1)


class Relation(GatherAggregation):
    """The message one edge type sends: ``W [mean_j h_j ; max_j h_j] + b`` over neighbours j.

    Shapes: src [N_src, E], index/mask [N, K] -> [N, E].
    """

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * hidden, hidden)

    def forward(self, src: Tensor, index: Tensor, mask: Tensor) -> Tensor:
        out: Tensor = self.linear(self.mean_max(src, index, mask))
        return out


class NodeUpdate(nn.Module):
    """Residual update of one node type: ``h + MLP([h ; sum of incoming messages])``, then LayerNorm.

    Shapes: h [N, E], messages [N, E] -> [N, E].
    """

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, h: Tensor, messages: Tensor) -> Tensor:
        out: Tensor = self.norm(h + self.mlp(torch.cat([h, messages], dim=1)))
        return out


class HeteroRound(nn.Module):
    """One round of message passing over every edge type, then an update of every node type."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.relations = nn.ModuleDict({name: Relation(hidden) for name, _, _ in feat.NEIGHBOUR_LISTS})
        self.updates = nn.ModuleDict({node: NodeUpdate(hidden) for node in feat.NODE_TYPES})

    def forward(self, h: dict[str, Tensor], lists: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        incoming = {node: torch.zeros_like(h[node]) for node in feat.NODE_TYPES}
        for name, dst, src in feat.NEIGHBOUR_LISTS:
            index, mask = lists[name]
            incoming[dst] = incoming[dst] + self.relations[name](h[src], index, mask)
        return {node: self.updates[node](h[node], incoming[node]) for node in feat.NODE_TYPES}


def _mlp(n_in: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden))


class Encoder(nn.Module):
    """Whole graph -> device embeddings [D, E] and a global context [G].

    Inputs are those of :func:`hlb.daemon.decide.gnn.features.encoder_feed_names`, in that order: the four
    node feature matrices, then an (index, mask) pair per neighbour list.
    """

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = config or ModelConfig()
        hidden = self.config.hidden
        self.embed = nn.ModuleDict({node: _mlp(dim, hidden) for node, dim in _TYPE_DIMS.items()})
        self.rounds = nn.ModuleList([HeteroRound(hidden) for _ in range(self.config.rounds)])

    def forward(
        self,
        device_x: Tensor,
        host_x: Tensor,
        switch_x: Tensor,
        task_x: Tensor,
        device_host_index: Tensor,
        device_host_mask: Tensor,
        host_device_index: Tensor,
        host_device_mask: Tensor,
        host_rack_index: Tensor,
        host_rack_mask: Tensor,
        rack_host_index: Tensor,
        rack_host_mask: Tensor,
        task_device_index: Tensor,
        task_device_mask: Tensor,
        device_task_index: Tensor,
        device_task_mask: Tensor,
        task_parent_index: Tensor,
        task_parent_mask: Tensor,
        task_child_index: Tensor,
        task_child_mask: Tensor,
    ) -> tuple[Tensor, Tensor]:
        x = {"device": device_x, "host": host_x, "switch": switch_x, "task": task_x}
        lists = {
            "device_host": (device_host_index, device_host_mask),
            "host_device": (host_device_index, host_device_mask),
            "host_rack": (host_rack_index, host_rack_mask),
            "rack_host": (rack_host_index, rack_host_mask),
            "task_device": (task_device_index, task_device_mask),
            "device_task": (device_task_index, device_task_mask),
            "task_parent": (task_parent_index, task_parent_mask),
            "task_child": (task_child_index, task_child_mask),
        }
        h = {node: self.embed[node](x[node]) for node in feat.NODE_TYPES}
        for round_ in self.rounds:
            h = round_(h, lists)
        return h["device"], self.context(h["device"], h["task"], task_x)

    @staticmethod
    def context(device_h: Tensor, task_h: Tensor, task_x: Tensor) -> Tensor:
        """[mean device embedding ; mean pending-task embedding ; log1p(D) ; log1p(pending)]. -> [G].

        Sums over rows, never shapes, so an empty device or task set gives zeros.
        """
        n_devices = torch.ones_like(device_h[:, :1]).sum(dim=0)
        pending = torch.clamp(task_x[:, _PENDING_COLUMN : _PENDING_COLUMN + 1], min=0.0, max=1.0)
        n_pending = pending.sum(dim=0)
        device_mean = device_h.sum(dim=0) / torch.clamp(n_devices, min=1.0)
        task_mean = (task_h * pending).sum(dim=0) / torch.clamp(n_pending, min=1.0)
        return torch.cat([device_mean, task_mean, torch.log1p(n_devices), torch.log1p(n_pending)])


class Scorer(nn.Module):
    """The speed head: one task shape, C candidate devices -> [C, 2], per device the predicted log
    of (observed rate / the prior's rate) and the log of its standard deviation.

    Shapes: shape_x [len(SHAPE_FEATURES)], device_emb [C, E], prior_x [C, len(PRIOR_FEATURES)],
    context [G] -> [C, 2]. Per-candidate terms are broadcast against the task-wide ones; no Expand
    of C. The output layer starts at zero: an untrained head predicts the prior (ratio 1) with a
    standard deviation of 1.
    """

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = config or ModelConfig()
        hidden = self.config.scorer_hidden
        self.device_in = nn.Linear(self.config.hidden, hidden)
        self.prior_in = nn.Linear(len(feat.PRIOR_FEATURES), hidden, bias=False)
        self.shape_in = nn.Linear(len(feat.SHAPE_FEATURES), hidden, bias=False)
        self.context_in = nn.Linear(self.config.context_dim, hidden, bias=False)
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.heads = nn.Linear(hidden, 2)
        nn.init.zeros_(self.heads.weight)
        nn.init.zeros_(self.heads.bias)

    def forward(self, shape_x: Tensor, device_emb: Tensor, prior_x: Tensor, context: Tensor) -> Tensor:
        shared = self.shape_in(shape_x) + self.context_in(context)  # [H]
        h = self.body(self.device_in(device_emb) + self.prior_in(prior_x) + shared)  # [C, H]
        out = self.heads(h)  # [C, 2]
        mean = torch.clamp(out[:, :1], min=-MAX_LOG_RATIO, max=MAX_LOG_RATIO)
        log_sigma = torch.clamp(out[:, 1:], min=MIN_LOG_SIGMA, max=MAX_LOG_SIGMA)
        return torch.cat([mean, log_sigma], dim=1)


class HlbGnn(nn.Module):
    """Encoder and speed head together. ``message_passing`` False: trained and run with every
    neighbour list empty (the ``gnn-no-graph`` ablation); recorded in the checkpoint and the export."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = config or ModelConfig()
        self.encoder = Encoder(self.config)
        self.scorer = Scorer(self.config)

    @classmethod
    def random(cls, config: ModelConfig | None = None) -> HlbGnn:
        """An untrained model whose output layer is random too (a fresh one starts it at zero), so
        every input moves the predictions: for tests and benchmarks. Seed torch first."""
        model = cls(config)
        nn.init.normal_(model.scorer.heads.weight, std=0.5)
        nn.init.normal_(model.scorer.heads.bias, std=0.5)
        return model


def save_checkpoint(model: HlbGnn, path: Path, model_version: str, training_data: str) -> None:
    """Write the model's weights, config and provenance (what ``hlb export --checkpoint`` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "format": CHECKPOINT_FORMAT,
            "config": model.config.as_dict(),
            "state": model.state_dict(),
            "model_version": model_version,
            "training_data": training_data,
        },
        path,
    )


def load_checkpoint(path: Path) -> tuple[HlbGnn, str, str]:
    """The model in ``path`` (eval mode), its version and its training-data description."""
    document = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(document, dict) or document.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not an hlb checkpoint ({CHECKPOINT_FORMAT})")
    config = dict(document["config"])
    for key in ("trained_families", "trained_kinds"):
        config[key] = tuple(config.get(key, ()))
    model = HlbGnn(ModelConfig(**config))
    model.load_state_dict(document["state"])
    model.eval()
    return model, str(document["model_version"]), str(document["training_data"])
