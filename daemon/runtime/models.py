"""Models through Kafka: bundles on the compacted models topic, their verdicts, ``hlb models``.

A bundle is a model folder (``encoder.onnx``, ``scorer.onnx``, ``card.json``) cut into
:class:`~hlb.v1.models_pb2.ModelPart` records that each fit ``kafka.max_event_bytes`` and the
broker's default record limit, then a :class:`~hlb.v1.models_pb2.ModelManifest` naming every
file's size, SHA-256 and part count, and the model card (keys: ``proto/hlb/v1/models.proto``).
Beside the bundles the topic holds control records: each version's verdict (``promoted``,
``rolled_back``, ``refused``) and the operator's ``pin``. The topic is compacted, so each key keeps
its newest record and a reader sees the whole state by reading it from its start
(:class:`ModelCatalog`).

A reader assembles a bundle only when every part its manifest lists is there and each file's
SHA-256 matches (:meth:`ModelCatalog.assemble`, :class:`~hlb.daemon.errors.BundleError` with the
reason otherwise) and writes it under the state directory in one rename (:func:`install_bundle`):
never a half-installed model. The daemon's use of them is ``hlb.daemon.runtime.lifecycle``.

What the fleet runs follows from the topic alone (:meth:`ModelCatalog.target`): the pinned
version while a pin stands, else the newest promoted version not rolled back since, else the
model ``model.path`` names.
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import structlog

from hlb.daemon.bus.seam import Publisher, RawEvent
from hlb.daemon.config import EX_CONFIG, Settings, default_config_path, load_settings
from hlb.daemon.errors import BrokerError, BundleError, ConfigError
from hlb.v1 import models_pb2 as mp

log = structlog.get_logger(__name__)

ENCODER, SCORER, CARD = "encoder.onnx", "scorer.onnx", "card.json"
BUNDLE_FILES = (ENCODER, SCORER, CARD)
# The broker's default record limit (message.max.bytes, 1,048,588 bytes): a part stays under it
# whatever kafka.max_event_bytes says, with this much room for its key, framing and fields.
BROKER_RECORD_BYTES = 1_048_588
PART_OVERHEAD_BYTES = 4096
Action: TypeAlias = mp.ModelControl.Action.ValueType
ACTION_NAMES: dict[int, str] = {
    mp.ModelControl.PROMOTED: "promoted",
    mp.ModelControl.ROLLED_BACK: "rolled_back",
    mp.ModelControl.PIN: "pin",
    mp.ModelControl.UNPIN: "unpin",
    mp.ModelControl.REFUSED: "refused",
}


def part_bytes(settings: Settings) -> int:
    """The most bytes of a file one part carries: under ``kafka.max_event_bytes`` and the
    broker's default record limit, with room for the record's key and fields."""
    return min(settings.kafka.max_event_bytes, BROKER_RECORD_BYTES) - PART_OVERHEAD_BYTES


def who() -> str:
    """``user@host``: who publishes or decides by hand."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def now_ms() -> int:
    return int(time.time() * 1000)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- writing -------------------------------------------------------------------------------------


def model_version(directory: Path) -> str:
    """The version the ONNX files of ``directory`` carry (``hlb.model_version``), after checking
    them against this hlb's feature schema as the daemon would; ``BundleError`` otherwise."""
    from hlb.daemon.decide.gnn.inference import ModelError, load_model  # onnxruntime: only when publishing

    try:
        model = load_model(directory)
    except ModelError as exc:
        raise BundleError(f"{directory}: not a model this hlb can run: {exc}") from None
    if not model.version:
        raise BundleError(f"{directory}: the ONNX files carry no hlb.model_version; export them with one")
    return model.version


def bundle_files(directory: Path, card: Mapping[str, Any]) -> dict[str, bytes]:
    """The files of a bundle: the two ONNX files of ``directory`` and its ``card.json`` (``card``
    written as JSON where the folder has none)."""
    files: dict[str, bytes] = {}
    for name in (ENCODER, SCORER):
        path = directory / name
        if not path.is_file():
            raise BundleError(f"{directory}: {name} missing")
        files[name] = path.read_bytes()
    card_path = directory / CARD
    files[CARD] = card_path.read_bytes() if card_path.is_file() else json.dumps(card, indent=2).encode()
    return files


