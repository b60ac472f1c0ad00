"""SIGHUP: re-read the config file with the one loader and apply what can change while running.

Keys with a reloader (``Daemon.reloaders``: log level and format, the scheduler section, the model,
the request-rate limit) take effect at once; every other changed key is logged by name as needing
a restart and keeps its running value. A config that no longer loads is logged and the running one
kept. Keys are compared as dotted paths (``grpc.tls.cert_file``); values are never logged, as
they may be secrets.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from pydantic import BaseModel

from hlb.daemon.config import Settings, load_settings
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.errors import ConfigError
from hlb.daemon.logs import configure_logging
from hlb.daemon.runtime.policy import OnFallback, build_policy, configure_model, start_policy, stop_policy
from hlb.daemon.serve.ratelimit import RateLimitInterceptor, TokenBucket, default_burst

log = structlog.get_logger(__name__)

# Applies the reloadable part of new settings; raises to refuse them (the old values stay).
Reloader = Callable[[Settings], None]


@dataclass(frozen=True)
class ReloadResult:
    """What a reload did, by dotted key (``log.level``). Values are never listed: they may be secrets."""

    applied: tuple[str, ...] = ()
    needs_restart: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    error: str | None = None  # the new config did not load; nothing changed

    @property
    def outcome(self) -> str:
        """The ``result`` label of ``hlb_config_reloads_total``."""
        if self.error is not None:
            return "invalid"
        if not (self.applied or self.needs_restart or self.failed):
            return "unchanged"
        return "partial" if self.needs_restart or self.failed else "applied"


async def reload_settings(
    path: Path | None, running: Settings, reloader_for: Callable[[str], Reloader | None]
) -> tuple[Settings, ReloadResult]:
    """Re-read ``path`` and run the reloader of each changed key (:func:`apply_settings`); returns
    the settings now in effect and what was done."""
    new = await load_for_reload(path)
    if isinstance(new, ReloadResult):
        return running, new
    return await apply_settings(new, running, reloader_for)


async def load_for_reload(path: Path | None) -> Settings | ReloadResult:
    """The settings of ``path`` and the environment, or the refusal when they do not load (logged)."""
    try:
        return await asyncio.to_thread(load_settings, path)
    except Exception as exc:  # whatever stops the load: a SIGHUP must not end in a task that died
        error = str(exc) if isinstance(exc, ConfigError) else f"config file {path}: {exc!r}"
        log.error("reload refused: the config does not load; the running config is kept", error=error)
        return ReloadResult(error=error)


async def apply_settings(
    new: Settings, running: Settings, reloader_for: Callable[[str], Reloader | None]
) -> tuple[Settings, ReloadResult]:
    """Run the reloader of each key ``new`` changes (each reloader once, on a worker thread: a
    model load must not stall the RPCs); returns the settings now in effect (``running`` with the
    applied keys changed) and what was done."""
    by_reloader: dict[Reloader, list[str]] = {}
    needs_restart: list[str] = []
    for key in changed_keys(running, new):
        reloader = reloader_for(key)
        if reloader is None:
            needs_restart.append(key)
        else:
            by_reloader.setdefault(reloader, []).append(key)
    applied: list[str] = []
    failed: list[str] = []
    effective = running
    for reloader, keys in by_reloader.items():
        try:
            await asyncio.to_thread(reloader, new)
        except Exception as exc:
            log.error("reload of some keys failed; their running values are kept", keys=keys, error=str(exc))
            failed += keys
        else:
            applied += keys
            for key in keys:
                effective = replace_key(effective, key, get_key(new, key))
    if needs_restart:
        log.warning("changed keys cannot be reloaded; restart to apply them", keys=needs_restart)
    log.info("reloaded", applied=applied, needs_restart=needs_restart, failed=failed)
    return effective, ReloadResult(tuple(applied), tuple(needs_restart), tuple(failed))


def reloader_for(reloaders: dict[str, Reloader], restart_only: AbstractSet[str], key: str) -> Reloader | None:
    """The reloader of dotted ``key``: the one registered for it or for its longest section
    prefix (``"scheduler."``); None when it needs a restart."""
    if key in restart_only:
        return None
    matches = [p for p in reloaders if key == p or (p.endswith(".") and key.startswith(p))]
    return reloaders[max(matches, key=len)] if matches else None


# -- the reloaders ------------------------------------------------------------------------------


def reload_logging(new: Settings) -> None:
    configure_logging(new.log.level, new.log.format)


def scheduler_reloader(scheduler: Scheduler, lock: threading.RLock, on_fallback: OnFallback) -> Reloader:
    """Builds the new policy and starts it (its model loaded and warmed up) before it takes over."""

    def reload_scheduler(new: Settings) -> None:
        policy = build_policy(new, on_fallback)
        start_policy(policy, scheduler.graph, lock)  # before it decides anything
        with lock:
            old, scheduler.policy = scheduler.policy, policy
            scheduler.keep_ended_s = new.scheduler.keep_ended_s
            scheduler.remember_ended = new.scheduler.remember_ended
            scheduler.max_pending = new.scheduler.max_pending
        stop_policy(old)

    return reload_scheduler


def model_reloader(scheduler: Scheduler, running: Callable[[], Settings]) -> Reloader:
    """New model settings for the running GNN (``configure_model``), unless the scheduler section
    changed too: its reloader builds a new policy with them."""

    def reload_model(new: Settings) -> None:
        if new.scheduler == running().scheduler:
            configure_model(scheduler.policy, new.model)

    return reload_model


def rate_limit_reloader(interceptor: RateLimitInterceptor, monotonic: Callable[[], float]) -> Reloader:
    """Switches the request-rate limit on, off, or to the new rate and burst."""

    def reload_rate_limit(new: Settings) -> None:
        bucket = interceptor.bucket
        rate, burst = new.grpc.max_requests_per_s, new.grpc.request_burst
        if rate <= 0:
            interceptor.bucket = None
        elif bucket is None:
            interceptor.bucket = token_bucket(new, monotonic)
        else:
            bucket.configure(rate, default_burst(rate, burst))

    return reload_rate_limit


def token_bucket(settings: Settings, clock: Callable[[], float]) -> TokenBucket | None:
    """The request-rate limit ``grpc.max_requests_per_s`` sets; None: no limit."""
    rate = settings.grpc.max_requests_per_s
    return TokenBucket(rate, default_burst(rate, settings.grpc.request_burst), clock) if rate > 0 else None


# -- settings as dotted keys ---------------------------------------------------------------------


def flatten(model: BaseModel, prefix: str = "") -> dict[str, object]:
    """Leaf values of ``model`` by dotted key (``grpc.tls.cert_file``); dicts are leaves."""
    leaves: dict[str, object] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            leaves.update(flatten(value, f"{prefix}{name}."))
        else:
            leaves[f"{prefix}{name}"] = value
    return leaves


def changed_keys(old: Settings, new: Settings) -> list[str]:
    """Dotted keys whose values differ (secrets compare by value, and are never returned)."""
    before, after = flatten(old), flatten(new)
    return [key for key in after if before.get(key) != after[key]]


def replace_key(model: Any, key: str, value: object) -> Any:
    """A copy of frozen ``model`` with the dotted ``key`` set to ``value``."""
    head, _, rest = key.partition(".")
    if not rest:
        return model.model_copy(update={head: value})
    return model.model_copy(update={head: replace_key(getattr(model, head), rest, value)})


def get_key(model: Any, key: str) -> object:
    """The value of dotted ``key`` in ``model``."""
    for part in key.split("."):
        model = getattr(model, part)
    return model
