"""The GNN: a heterogeneous message-passing encoder and a per-candidate scorer.

Node types are device, host, switch (rack) and task; the edge types are the padded neighbour
lists of :data:`hlb.daemon.decide.gnn.features.NEIGHBOUR_LISTS`. Every aggregation *gathers* source embeddings
over a padded list and reduces with a mask (Gather, Mul, ReduceSum, ReduceMax in ONNX): no
scatter, no index_put, no index_add, because onnxruntime runs ScatterElements(add) about 8x slower
and ScatterND(add) gives wrong sums with more than one intra-op thread when indices repeat
(docs/design.md §4). ``tests/export`` checks the exported op inventory.

The model is two graphs so that a decision does not pay for a full pass:

- :class:`Encoder`: whole graph -> device embeddings [D, E] and a global context [G], refreshed
  off the request path;
- :class:`Scorer`: one task's features, its candidates' embeddings [C, E], pair features [C, P],
  the context and the objective weights [3] -> scores [C] (higher is better).

The scorer predicts one score per objective (completion time, utilization, energy) and returns
their weighted sum, so operators change the trade-off at run time without retraining; the weights
are also inputs of its hidden layer. Each objective's score is a learned correction on top of a
physical prior, ``-prior_o * pair_x[:, PRIOR_FEATURES[o]]`` (estimated finish, load, energy; the
coefficients are learned too). The correction's output layer starts at zero, so an untrained
scorer ranks single devices as hetero-greedy does, and training learns where to depart from it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from hlb.daemon.decide.gnn import features as feat

N_OBJECTIVES = 3
CHECKPOINT_FORMAT = "hlb-gnn-checkpoint/2"
# The scorer's physical prior: per objective, the pair feature whose increase makes a device worse
# (completion time: estimated finish, hetero-greedy's estimate; utilization: the device's load;
# energy: estimated energy).
PRIOR_FEATURES = ("finish_s", "load", "energy_kj")
PRIOR_INIT = 10.0
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

    @property
    def context_dim(self) -> int:
        """G: mean device embedding, mean pending-task embedding, log device and pending counts."""
        return 2 * self.hidden + 2

    def as_dict(self) -> dict[str, int]:
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
    """One task, C candidates -> scores [C].

    Shapes: task_x [len(TASK_FEATURES)], device_emb [C, E], pair_x [C, len(PAIR_FEATURES)],
    context [G], weights [3] (completion time, utilization, energy; non-negative, any scale)
    -> [C]. Per-candidate terms are broadcast against the task-wide ones; no Expand of C.
    """

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = config or ModelConfig()
        hidden = self.config.scorer_hidden
        self.device_in = nn.Linear(self.config.hidden, hidden)
        self.pair_in = nn.Linear(len(feat.PAIR_FEATURES), hidden, bias=False)
        self.task_in = nn.Linear(len(feat.TASK_FEATURES), hidden, bias=False)
        self.context_in = nn.Linear(self.config.context_dim, hidden, bias=False)
        self.weights_in = nn.Linear(N_OBJECTIVES, hidden, bias=False)
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.heads = nn.Linear(hidden, N_OBJECTIVES)
        nn.init.zeros_(self.heads.weight)
        nn.init.zeros_(self.heads.bias)
        pair_names = feat.names(feat.PAIR_FEATURES)
        select = torch.zeros(len(pair_names), N_OBJECTIVES)
        for objective, name in enumerate(PRIOR_FEATURES):
            select[pair_names.index(name), objective] = 1.0
        self.register_buffer("prior_select", select)  # [PAIR, 3], a MatMul in the exported graph
        self.prior = nn.Parameter(torch.full((N_OBJECTIVES,), PRIOR_INIT))

    def forward(self, task_x: Tensor, device_emb: Tensor, pair_x: Tensor, context: Tensor, weights: Tensor) -> Tensor:
        w = torch.clamp(weights, min=0.0)
        w = w / torch.clamp(w.sum(), min=1e-6)
        shared = self.task_in(task_x) + self.context_in(context) + self.weights_in(w)  # [H]
        h = self.body(self.device_in(device_emb) + self.pair_in(pair_x) + shared)  # [C, H]
        select: Tensor = self.get_buffer("prior_select")
        prior = torch.matmul(pair_x, select) * self.prior  # [C, 3]
        per_objective = self.heads(h) - prior  # [C, 3]
        scores: Tensor = (per_objective * w).sum(dim=1)
        return scores


class HlbGnn(nn.Module):
    """Encoder and scorer together, for training: scores of every device for one task."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = config or ModelConfig()
        self.encoder = Encoder(self.config)
        self.scorer = Scorer(self.config)

    @classmethod
    def random(cls, config: ModelConfig | None = None) -> HlbGnn:
        """An untrained model whose correction heads are random too (a fresh one starts them at zero),
        so every input moves the scores: for tests and benchmarks. Seed torch first."""
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
    model = HlbGnn(ModelConfig(**document["config"]))
    model.load_state_dict(document["state"])
    model.eval()
    return model, str(document["model_version"]), str(document["training_data"])