def bundle_records(
    version: str,
    files: Mapping[str, bytes],
    card: Mapping[str, Any],
    chunk: int,
    by: str,
    at_ms: int,
    *,
    skip_shadow: bool = False,
) -> list[tuple[bytes, bytes]]:
    """The (key, value) records of one bundle: every part, then its manifest."""
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    records: list[tuple[bytes, bytes]] = []
    manifest = mp.ModelManifest(
        version=version, card_json=json.dumps(card), published_at_ms=at_ms, published_by=by, skip_shadow=skip_shadow
    )
    for name, data in files.items():
        parts = max(1, -(-len(data) // chunk))
        for index in range(parts):
            part = mp.ModelPart(version=version, file=name, index=index, data=data[index * chunk : (index + 1) * chunk])
            records.append((part_key(version, name, index), part.SerializeToString()))
        manifest.files.append(mp.ModelFile(name=name, size=len(data), sha256=sha256(data), parts=parts))
    records.append((manifest_key(version), manifest.SerializeToString()))
    return records


def manifest_key(version: str) -> bytes:
    return f"manifest/{version}".encode()


def part_key(version: str, name: str, index: int) -> bytes:
    return f"part/{version}/{name}/{index}".encode()


def verdict_key(version: str) -> bytes:
    return f"verdict/{version}".encode()


PIN_KEY = b"pin"


def control_record(action: Action, version: str, by: str, reason: str, at_ms: int) -> tuple[bytes, bytes]:
    """The (key, value) of a control record: a version's verdict, or the pin."""
    control = mp.ModelControl(action=action, version=version, by=by, at_ms=at_ms, reason=reason)
    key = PIN_KEY if action in (mp.ModelControl.PIN, mp.ModelControl.UNPIN) else verdict_key(version)
    return key, control.SerializeToString()


def publish_model(
    settings: Settings,
    directory: Path,
    card: Mapping[str, Any],
    *,
    publisher: Publisher | None = None,
    existing: Sequence[RawEvent] | None = None,
    by: str | None = None,
    skip_shadow: bool = False,
) -> str:
    """Publish the model folder ``directory`` (``encoder.onnx``, ``scorer.onnx``, and its
    ``card.json`` or ``card``) as a bundle on ``settings.learning.models_topic``; returns its
    version (the ONNX files' ``hlb.model_version``). Every daemon with ``learning.auto_models``
    then shadows it as a candidate; with ``skip_shadow`` the canary cell tries it at once (its
    canary still judges it).

    ``publisher`` (and ``existing``, the topic's records now): a bus of one's own, e.g. a test's
    ``MemoryBus``; by default a Kafka producer from ``settings.kafka``, flushed before this
    returns (``BrokerError`` when the broker did not take every record). A version already on the
    topic with the same files is not published again; with other files it is refused
    (``BundleError``: export with a new version)."""
    version = model_version(directory)
    files = bundle_files(directory, card)
    for named in ("version", "model_version"):
        if named in card and str(card[named]) != version:
            raise BundleError(f"the card says {named} {card[named]!r} but the ONNX files are version {version!r}")
    owned = publisher is None
    if publisher is None:
        from hlb.daemon.bus.kafka import KafkaBus  # librdkafka loads only when Kafka is used

        bus = KafkaBus(settings.kafka)
        bus.ensure_topics([], compacted=[settings.learning.models_topic])
        existing = bus.read_all(settings.learning.models_topic, timeout_s=60.0)
        publisher = bus.publisher()
    known = ModelCatalog.read(existing or ()).manifests.get(version)
    if known is not None:
        if {f.name: f.sha256 for f in known.files} == {n: sha256(d) for n, d in files.items()}:
            log.info("model already published", version=version)
            return version
        raise BundleError(f"version {version!r} is on the topic already with other files; export with a new version")
    topic = settings.learning.models_topic
    records = bundle_records(version, files, card, part_bytes(settings), by or who(), now_ms(), skip_shadow=skip_shadow)
    for key, value in records:
        publisher.publish(topic, key, value)
    if owned and publisher.flush(60.0):
        raise BrokerError(f"the broker did not take every record of model {version}; publish it again")
    log.info("model published", version=version, topic=topic, records=len(records), bytes=sum(map(len, files.values())))
    return version


def publish_control(
    settings: Settings,
    action: Action,
    version: str,
    reason: str,
    *,
    publisher: Publisher,
    by: str | None = None,
    at_ms: int | None = None,
) -> None:
    """Queue a control record (a verdict or the pin) on the models topic."""
    key, value = control_record(action, version, by or who(), reason, now_ms() if at_ms is None else at_ms)
    publisher.publish(settings.learning.models_topic, key, value)


# -- reading -------------------------------------------------------------------------------------


@dataclass
class ModelCatalog:
    """The models topic folded as compaction keeps it: each key's newest record."""

    manifests: dict[str, mp.ModelManifest] = field(default_factory=dict)
    parts: dict[tuple[str, str, int], bytes] = field(default_factory=dict)
    verdicts: dict[str, mp.ModelControl] = field(default_factory=dict)
    pin: mp.ModelControl | None = None
    unreadable: int = 0  # records that are not what their key says (logged)

    @classmethod
    def read(cls, records: Iterable[RawEvent]) -> ModelCatalog:
        catalog = cls()
        catalog.update(records)
        return catalog

    def update(self, records: Iterable[RawEvent]) -> set[str]:
        """Fold ``records`` in; returns the versions whose manifest, parts or verdict changed."""
        touched: set[str] = set()
        for record in records:
            key = (record.key or b"").decode("utf-8", "replace")
            try:
                version = self._fold(key, record.value)
            except Exception as exc:  # a foreign or corrupt record: logged, the rest still read
                self.unreadable += 1
                log.warning("unreadable record on the models topic", key=key, offset=record.offset, error=str(exc))
                continue
            if version is not None:
                touched.add(version)
        return touched

    def _fold(self, key: str, value: bytes | None) -> str | None:
        kind, _, rest = key.partition("/")
        if kind == "manifest":
            return self._put(self.manifests, rest, value, mp.ModelManifest.FromString)
        if kind == "verdict":
            return self._put(self.verdicts, rest, value, mp.ModelControl.FromString)
        if kind == "part":
            version, name, index = rest.rsplit("/", 2)
            slot = (version, name, int(index))
            if value is None:
                self.parts.pop(slot, None)
            else:
                part = mp.ModelPart.FromString(value)
                if (part.version, part.file, part.index) != slot:
                    raise ValueError(f"part {part.version}/{part.file}/{part.index} under key {key}")
                self.parts[slot] = part.data
            return version
        if key == PIN_KEY.decode():
            self.pin = mp.ModelControl.FromString(value) if value is not None else None
            return None
        raise ValueError("not a key of the models topic")

    @staticmethod
    def _put(table: dict[str, Any], version: str, value: bytes | None, parse: Any) -> str:
        if value is None:
            table.pop(version, None)
        else:
            table[version] = parse(value)
        return version

    @property
    def pinned(self) -> str | None:
        pin = self.pin
        return pin.version if pin is not None and pin.action == mp.ModelControl.PIN and pin.version else None

    def verdict(self, version: str) -> str:
        """``promoted``, ``rolled_back``, ``refused``, or empty while none was given."""
        control = self.verdicts.get(version)
        return ACTION_NAMES.get(control.action, "") if control is not None else ""

    def promoted(self) -> list[str]:
        """The versions promoted and not rolled back since, newest promotion last."""
        kept = [c for c in self.verdicts.values() if c.action == mp.ModelControl.PROMOTED]
        return [c.version for c in sorted(kept, key=lambda c: c.at_ms)]

    def target(self) -> str | None:
        """What every cell runs: the pinned version, else the newest promoted one; None: the model
        each daemon's ``model.path`` names."""
        pinned = self.pinned
        if pinned is not None:
            return pinned
        promoted = self.promoted()
        return promoted[-1] if promoted else None

    def candidates(self) -> list[str]:
        """Versions with a manifest and no verdict, oldest publication first: still to be tried."""
        waiting = [m for v, m in self.manifests.items() if v not in self.verdicts]
        return [m.version for m in sorted(waiting, key=lambda m: m.published_at_ms)]

    def assemble(self, version: str) -> dict[str, bytes]:
        """The files of ``version``'s bundle, each checked against its manifest; ``BundleError``
        with the reason when one is missing, incomplete or does not match."""
        manifest = self.manifests.get(version)
        if manifest is None:
            raise BundleError(f"model {version}: no manifest on the topic")
        names = [f.name for f in manifest.files]
        for needed in (ENCODER, SCORER):
            if needed not in names:
                raise BundleError(f"model {version}: the manifest lists no {needed}")
        files: dict[str, bytes] = {}
        for entry in manifest.files:
            if entry.name not in BUNDLE_FILES:
                raise BundleError(f"model {version}: the manifest lists {entry.name!r}, not a file of a bundle")
            missing = [i for i in range(entry.parts) if (version, entry.name, i) not in self.parts]
            if missing:
                raise BundleError(f"model {version}: {entry.name} parts {missing[:5]} of {entry.parts} missing")
            data = b"".join(self.parts[(version, entry.name, i)] for i in range(entry.parts))
            if len(data) != entry.size:
                raise BundleError(f"model {version}: {entry.name} is {len(data)} bytes, the manifest says {entry.size}")
            if sha256(data) != entry.sha256:
                raise BundleError(f"model {version}: {entry.name} does not match its SHA-256 in the manifest")
            files[entry.name] = data
        return files


def install_bundle(root: Path, version: str, files: Mapping[str, bytes]) -> Path:
    """Write ``files`` to ``root/<version>`` in one rename (a folder half written is never seen
    there); an existing folder with the same files is kept. Returns the folder."""
    if not version or "/" in version or version.startswith("."):
        raise BundleError(f"model version {version!r} cannot name a folder")
    target = root / version
    if target.is_dir() and all((target / n).is_file() and (target / n).read_bytes() == d for n, d in files.items()):
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=root))
    try:
        for name, data in files.items():
            with open(staging / name, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
    except OSError:  # a full disk: nothing of it stays
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if target.exists():  # other files under this version (a topic recreated): replaced whole
        old = Path(tempfile.mkdtemp(prefix=f".{version}.old.", dir=root))
        target.rename(old / "model")
        staging.rename(target)
        for path in (old / "model").iterdir():
            path.unlink()
        (old / "model").rmdir()
        old.rmdir()
    else:
        staging.rename(target)
    return target


# -- hlb models ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Models on the models topic (learning.models_topic): publish a model folder as a bundle, list the "
        "bundles and their verdicts, pin a version on every cell, or roll back (docs/learning.md)."
    )
    parser.add_argument(
        "--config", type=Path, default=None, help=f"the daemon's YAML config (default: {default_config_path()})"
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    publish = actions.add_parser("publish", help="publish a model folder (encoder.onnx, scorer.onnx, card.json)")
    publish.add_argument("directory", type=Path)
    publish.add_argument(
        "--skip-shadow",
        action="store_true",
        help="you vouch for it: the canary cell tries it at once, without its shadow (its canary still judges it)",
    )
    actions.add_parser("list", help="the bundles on the topic, their verdicts, the pin and what every cell runs")
    pin = actions.add_parser("pin", help="every cell runs VERSION; nothing is promoted until unpin")
    pin.add_argument("version")
    pin.add_argument("--reason", default="pinned by hand")
    unpin = actions.add_parser("unpin", help="lift the pin: promotions resume")
    unpin.add_argument("--reason", default="unpinned by hand")
    back = actions.add_parser(
        "rollback", help="roll back the candidate being tried, else the newest promoted version (--to: to VERSION)"
    )
    back.add_argument("--to", default=None, metavar="VERSION", help="a published version to promote instead")
    back.add_argument("--reason", default="rolled back by hand")


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config or default_config_path())
    except ConfigError as exc:
        print(f"hlb models: {exc}", file=sys.stderr)
        return EX_CONFIG
    try:
        if args.action == "publish":
            card_path = args.directory / CARD
            card = json.loads(card_path.read_text()) if card_path.is_file() else {}
            print(publish_model(settings, args.directory, card, skip_shadow=args.skip_shadow))
            return 0
        from hlb.daemon.bus.kafka import KafkaBus

        bus = KafkaBus(settings.kafka)
        catalog = ModelCatalog.read(bus.read_all(settings.learning.models_topic, timeout_s=60.0))
        if args.action == "list":
            print(listing(catalog))
            return 0
        named = getattr(args, "version", None) or getattr(args, "to", None)  # pin VERSION, rollback --to VERSION
        records = decide_by_hand(catalog, args.action, named, args.reason, who())
        publisher = bus.publisher()
        for key, value in records:
            publisher.publish(settings.learning.models_topic, key, value)
        if publisher.flush(30.0):
            raise BrokerError("the broker did not take the control record; try again")
        for _, value in records:
            control = mp.ModelControl.FromString(value)
            print(f"{ACTION_NAMES[control.action]} {control.version}".rstrip())
        return 0
    except (BundleError, BrokerError, OSError, ValueError) as exc:
        print(f"hlb models: {exc}", file=sys.stderr)
        return 1


