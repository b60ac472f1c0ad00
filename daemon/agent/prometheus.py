"""Prometheus text endpoints (DCGM exporter's, node_exporter's): fetched over HTTP and parsed with
``prometheus_client``'s parser, never by hand."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from hlb.daemon.agent.readings import SourceError

MAX_BYTES = 16 * 1024 * 1024  # an exporter's reply; a bigger one is refused, not read on


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


Samples = dict[str, list[Sample]]  # by metric name (a counter's samples under their _total name)
Fetch = Callable[[], str]


def http_fetch(url: str, timeout_s: float) -> Fetch:
    """A fetcher of ``url``'s text; ``SourceError`` when it cannot be read."""

    def fetch() -> str:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # an operator's URL, http or file
                body: bytes = reply.read(MAX_BYTES + 1)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise SourceError(f"{url}: {exc}") from None
        if len(body) > MAX_BYTES:
            raise SourceError(f"{url}: reply over {MAX_BYTES} bytes")
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SourceError(f"{url}: not UTF-8 text ({exc})") from None

    return fetch


def parse(text: str, what: str) -> Samples:
    """Every sample of ``text`` (Prometheus text format 0.0.4) by metric name; ``SourceError``
    naming ``what`` when it is not that format."""
    samples: Samples = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name].append(Sample(sample.name, dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise SourceError(f"{what}: not Prometheus text format ({exc})") from None
    return dict(samples)
