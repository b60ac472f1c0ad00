"""``hlb learn``: the command line of :mod:`hlb.export.learn` (imports torch only when it runs).

    hlb learn --config /etc/hlb/config.yaml --out /var/lib/hlb-learn/candidate            # once
    hlb learn --config /etc/hlb/config.yaml --out DIR --publish                           # and publish
    hlb learn --config /etc/hlb/config.yaml --out DIR --publish --watch --interval-s 3600  # the unit
    hlb learn --rows rows.jsonl --model daemon/data/model --out /tmp/candidate             # offline

Exit status: 0 a candidate was accepted (and published with ``--publish``); 3 it was refused by
validation (the card in ``--out`` says why; nothing published); 2 bad arguments, unreadable rows,
nothing to learn from, or a running model that cannot be warm-started from; 1 the export extra is
missing, the broker could not be read, or publishing failed; 78 an invalid config file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from hlb.daemon.config import DEFAULT_MODEL_DIR, EX_CONFIG, Settings, default_config_path, load_settings
from hlb.daemon.errors import BrokerError, BundleError, ConfigError

if TYPE_CHECKING:
    from hlb.export.learn import LearnConfig

MISSING_EXTRA = "hlb learn: install the export extra: pip install 'hlb[export]'"
EX_REFUSED = 3

log = structlog.get_logger(__name__)
Rows = list[dict[str, Any]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Refit the running GNN's speed head on the live cluster's training rows (hlb features tail), validate "
        "it on the most recent window against the running model and the table estimator, and write (with "
        "--publish: publish) the candidate only when it is better than both (docs/learning.md)."
    )
    parser.add_argument(
        "--config", type=Path, default=None, help=f"the daemon's YAML config (default: {default_config_path()})"
    )
    parser.add_argument(
        "--rows", type=Path, default=None, help="read training rows from this JSON-lines file instead of Kafka"
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="the running model's folder (default: the config's model.path)"
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for encoder.onnx, scorer.onnx and card.json")
    window = parser.add_mutually_exclusive_group()
    window.add_argument(
        "--validation-share", type=float, default=0.2, help="the most recent share of rows validated on (0.2)"
    )
    window.add_argument(
        "--validation-window-s", type=float, default=None, help="instead: the rows decided in the last N seconds"
    )
    parser.add_argument(
        "--min-validation-rows", type=int, default=50, help="refuse with fewer validation rows than this (50)"
    )
    parser.add_argument(
        "--since-ms",
        type=int,
        default=0,
        help="learn only from rows decided at or after this Unix time in ms (e.g. since a new encoder)",
    )
    parser.add_argument(
        "--no-replay",
        dest="replay",
        action="store_false",
        help="judge by the prediction error alone, without replaying the validation window for JCT",
    )
    parser.add_argument("--epochs", type=int, default=50, help="most passes over the training rows (50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fit and the bootstrap (0)")
    parser.add_argument("--model-version", default="", help="the candidate's version (default: hlb-learn-<UTC time>)")
    parser.add_argument("--publish", action="store_true", help="publish an accepted candidate on the models topic")
    parser.add_argument("--watch", action="store_true", help="run again every --interval-s while new rows arrive")
    parser.add_argument("--interval-s", type=float, default=3600.0, help="seconds between runs with --watch (3600)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: the head is small, and more threads fit it slower; 0: torch's default)",
    )


def run(args: argparse.Namespace) -> int:
    problem = _check_arguments(args)
    if problem:
        print(f"hlb learn: {problem}", file=sys.stderr)
        return 2
    try:
        import torch

        from hlb.export import learn
    except ImportError as error:
        print(f"{MISSING_EXTRA} ({error})", file=sys.stderr)
        return 1
    settings: Settings | None = None
    if args.config is not None or args.rows is None or args.publish or args.watch:
        try:
            settings = load_settings(args.config or default_config_path())
        except ConfigError as exc:
            print(f"hlb learn: {exc}", file=sys.stderr)
            return EX_CONFIG
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model_dir = args.model or (settings.model.path if settings is not None else None) or DEFAULT_MODEL_DIR
    config = learn.LearnConfig(
        validation_share=args.validation_share,
        validation_window_s=args.validation_window_s,
        min_validation_rows=args.min_validation_rows,
        epochs=args.epochs,
        seed=args.seed,
        model_version=args.model_version,
        since_ms=args.since_ms,
        replay=args.replay,
    )
    read = (lambda: read_rows_file(args.rows)) if args.rows is not None else (lambda: read_rows_kafka(settings))
    if not args.watch:
        return learn_once(read, model_dir, args.out, config, args.publish, settings, say=print)
    from hlb.daemon.logs import configure_logging

    assert settings is not None
    configure_logging(settings.log.level, settings.log.format)
    return watch(read, lambda rows: _learn_logged(rows, model_dir, args, config, settings), args.interval_s)


def _check_arguments(args: argparse.Namespace) -> str:
    if not 0 < args.validation_share < 1:
        return "--validation-share must be between 0 and 1"
    if args.validation_window_s is not None and args.validation_window_s <= 0:
        return "--validation-window-s must be positive"
    if args.min_validation_rows < 1 or args.epochs < 1 or min(args.seed, args.threads, args.since_ms) < 0:
        return "--min-validation-rows and --epochs must be >= 1, --seed, --threads and --since-ms >= 0"
    if args.watch and args.interval_s <= 0:
        return "--interval-s must be positive"
    if args.rows is not None and not args.rows.is_file():
        return f"--rows {args.rows}: no such file"
    if args.model is not None and not args.model.is_dir():
        return f"--model {args.model}: no such folder"
    if args.model_version and args.watch:
        return "--model-version names one candidate; with --watch each run makes its own (hlb-learn-<UTC time>)"
    return ""


def read_rows_file(path: Path) -> Rows:
    """The rows of a JSON-lines file as ``hlb features tail`` prints them. Raises ``ValueError``
    naming the line that is not a JSON object."""
    rows: Rows = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{path}:{number}: not JSON: {error}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: not a training row (a JSON object)")
            rows.append(row)
    return rows


def read_rows_kafka(settings: Settings | None) -> Rows:
    """The training rows the topics hold now (as ``hlb features tail``). Raises ``BrokerError``."""
    assert settings is not None
    if settings.bus == "memory":
        raise BrokerError("bus: memory keeps no topics to read back; hlb learn reads a Kafka broker (or --rows)")
    from confluent_kafka import KafkaException  # librdkafka loads only when Kafka is used

    from hlb.daemon.bus.kafka import KafkaBus
    from hlb.daemon.record.training_rows import join, read_topics

    try:
        records, placements, events, _ = read_topics(KafkaBus(settings.kafka), settings)
    except KafkaException as error:
        raise BrokerError(f"cannot read the topics on Kafka at {settings.kafka.bootstrap_servers}: {error}") from None
    return join(records, placements, events).rows


def learn_once(
    read: Callable[[], Rows],
    model_dir: Path,
    out: Path,
    config: LearnConfig,
    publish: bool,
    settings: Settings | None,
    say: Callable[[str], None],
    warn: Callable[[str], None] = lambda line: print(f"hlb learn: {line}", file=sys.stderr),
) -> int:
    """One run: read, learn, write, and publish when accepted and asked to. -> the exit status.
    ``say`` reports progress, ``warn`` why a run stopped short."""
    from hlb.export import learn

    try:
        rows = read()
    except (OSError, ValueError) as error:
        warn(f"cannot read the rows: {error}")
        return 2
    except BrokerError as error:
        warn(str(error))
        return 1
    try:
        outcome = learn.learn(rows, model_dir, out, config, say=say)
    except learn.LearnError as error:
        warn(str(error))
        return 2
    card = outcome.card
    say(f"errors on {card['validated']['rows']} validation rows: {json.dumps(card['validated']['errors'])}")
    if not outcome.accepted:
        warn(f"candidate {card['model_version']} refused, not published: " + "; ".join(card["reasons"]))
        say(f"wrote {out} (refused; see {out / learn.CARD_FILE})")
        return EX_REFUSED
    say(f"candidate {card['model_version']} accepted; wrote {out}")
    if publish:
        try:
            version = publish_candidate(settings, out, card)
        except (BrokerError, BundleError, OSError) as error:
            warn(f"publishing {card['model_version']} failed: {error}")
            return 1
        say(f"published {version}")
    return 0


def publish_candidate(settings: Settings | None, directory: Path, card: dict[str, Any]) -> str:
    """Hand the candidate to the models topic (:func:`hlb.daemon.runtime.models.publish_model`)."""
    from hlb.daemon.runtime.models import publish_model

    assert settings is not None
    return publish_model(settings, directory, card)


def _learn_logged(
    rows: Rows, model_dir: Path, args: argparse.Namespace, config: LearnConfig, settings: Settings
) -> int:
    return learn_once(
        lambda: rows,
        model_dir,
        args.out,
        config,
        args.publish,
        settings,
        say=lambda line: log.info("learn", step=line),
        warn=lambda line: log.warning("learn stopped", why=line),
    )


def watch(
    read: Callable[[], Rows],
    learn_rows: Callable[[Rows], int],
    interval_s: float,
    sleep: Callable[[float], None] = time.sleep,
    rounds: int | None = None,
) -> int:
    """Every ``interval_s``: read the rows and learn from them when there are new ones since the
    last run (more rows, or newer ones). A failed read is logged and tried again next time.
    ``rounds``: stop after that many (tests); the service runs until stopped."""
    last: tuple[int, int] | None = None
    done = 0
    while rounds is None or done < rounds:
        done += 1
        try:
            rows = read()
        except (OSError, ValueError, BrokerError) as error:
            log.warning("learn rows unreadable", error=str(error))
            sleep(interval_s)
            continue
        mark = (len(rows), max((int(row.get("decided_at_ms", 0)) for row in rows), default=0))
        if mark == last:
            log.info("learn skipped: no new rows", rows=mark[0])
        else:
            status = learn_rows(rows)
            log.info("learn run", rows=mark[0], newest_ms=mark[1], status=status)
            last = mark
        if rounds is None or done < rounds:
            sleep(interval_s)
    return 0
