"""The client side of the hidden-state extraction protocol (docs/formats.md, "Online
extraction protocol").

An extractor is ``vllm serve`` with the ``extract_hidden_states`` speculative
method and a hidden-states KV connector, or ``launch/serve_hidden_states.py``.
Per row the client sends an OpenAI completions request (``prompt`` = the row's
token ids, ``max_tokens=1``, ``return_token_ids=true``); the answer carries
``choices[0].prompt_token_ids`` (must equal the prompt) and
``kv_transfer_params``, which tells the transport where the tensors are: a file
path (``hidden_states_path``) or a Mooncake handle / manifest.

Used by the trainer's online source (dspark_jax/data/online/source.py) and the offline
extraction client (launch/vllm_backend.py). Stdlib only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dspark_jax.data.online.http import InvalidResponseError, get_json, post_json, retry


def describe_prompt(ids: Sequence[int]) -> str:
    """``<T tokens: [a, b, c, ..., x, y, z]>`` for log and error lines."""
    ids = list(ids)
    if len(ids) > 9:
        shown = ", ".join(map(str, ids[:6])) + ", ..., " + ", ".join(map(str, ids[-3:]))
    else:
        shown = ", ".join(map(str, ids))
    return f"<{len(ids)} tokens: [{shown}]>"


def transfer_handle(params: dict[str, Any]) -> str:
    """The sample's handle in ``kv_transfer_params``: the file path or Mooncake key."""
    handle = params.get("hidden_states_path") or params.get("handle")
    if not handle:
        raise InvalidResponseError(
            f"kv_transfer_params has neither hidden_states_path nor handle: {params}"
        )
    return str(handle)


class ExtractorClient:
    """Completion round trips against one extractor endpoint (``.../v1``).

    Transport failures (connection errors, timeouts, HTTP 408/429/5xx) are retried
    ``max_retries`` times with backoff ``retry_backoff * 2 ** (attempt - 1)``
    seconds (the reference waits ``2 ** attempt``); a deterministic failure (other
    4xx, an invalid answer) raises at once.
    """

    def __init__(
        self,
        endpoint: str,
        model: str | None = None,
        *,
        request_timeout: float = 120.0,
        max_retries: int = 3,
        retry_backoff: float = 2.0,
    ):
        self.endpoint = endpoint.rstrip("/")
        self.model = model
        self.request_timeout, self.max_retries = request_timeout, max_retries
        self.retry_backoff = retry_backoff

    def served_models(self) -> list[dict]:
        data = get_json(self.endpoint + "/models", timeout=min(30.0, self.request_timeout))
        models = data.get("data") if isinstance(data, dict) else None
        if not models:
            raise RuntimeError(f"{self.endpoint}/models lists no model; is the server loaded?")
        return models

    def check_model(self) -> str:
        """The served model id; must equal ``model`` when one was given (as in the
        reference). A served model whose ``root`` (the path vLLM loaded) equals
        ``model`` also matches, so a local verifier folder works without
        ``--served-model-name``."""
        served = self.served_models()[0]
        if self.model and self.model not in (served.get("id"), served.get("root")):
            raise ValueError(
                f"the server at {self.endpoint} serves {served.get('id')!r}, not "
                f"{self.model!r}; start it with --served-model-name {self.model} or point "
                "the endpoint at the right server"
            )
        self.model = served["id"]
        return self.model

    def describe(self, ids: Sequence[int]) -> str:
        return (
            f"POST {self.endpoint}/completions model={self.model!r} "
            f"prompt={describe_prompt(ids)} max_tokens=1"
        )

    def request(self, ids: Sequence[int]) -> dict:
        """One completion request (transport errors retried); the raw answer."""
        body = {
            "model": self.model,
            "prompt": [int(t) for t in ids],
            "max_tokens": 1,
            "return_token_ids": True,
        }
        url = self.endpoint + "/completions"
        res = retry(
            lambda: post_json(url, body, timeout=self.request_timeout),
            max_retries=self.max_retries,
            backoff=self.retry_backoff,
            describe=f"POST {url}",
        )
        if not isinstance(res, dict):
            raise InvalidResponseError(f"expected a JSON object, got {type(res).__name__}")
        return res

    @staticmethod
    def transfer_params(res: dict) -> dict[str, Any]:
        params = res.get("kv_transfer_params")
        if not params or not isinstance(params, dict):
            raise InvalidResponseError(
                "response has no kv_transfer_params (is the server started with the "
                "hidden-states KV connector?)"
            )
        transfer_handle(params)
        return params

    @staticmethod
    def check_prompt(res: dict, ids: Sequence[int]) -> None:
        choices = res.get("choices") or [{}]
        prompt_ids = choices[0].get("prompt_token_ids") if isinstance(choices[0], dict) else None
        if prompt_ids is None:
            raise InvalidResponseError(
                "response has no choices[0].prompt_token_ids (is the server too old for "
                "return_token_ids?)"
            )
        ids = [int(t) for t in ids]
        if list(prompt_ids) != ids:
            first = next(
                (k for k, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b),
                min(len(prompt_ids), len(ids)),
            )
            raise InvalidResponseError(
                f"prompt token ids mismatch: the server saw {len(prompt_ids)} tokens, the row "
                f"has {len(ids)}; first difference at position {first}"
            )