def decide_by_hand(
    catalog: ModelCatalog, action: str, version: str | None, reason: str, by: str, at_ms: int | None = None
) -> list[tuple[bytes, bytes]]:
    """The control records of ``hlb models pin|unpin|rollback``; ``ValueError`` saying why not."""
    at = now_ms() if at_ms is None else at_ms
    if action == "pin":
        if version not in catalog.manifests:
            raise ValueError(f"no bundle of version {version!r} on the topic (hlb models list)")
        return [control_record(mp.ModelControl.PIN, version, by, reason, at)]
    if action == "unpin":
        if catalog.pinned is None:
            raise ValueError("no version is pinned")
        return [control_record(mp.ModelControl.UNPIN, "", by, reason, at)]
    if catalog.pinned is not None:
        raise ValueError(f"version {catalog.pinned} is pinned: unpin it first, or pin another version")
    trying = catalog.candidates()
    current = trying[-1] if trying else catalog.target()
    records: list[tuple[bytes, bytes]] = []
    if version is not None:
        if version not in catalog.manifests:
            raise ValueError(f"no bundle of version {version!r} on the topic (hlb models list)")
        if current is not None and current != version:
            records.append(control_record(mp.ModelControl.ROLLED_BACK, current, by, reason, at))
        records.append(control_record(mp.ModelControl.PROMOTED, version, by, reason, at + 1))
        return records
    if current is None:
        raise ValueError("nothing to roll back: no candidate is being tried and no version was promoted")
    return [control_record(mp.ModelControl.ROLLED_BACK, current, by, reason, at)]


def listing(catalog: ModelCatalog) -> str:
    """``hlb models list``: one line per bundle, then the pin and what every cell runs."""
    lines = [f"{'VERSION':<36} {'PUBLISHED (UTC)':<20} {'BYTES':>10} {'VERDICT':<12} BY / REASON"]
    for manifest in sorted(catalog.manifests.values(), key=lambda m: m.published_at_ms):
        size = sum(f.size for f in manifest.files)
        control = catalog.verdicts.get(manifest.version)
        verdict = catalog.verdict(manifest.version) or "candidate"
        why = f"{control.by}: {control.reason}" if control is not None else ""
        lines.append(f"{manifest.version:<36} {_utc(manifest.published_at_ms):<20} {size:>10} {verdict:<12} {why}")
    pinned = catalog.pinned
    lines.append(f"pinned: {pinned or '-'}")
    lines.append(f"every cell runs: {catalog.target() or 'the model model.path names'}")
    return "\n".join(lines)


def _utc(at_ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at_ms / 1000))


__all__ = [
    "BUNDLE_FILES",
    "ModelCatalog",
    "bundle_records",
    "control_record",
    "decide_by_hand",
    "install_bundle",
    "part_bytes",
    "publish_control",
    "publish_model",
]
