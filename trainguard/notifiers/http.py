"""HTTP delivery shared by the webhook-style channels: timeouts, status classes, and URLs kept out of errors."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote, quote_plus, unquote, urlsplit

import requests

from trainguard.notifiers.base import NotifierError

TOKEN_MIN = 12  # URL path segments this long are tokens, not words like "services" or "api"


def _spellings(secret: str) -> set[str]:
    """A secret as it may appear in an error: raw, percent-encoded (either way), JSON- or repr-escaped."""
    out = {secret, quote(secret, safe=""), quote(secret, safe="/:"), quote_plus(secret), json.dumps(secret)[1:-1],
           repr(secret)[1:-1]}
    try:
        out.add(unquote(secret))
    except ValueError:
        pass
    return {s for s in out if s}


def redact(text: str, *secrets: str) -> str:
    """`text` with every secret replaced, in every spelling; never raises."""
    spellings = sorted({s for secret in secrets if secret for s in _spellings(secret)}, key=len, reverse=True)
    for s in spellings:  # longest first: a secret's full form before the fragments it contains
        text = text.replace(s, "<redacted>")
    return text


def redact_url(text: str, url: str) -> str:
    """Without the URL, its path and its query: urllib3 quotes the path alone ("url: /services/T0/B0/XXXX")."""
    try:
        parts = urlsplit(url)
        path_query = parts.path + (f"?{parts.query}" if parts.query else "")
        # A service may echo the token segment alone (Slack's is the last): long segments are secrets too.
        segments = [s for s in parts.path.split("/") if len(s) >= TOKEN_MIN]
        extra = [path_query if len(path_query) > 1 else "", parts.query, parts.password or "", *segments]
    except ValueError:  # a URL urlsplit rejects: redact it whole
        extra = []
    return redact(text, url, *extra)


def post_json(url: str, payload: Any, timeout: float, what: str, data: bytes | None = None,
              headers: dict[str, str] | None = None) -> requests.Response:
    """POST and classify: 2xx returns; 429 and 5xx are retried (honouring Retry-After); other 4xx are permanent.
    The URL (a secret for webhooks) never appears in the error: request exceptions quote it."""
    try:
        if data is not None:
            response = requests.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})},
                                     timeout=timeout)
        else:
            response = requests.post(url, json=payload, headers=headers, timeout=timeout)
    except requests.RequestException as exc:
        raise NotifierError(f"{what}: {type(exc).__name__}: {redact_url(str(exc), url)}") from None
    if response.status_code < 300:
        return response
    body = redact_url(response.text.strip()[:200], url) or response.reason
    if response.status_code == 429:
        retry = response.headers.get("Retry-After", "")
        raise NotifierError(f"{what}: 429 rate limited ({body})",
                            retry_after=float(retry) if retry.replace(".", "", 1).isdigit() else 30.0)
    if response.status_code >= 500:
        raise NotifierError(f"{what}: {response.status_code} {body}")
    raise NotifierError(f"{what}: {response.status_code} {body}", permanent=True)


def answer(response: requests.Response, url: str) -> str:
    """A peer's answer to a delivery, in a few words: status and the start of its body (the URL kept out)."""
    return f"HTTP {response.status_code} {redact_url(response.text.strip()[:80], url)}".strip()
