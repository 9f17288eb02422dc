"""Minimal JSON-over-HTTP client (stdlib only) with the reference's retry rules.

Shared by the trainer's online source and launch/ (importing it does not import JAX).

speculators' vLLM client retries connection errors, timeouts, HTTP 408/429 and
5xx with exponential backoff (``2 ** attempt`` seconds) and never retries a
deterministic failure (other 4xx, an invalid response). Same here, with the
backoff base configurable so tests need not sleep.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("dspark_jax.http")
T = TypeVar("T")

TRANSIENT_STATUSES = frozenset({408, 429})


class HTTPStatusError(RuntimeError):
    """A failed request; ``retriable`` says whether trying again can help."""

    def __init__(self, status: int | None, message: str, retriable: bool):
        super().__init__(message)
        self.status, self.retriable = status, retriable


class InvalidResponseError(RuntimeError):
    """The server answered, but not with what was asked for (never retried by
    :func:`retry`; the caller may retry the whole round trip)."""


def _request(url: str, data: bytes | None, timeout: float, method: str) -> Any:
    req = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", "Authorization": "Bearer EMPTY"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        text = e.read().decode("utf-8", "replace")[:2000]
        retriable = e.code >= 500 or e.code in TRANSIENT_STATUSES
        raise HTTPStatusError(e.code, f"{method} {url} -> HTTP {e.code}: {text}", retriable) from e
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise HTTPStatusError(
            None, f"{method} {url} -> {type(reason).__name__}: {reason}", True
        ) from e
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:
        raise InvalidResponseError(f"{method} {url} -> not JSON: {body[:200]!r}") from e


def post_json(url: str, body: dict, timeout: float = 120.0) -> Any:
    return _request(url, json.dumps(body).encode(), timeout, "POST")


def get_json(url: str, timeout: float = 10.0) -> Any:
    return _request(url, None, timeout, "GET")


def get_status(url: str, timeout: float = 5.0) -> int | None:
    """HTTP status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def retry(
    fn: Callable[[], T],
    *,
    max_retries: int,
    backoff: float,
    describe: str,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn`` up to ``max_retries + 1`` times while it raises a retriable
    :class:`HTTPStatusError`; wait ``backoff * 2 ** (attempt - 1)`` between tries."""
    attempts = max_retries + 1
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except HTTPStatusError as e:
            if not e.retriable or attempt == attempts:
                raise
            wait = backoff * 2 ** (attempt - 1)
            log.warning(
                "%s failed (attempt %d/%d): %s; retrying in %.2fs",
                describe,
                attempt,
                attempts,
                e,
                wait,
            )
            sleep(wait)
    raise AssertionError("unreachable")
