"""The GNN policy: hetero-greedy and the rules, deciding with the run times the GNN predicts.

The model predicts, for a task shape on each device, the log of the ratio of the rate the task
will run at to the rate the device profiles give, from device embeddings the encoder builds over
the whole graph (:mod:`hlb.export.model`). :class:`GnnScorer` keeps those embeddings in an
:class:`EmbeddingCache`, runs the speed head once per task shape over every embedded device
(:meth:`GnnScorer.log_ratios`, kept with the cache) and scores as hetero-greedy does with the
corrected speeds (:class:`~hlb.daemon.decide.gnn.speeds.LearnedSpeeds`), which are also what its
rules and the expected ends of its placed tasks read (:attr:`GnnScorer.estimates`). The ``gnn``
preset and the ``rules`` preset thus differ in where run times come from, nothing else.

A cache is immutable (but for the predictions it memoizes) and is replaced by one reference swap,
taken under the daemon's lock, so a request (which holds that lock from its first score to its
last) sees one cache from start to end, never a mix.

Refresh modes (``model.refresh.mode``):

- ``background`` (the daemon): a thread re-encodes when ``min_changed_rows`` device rows changed
  since the last refresh (``InfraGraph.changes``), after any other inventory change, and after
  ``staleness_s`` when anything changed; never sooner than ``min_interval_s`` after the last
  refresh but when a device was added or removed (under a stream of batches, each of which
  changes a thousand rows, refreshing after every one took the cores from the batches). It copies
  the graph's tables under the lock (memory copies, of the task rows the encoder reads only), then
  builds the encoder's inputs from the copies and runs the encoder outside it, so
  requests never wait for either. A request naming a device the cache does not know yet (added
  since the refresh) is decided by the fallback and wakes the thread.
- ``sync`` (the simulator, ``hlb eval``): :meth:`GnnScorer.refresh_if_changed` runs before each
  score, in the caller's thread, under the same rules; a new device always re-encodes first.

The rules (waiting, shortest first, services fitted) are plugins of the ``gnn`` preset
(``hlb.daemon.decide.presets``), which run while this scorer is :attr:`~GnnScorer.ready`. A model
trained without message passing (``gnn-no-graph``) is fed empty neighbour lists, as in training.

Safety: a missing, corrupt or schema-mismatched model, or an inference error, makes the scorer
decide with hetero-greedy (the best baseline), log why once, report itself ``degraded`` and count
each such decision (``on_fallback``). A new model (the files changed, or SIGHUP) is loaded,
checked and warmed up on the current graph, and only then replaces the running one; a bad one is
logged and the running one keeps serving.

Longer than hlb's modules usually are, on purpose: loading, warming up, refreshing and scoring all
turn on the one embedding cache and its swap under the daemon's lock, and are read together.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import structlog
from numpy.typing import NDArray

from hlb.daemon.config import ModelSettings
from hlb.daemon.decide.framework import ObjectiveWeights, Policy, Scores, WaitOptions
from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.gnn.inference import ENCODER_FILE, SCORER_FILE, GnnModel, ModelError, load_model
from hlb.daemon.decide.gnn.speeds import LearnedSpeeds
from hlb.daemon.decide.scorers import HeteroGreedy
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import DeviceProfiles, default_profiles
from hlb.daemon.state.tables import Rows
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

RefreshMode = Literal["background", "sync"]
# (mtime_ns, size, inode) of encoder.onnx and scorer.onnx; None when either is missing.
FileSignature = tuple[tuple[int, int, int], ...] | None
FallbackCounter = Callable[[str], None]

WARM_UP_CANDIDATES = 8
# Task shapes whose predictions one cache keeps (the least recently added dropped beyond).
MAX_SHAPES = 4096
ShapeKey = tuple[str, int, int, bool]  # workload class, gang, task kind, consolidated


def shape_key(spec: ev.TaskSpec, gang: int, consolidated: bool) -> ShapeKey:
    """What one head run serves: a single device is never spread."""
    return (spec.workload_class, gang, int(spec.kind), consolidated or gang == 1)


@dataclass(frozen=True)
class EmbeddingCache:
    """Device embeddings of one graph at one moment, with the model that made them.

    Shapes: ``device_emb`` [D, E] float32, ``context`` [G] float32, ``device_rows`` [D] (the graph
    row of each position, ascending), ``positions`` [capacity] (graph row -> position, -1 for a row
    without a live device when the cache was built). ``device_ids`` holds the id of every row then,
    so a row freed and reused by another device since is recognized as unknown.
    """

    model: GnnModel
    graph: InfraGraph
    device_emb: NDArray[np.float32]
    context: NDArray[np.float32]
    device_rows: Rows
    positions: NDArray[np.int64]
    device_ids: tuple[str | None, ...]
    version: int  # graph.version (inventory) when built
    changes: int  # graph.changes when built
    device_generation: int  # graph.devices.generation (devices added or removed) when built
    built_at: float  # monotonic seconds
    serial: int  # counts the caches one scorer built
    # Per task shape: the head's output for every position [D, 2] (filled as shapes are asked for).
    predictions: dict[ShapeKey, NDArray[np.float64]]
    # Per task shape, devices' generation and capacity: the predicted speed ratio of every graph row [capacity]
    # (1 for a row without an embedding), what an estimate multiplies the profiles' speeds by.
    factors: dict[tuple[ShapeKey, int, int], NDArray[np.float64]]
    # Per task shape: the head's prior features of every position [D, len(PRIOR_FEATURES)], kept
    # once the feature log (hlb.daemon.record.features) asks for them (``GnnScorer.shape_inputs``).
    priors: dict[ShapeKey, NDArray[np.float32]] = field(default_factory=dict)

    def positions_of(self, graph: InfraGraph, rows: Rows) -> NDArray[np.int64] | None:
        """Cache positions of graph device ``rows``; None when any is not in this cache. [C] -> [C]."""
        positions = self.known_positions(graph, rows)
        return None if (positions < 0).any() else positions

    def known_positions(self, graph: InfraGraph, rows: Rows) -> NDArray[np.int64]:
        """Cache position of each graph device row, -1 for a row this cache has no embedding of
        (never live, or holding another device now). [C] -> [C]."""
        if graph is not self.graph:
            return np.full(len(rows), -1, dtype=np.int64)
        inside = rows < len(self.positions)
        out: NDArray[np.int64] = np.full(len(rows), -1, dtype=np.int64)
        out[inside] = self.positions[rows[inside]]
        if graph.devices.generation != self.device_generation:  # devices came or went: a row may hold another now
            ids = graph.devices.ids
            for i in np.flatnonzero(out >= 0).tolist():
                row = int(rows[i])
                if ids[row] != self.device_ids[row]:
                    out[i] = -1
        return out


def file_signature(directory: Path) -> FileSignature:
    """What identifies the model files on disk now; None when either is missing."""
    signature = []
    for name in (ENCODER_FILE, SCORER_FILE):
        try:
            st = os.stat(directory / name)
        except OSError:
            return None
        signature.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(signature)


class GnnScorer(Policy):
    """Hetero-greedy's score with the GNN's speeds; hetero-greedy with the profiles alone whenever
    the GNN cannot predict (see the module docstring). Scores depend on the row and the task shape
    only, so a batch reuses them as it does hetero-greedy's."""

    row_local = True

    def __init__(
        self,
        settings: ModelSettings | None = None,
        weights: ObjectiveWeights | None = None,
        *,
        mode: RefreshMode | None = None,
        on_fallback: FallbackCounter | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        profiles: DeviceProfiles | None = None,
    ) -> None:
        self.settings = settings or ModelSettings()
        self.weights = weights or ObjectiveWeights()
        self.mode: RefreshMode = mode or self.settings.refresh.mode
        # The fallback: hetero-greedy with the profiles the scheduler is told (the model's prior).
        self.fallback = HeteroGreedy(self.weights, profiles or default_profiles())
        self.speeds, self.learned = self._learned_greedy()
        self.binding_lowers_scores = self.fallback.binding_lowers_scores
        self.on_fallback = on_fallback or (lambda reason: None)
        self._monotonic = monotonic
        self._serial = 0
        self._cache: EmbeddingCache | None = None
        self._degraded = "model not loaded yet"
        self._degraded_code = "model_missing"
        self._logged: tuple[str, str] | None = None
        self._loaded_signature: FileSignature = None
        self._rejected: list[FileSignature] = []  # the files last refused, if any (a missing file is None)
        self._tried_load = False
        self._graph: InfraGraph | None = None
        self._lock: threading.RLock | None = None
        self._work = threading.Lock()  # one load or refresh at a time
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Unix ms that date task features (waiting time, deadline slack); a simulation's clock in one.
        self.clock_ms: Callable[[], float] = lambda: time.time() * 1000.0
        self.refreshes = 0
        self.reloads_rejected = 0
        # Told of every task that finished on devices this policy placed it on, with its run time (s).
        self.finish_listeners: list[Callable[[ev.TaskSpec, InfraGraph, Rows, float], None]] = []

    # -- what the daemon reports -------------------------------------------------------------

    @property
    def name(self) -> str:
        """``gnn`` while the model decides, else the fallback's name."""
        return "gnn" if self._cache is not None else self.fallback.name

    @name.setter
    def name(self, value: str) -> None:
        raise AttributeError("the gnn policy's name follows its state")

    @property
    def degraded(self) -> str:
        """Why the GNN does not decide now (the fallback does); empty while it does."""
        return "" if self._cache is not None else f"{self._degraded_code}: {self._degraded}"

    @property
    def estimates(self) -> DeviceProfiles:
        """The profiles corrected by the model's predictions (the profiles alone without a model)."""
        return self.speeds

    @property
    def ready(self) -> bool:
        """While the GNN decides (a model is loaded): the rules of its preset run only then."""
        return self._cache is not None

    @property
    def model_version(self) -> str:
        cache = self._cache
        return cache.model.version if cache is not None else ""

    @property
    def provider(self) -> str:
        """The onnxruntime execution provider the model runs on; empty without a model."""
        cache = self._cache
        return cache.model.providers[0] if cache is not None and cache.model.providers else ""

    @property
    def cache(self) -> EmbeddingCache | None:
        return self._cache

    # -- scoring -----------------------------------------------------------------------------

    def _learned_greedy(self) -> tuple[LearnedSpeeds, HeteroGreedy]:
        """The corrected profiles over this scorer's predictions, and hetero-greedy deciding by them."""
        speeds = LearnedSpeeds(self.fallback.profiles, self.speed_factors, self.log_ratios, lambda: self._serial)
        return speeds, HeteroGreedy(self.weights, speeds)

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Scores:
        if self.mode == "sync":
            self.refresh_if_changed(graph)
        cache = self._cache  # one read: everything below comes from this cache
        if cache is None:
            return self._fall_back(self._degraded_code, spec, graph, rows)
        if cache.positions_of(graph, rows) is None:  # a device newer than the cache: refresh soon
            self._wake.set()
            return self._fall_back("embeddings_stale", spec, graph, rows)
        if self._shape_predictions(cache, spec, max(1, spec.num_devices), True) is None:
            return self._fall_back("inference_error", spec, graph, rows)
        return self.learned.score(spec, graph, rows)

    def batch_scorer(self, spec: ev.TaskSpec, graph: InfraGraph) -> Callable[[Rows], Scores]:
        """Hetero-greedy's batch scorer over the corrected speeds: the predictions for ``spec``'s
        shape are computed once for every device (a device without an embedding gets its profiled
        speed)."""
        if self._cache is None:
            return self.fallback.batch_scorer(spec, graph)
        return self.learned.batch_scorer(spec, graph)

    def log_ratios(
        self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, gang: int, consolidated: bool
    ) -> NDArray[np.float64] | None:
        """The head's output for ``spec``'s shape on ``rows`` (:class:`LearnedSpeeds` reads it): per
        row the predicted log speed ratio and log standard deviation, NaN for a row without an
        embedding; None while the model does not serve (or just failed). [C] -> [C, 2]."""
        cache = self._cache
        if cache is None:
            return None
        predictions = self._shape_predictions(cache, spec, gang, consolidated)
        if predictions is None:
            return None
        positions = cache.known_positions(graph, rows)
        out = np.full((len(rows), 2), np.nan)
        known = positions >= 0
        out[known] = predictions[positions[known]]
        return out

    def speed_factors(
        self, spec: ev.TaskSpec, graph: InfraGraph, gang: int, consolidated: bool
    ) -> NDArray[np.float64] | None:
        """The predicted speed ratio of every device row of ``graph`` for ``spec``'s shape (1 where
        the model has no embedding), kept with the cache until a device is added or removed; None
        while the model does not serve (or just failed). -> [capacity]."""
        cache = self._cache
        if cache is None:
            return None
        # Rows map to the same devices until one is added or removed (an inventory event that only
        # updates one keeps the factors).
        key = (shape_key(spec, gang, consolidated), graph.devices.generation, graph.devices.capacity)
        known = cache.factors.get(key) if graph is cache.graph else None
        if known is not None:
            return known
        predictions = self._shape_predictions(cache, spec, gang, consolidated)
        if predictions is None:
            return None
        every = np.arange(graph.devices.capacity, dtype=np.int64)
        positions = cache.known_positions(graph, every)
        factors = np.ones(len(every))
        hit = positions >= 0
        log_ratio = predictions[positions[hit], 0]
        if self.settings.estimate == "mean":  # the expected run time: speed exp(m - s**2 / 2)
            log_ratio = log_ratio - 0.5 * np.exp(2.0 * predictions[positions[hit], 1])
        factors[hit] = np.exp(log_ratio)
        if graph is cache.graph:
            if len(cache.factors) >= MAX_SHAPES:
                cache.factors.pop(next(iter(cache.factors)))
            cache.factors[key] = factors
        return factors

    def _shape_predictions(
        self, cache: EmbeddingCache, spec: ev.TaskSpec, gang: int, consolidated: bool
    ) -> NDArray[np.float64] | None:
        """The head's output for every embedded device and ``spec``'s shape [D, 2]: kept in the cache
        after its first run; None when that run failed (the model is then out of use)."""
        key = shape_key(spec, gang, consolidated)
        known = cache.predictions.get(key)
        if known is not None:
            return known
        rows = cache.device_rows
        try:
            if not cache.model.trained_on(spec):  # a family or kind training never saw: the prior's
                out = np.zeros((len(rows), 2))
            elif len(rows):
                prior = feat.prior_features(spec, cache.graph, rows, self.fallback.profiles, gang, key[3])
                shape = feat.shape_features(spec, gang, key[3])
                out = cache.model.predict(shape, cache.device_emb, prior, cache.context).astype(np.float64)
            else:
                out = np.zeros((0, 2))
            if out.shape != (len(rows), 2) or not np.isfinite(out).all():
                raise ModelError(f"scorer returned shape {out.shape} or values that are not finite")
        except Exception as error:  # onnxruntime raises its own untyped errors
            self._model_failed(cache, "inference_error", f"scorer failed: {error}")
            return None
        if len(cache.predictions) >= MAX_SHAPES:
            cache.priors.pop(next(iter(cache.predictions)), None)
            cache.predictions.pop(next(iter(cache.predictions)))
        cache.predictions[key] = out
        return out

    def shape_inputs(
        self, spec: ev.TaskSpec, gang: int, consolidated: bool
    ) -> tuple[EmbeddingCache, NDArray[np.float64], NDArray[np.float32]] | None:
        """What the head read and predicted for ``spec``'s shape in the running cache, as a decision
        of that shape just used it: the cache, the predictions of every position [D, 2] and their
        prior features [D, len(PRIOR_FEATURES)] (computed at the first call for the shape and kept
        with the cache). None while the model does not serve, or when no
        decision has asked for this shape since the last refresh. Call it under the daemon's lock."""
        cache = self._cache
        if cache is None:
            return None
        key = shape_key(spec, gang, consolidated)
        predictions = cache.predictions.get(key)
        if predictions is None:
            return None
        prior = cache.priors.get(key)
        if prior is None:
            prior = feat.prior_features(spec, cache.graph, cache.device_rows, self.fallback.profiles, gang, key[3])
            cache.priors[key] = prior
        return cache, predictions, prior

    def prepare(self, graph: InfraGraph) -> None:
        """Sync mode: load the model on first use, re-encode a changed graph (:meth:`refresh_if_changed`)."""
        if self.mode == "sync":
            self.refresh_if_changed(graph)

    def score_waits(self, spec: ev.TaskSpec, graph: InfraGraph, waits: WaitOptions) -> Scores | None:
        """Hetero-greedy's scores of busy devices once free, their run times from the corrected
        speeds (the rules computed them with :attr:`estimates`); None while the GNN does not serve."""
        if self._cache is None:
            return None
        return self.learned.score_waits(spec, graph, waits)

    def attach(self, sim: Any) -> None:
        """In a simulation (``hlb.sim.simulator.Simulation``): date the graph's tasks by its clock."""
        self.clock_ms = sim.clock.now_ms

    def __deepcopy__(self, memo: dict[int, Any]) -> GnnScorer:
        """A copy for a simulation's fork (the lookahead oracle forks its base policy at each
        decision): it shares the loaded model, re-encodes it on the fork's graph at its first
        decision, and dates tasks by the fork's clock (copied through ``memo`` with the
        simulation). Only a policy that refreshes in sync mode (a simulation's) can be copied: a
        background refresher belongs to one graph."""
        if self._thread is not None:
            raise TypeError("a GnnScorer with a background refresher cannot be copied")
        twin = copy.copy(self)
        twin.clock_ms = copy.deepcopy(self.clock_ms, memo)
        twin.speeds, twin.learned = twin._learned_greedy()
        return twin

    def placed(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> None:
        self.fallback.placed(spec, graph, rows)

    def finished(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float) -> None:
        self.fallback.finished(spec, graph, rows, ran_s)  # the profiles under the predictions, if they learn
        for listener in self.finish_listeners:  # shadow scoring (hlb.daemon.record.shadow)
            listener(spec, graph, rows, ran_s)

    def _fall_back(self, reason: str, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Scores:
        self.on_fallback(reason)
        return self.fallback.score(spec, graph, rows)

    # -- loading and refreshing --------------------------------------------------------------

    def refresh_if_changed(self, graph: InfraGraph) -> bool:
        """Sync mode: load the model on first use, re-encode when the graph changed enough. True if it did."""
        if not self._tried_load:
            self._tried_load = True
            self._graph = graph
            self.reload_model(retry=True)
            return self._cache is not None
        cache = self._cache
        if cache is None:
            return False
        if cache.graph is not graph or self._due(cache, graph, staleness=False):
            return self._refresh(cache.model, graph)
        return False

    def start(self, graph: InfraGraph, lock: threading.RLock) -> None:
        """Background mode: load and warm up the model on ``graph`` (before the daemon reports
        SERVING), then keep the embeddings fresh from a thread until :meth:`stop`."""
        self._graph, self._lock = graph, lock
        self._tried_load = True
        self.reload_model(retry=True)
        if self.mode == "background" and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gnn-refresh", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10.0)
            self._thread = None

    def configure(self, settings: ModelSettings) -> None:
        """Apply new ``model`` settings (a reload): a new path or session settings load the model
        again, validated before it replaces the running one; raises ``ModelError`` when it fails
        (the running model and settings stay)."""
        old = self.settings
        sessions_changed = (old.directory, old.intra_op_threads, old.optimization, old.providers) != (
            settings.directory,
            settings.intra_op_threads,
            settings.optimization,
            settings.providers,
        )
        if not sessions_changed:
            self.settings = settings
            return
        with self._work:
            _, cache = self._load_and_warm(settings, self._graph_for_load())
            self.settings = settings
            self._install(cache, file_signature(settings.directory))

    def reload_model(self, retry: bool = False) -> bool:
        """Load the model files when they changed since the running model was loaded (or when none
        runs); True when a new model now serves. With ``retry`` (SIGHUP), files refused before are
        tried again."""
        directory = self.settings.directory
        signature = file_signature(directory)
        with self._work:
            if signature is not None and signature == self._loaded_signature and self._cache is not None:
                return False
            if not retry and signature in self._rejected:
                return False
            graph = self._graph_for_load()
            try:
                _, cache = self._load_and_warm(self.settings, graph)
            except Exception as error:  # ModelError, or onnxruntime failing the warm-up
                self._rejected = [signature]
                code = error.reason if isinstance(error, ModelError) else "inference_error"
                code = code if code.startswith(("model_", "inference")) else f"model_{code}"
                if self._cache is not None:
                    self.reloads_rejected += 1
                    log.error(
                        "new gnn model refused; the running one keeps serving",
                        path=str(directory),
                        reason=code,
                        error=str(error),
                        model_version=self._cache.model.version,
                    )
                else:
                    self._set_degraded(code, str(error))
                return False
            self._install(cache, signature)
            return True

    def serve_prior(self, reason: str) -> None:
        """Decide with the fallback (the profiles alone: zero correction) until a model loads again
        (a new ``model.path``, its files changing, SIGHUP): the model lifecycle's last resort."""
        with self._work:
            cache = self._cache
            if cache is not None:
                self._model_failed(cache, "model_rolled_back", reason)
            else:
                self._set_degraded("model_rolled_back", reason)

    def _graph_for_load(self) -> InfraGraph:
        return self._graph if self._graph is not None else InfraGraph()

    def _load_and_warm(self, settings: ModelSettings, graph: InfraGraph) -> tuple[GnnModel, EmbeddingCache]:
        directory = settings.directory
        if not directory.is_dir():
            raise ModelError(f"{directory}: model folder not found", "missing")
        model = load_model(directory, settings.intra_op_threads, settings.optimization, settings.providers)
        cache = self._encode(model, graph)
        self._warm_up_scorer(cache, graph)
        return model, cache

    def _install(self, cache: EmbeddingCache, signature: FileSignature) -> None:
        previous = self._cache
        self._swap(cache)
        self._loaded_signature = signature
        self._rejected = []
        self._logged = None
        log.info(
            "gnn model serving",
            path=str(self.settings.directory),
            model_version=cache.model.version,
            provider=cache.model.providers[0] if cache.model.providers else "",
            providers=cache.model.providers,
            replaced=previous.model.version if previous is not None else None,
            devices=len(cache.device_rows),
        )

    def _swap(self, cache: EmbeddingCache | None) -> None:
        """Replace the cache in one reference assignment, between requests (under the daemon's lock)."""
        if self._lock is None:
            self._cache = cache
            return
        with self._lock:
            self._cache = cache

    def _encode(self, model: GnnModel, graph: InfraGraph) -> EmbeddingCache:
        """Run the encoder over ``graph``: inputs read under the lock, the encoder outside it."""
        lock = self._lock if graph is self._graph and self._lock is not None else None
        if lock is not None:
            with lock:
                tables, now_ms, marks = self._read(graph)
        else:
            tables, now_ms, marks = self._read(graph)
        inputs = feat.encoder_inputs(tables, now_ms, model.message_passing)
        device_emb, context = model.encode(inputs)
        n = len(inputs.device_rows)
        if device_emb.ndim != 2 or device_emb.shape[0] != n or context.ndim != 1:
            shapes = f"device_emb {device_emb.shape} and context {context.shape}"
            raise ModelError(f"encoder returned {shapes} for {n} devices")
        if not (np.isfinite(device_emb).all() and np.isfinite(context).all()):
            raise ModelError("encoder returned values that are not finite")
        # Never written again: the feature log keeps references to them until its records are built.
        device_emb.flags.writeable = context.flags.writeable = False
        version, changes, capacity, ids, device_generation = marks
        positions = np.full(capacity, -1, dtype=np.int64)
        positions[inputs.device_rows] = np.arange(n, dtype=np.int64)
        return EmbeddingCache(
            model=model,
            graph=graph,
            device_emb=device_emb,
            context=context,
            device_rows=inputs.device_rows,
            positions=positions,
            device_ids=ids,
            version=version,
            changes=changes,
            device_generation=device_generation,
            built_at=self._monotonic(),
            serial=self._next_serial(),
            predictions={},
            factors={},
        )

    def _next_serial(self) -> int:
        self._serial += 1
        return self._serial

    def _read(self, graph: InfraGraph) -> tuple[InfraGraph, int, tuple[int, int, int, tuple[str | None, ...], int]]:
        """What the encoder reads, taken at one moment (under the lock): copies of the graph's
        tables, from which its inputs are built once the lock is released, the time (Unix ms) and
        the marks that date the cache."""
        marks = (
            graph.version,
            graph.changes,
            graph.devices.capacity,
            tuple(graph.devices.ids),
            graph.devices.generation,
        )
        return graph.tables_copy(feat.encoded_task_rows(graph.task_table)), int(self.clock_ms()), marks

    def _warm_up_scorer(self, cache: EmbeddingCache, graph: InfraGraph) -> None:
        """One head run on real cached devices (zero embeddings when the graph has none)."""
        spec = ev.TaskSpec(id="hlb-warm-up", work_ref_s=600.0, memory_per_device_gb=1.0)
        rows = cache.device_rows[:WARM_UP_CANDIDATES]
        if len(rows):
            lock = self._lock if graph is self._graph and self._lock is not None else None
            if lock is not None:
                with lock:
                    prior = feat.prior_features(spec, graph, rows, self.fallback.profiles)
            else:
                prior = feat.prior_features(spec, graph, rows, self.fallback.profiles)
            emb = cache.device_emb[: len(rows)]
        else:
            prior = np.zeros((1, len(feat.PRIOR_FEATURES)), dtype=np.float32)
            emb = np.zeros((1, cache.device_emb.shape[1]), dtype=np.float32)
        out = cache.model.predict(feat.shape_features(spec), emb, prior, cache.context)
        if out.shape != (len(prior), 2) or not np.isfinite(out).all():
            raise ModelError(f"scorer returned shape {out.shape} or values that are not finite for {len(prior)}")

    def _due(self, cache: EmbeddingCache, graph: InfraGraph, staleness: bool) -> bool:
        """Whether to re-encode now; ``staleness``: for the background thread, else for a sync
        caller, which re-encodes at once after any inventory change. The thread re-encodes at once
        when a device was added or removed; for any other change (an inventory event updating a
        device, host, switch or link, or changed rows) it keeps ``min_interval_s`` between
        refreshes."""
        inventory_changed = graph.version != cache.version
        if inventory_changed and (not staleness or graph.devices.generation != cache.device_generation):
            return True
        if staleness and self._monotonic() - cache.built_at < self.settings.refresh.min_interval_s:
            return False
        if inventory_changed:
            return True
        changed = graph.changes - cache.changes
        if changed >= self.settings.refresh.min_changed_rows:
            return True
        return staleness and changed > 0 and self._monotonic() - cache.built_at >= self.settings.refresh.staleness_s

    def _refresh(self, model: GnnModel, graph: InfraGraph) -> bool:
        # Never waits: a sync caller may hold the daemon's lock, which a load in progress needs.
        if not self._work.acquire(blocking=False):
            return False
        try:
            return self._refresh_locked(model, graph)
        finally:
            self._work.release()

    def _refresh_locked(self, model: GnnModel, graph: InfraGraph) -> bool:
        current = self._cache
        if current is None or current.model is not model:  # failed or replaced meanwhile
            return False
        try:
            cache = self._encode(model, graph)
        except Exception as error:
            self._model_failed(current, "inference_error", f"encoder failed: {error}")
            return False
        if self._cache is not current:
            return False
        self._swap(cache)
        self.refreshes += 1
        return True

    def _run(self) -> None:
        """The background refresh loop."""
        failing = False
        while not self._stop.is_set():
            self._wake.wait(self.settings.refresh.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                if self.settings.watch:
                    self.reload_model()
                cache, graph = self._cache, self._graph
                if cache is not None and graph is not None and self._due(cache, graph, staleness=True):
                    self._refresh(cache.model, graph)
                failing = False
            except Exception:
                if not failing:
                    log.exception("gnn refresh failed; retrying")
                failing = True

    def _model_failed(self, cache: EmbeddingCache, code: str, message: str) -> None:
        """The running model failed: stop using it (until the files change, or SIGHUP)."""
        if self._cache is cache:
            self._swap(None)
        self._rejected = [self._loaded_signature]
        self._loaded_signature = None
        self._set_degraded(code, message)

    def _set_degraded(self, code: str, message: str) -> None:
        self._degraded_code, self._degraded = code, message
        if self._logged != (code, message):
            self._logged = (code, message)
            log.error(
                "gnn policy degraded: deciding with the fallback",
                fallback=self.fallback.name,
                reason=code,
                error=message,
                path=str(self.settings.directory),
            )


__all__ = ["EmbeddingCache", "GnnScorer", "file_signature"]
