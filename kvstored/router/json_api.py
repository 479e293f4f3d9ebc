"""The router's JSON messages, to and from its values (no logic): a route request (``POST
/v1/route``), its answer, and a node's load report (``POST /v1/report``).

A route request: ``{"model": ..., "namespace": {other Namespace fields}, "token_ids": [...]}``
or ``"block_hashes": [int, or 64 hex digits, ...]`` with an optional ``"tokens"``; optional
``"candidates"``, ``"cache_salt"``, ``"lora_name"``. A report: ``{"node": ..., "queued_prefill_s":
seconds, "prefills": [{"model": ..., "tokens": n, "cached_tokens": n, "seconds": s}, ...]}``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvstored.router.router import RouteAnswer, RouteError, RouteQuery
from kvstored_client.contract.namespace import Namespace

_NAMESPACE_FIELDS = {f.name for f in dataclasses.fields(Namespace)}
_QUERY_KEYS = {"model", "namespace", "token_ids", "block_hashes", "tokens", "candidates", "cache_salt", "lora_name"}


def _bad(message: str) -> RouteError:
    return RouteError("invalid_argument", message)


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise _bad(f"{name} must be a list of integers")
    return value


def _hash(value: Any, i: int) -> int | bytes:
    if isinstance(value, int) and not isinstance(value, bool):
        if not -(1 << 63) <= value < 1 << 64:
            raise _bad(f"block_hashes[{i}] is not a 64-bit integer")
        return value
    if isinstance(value, str):
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raise _bad(f"block_hashes[{i}] is neither an integer nor hex") from None
        if len(raw) not in (8, 16, 32):
            raise _bad(f"block_hashes[{i}] has {len(raw)} bytes; expected 8, 16 or 32")
        return raw
    raise _bad(f"block_hashes[{i}] must be an integer or a hex string")


def query_from_json(obj: Any) -> RouteQuery:
    """A route request's JSON (decoded) as a RouteQuery; RouteError(invalid_argument) otherwise."""
    if not isinstance(obj, dict):
        raise _bad("a route request is a JSON object")
    unknown = set(obj) - _QUERY_KEYS
    if unknown:
        raise _bad(f"unknown field(s): {', '.join(sorted(unknown))}")
    fields = obj.get("namespace", {})
    if not isinstance(fields, dict) or set(fields) - _NAMESPACE_FIELDS:
        raise _bad(f"namespace must be an object with fields among {', '.join(sorted(_NAMESPACE_FIELDS))}")
    if "model" in obj:
        fields = {**fields, "model": obj["model"]}
    try:
        namespace = Namespace(**fields)
        namespace.validate()
    except (TypeError, ValueError) as exc:
        raise _bad(str(exc)) from None
    token_ids = _int_list(obj.get("token_ids", []), "token_ids")
    raw_hashes = obj.get("block_hashes", [])
    if not isinstance(raw_hashes, list):
        raise _bad("block_hashes must be a list")
    hashes = [_hash(h, i) for i, h in enumerate(raw_hashes)]
    tokens = obj.get("tokens", 0)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise _bad("tokens must be a non-negative integer")
    candidates = obj.get("candidates", [])
    if not isinstance(candidates, list) or not all(isinstance(c, str) for c in candidates):
        raise _bad("candidates must be a list of node ids")
    salt, lora = obj.get("cache_salt", ""), obj.get("lora_name", "")
    if not isinstance(salt, str) or not isinstance(lora, str):
        raise _bad("cache_salt and lora_name must be strings")
    return RouteQuery(namespace, token_ids, hashes, tokens, candidates, salt, lora)


def answer_to_json(answer: RouteAnswer) -> dict[str, Any]:
    return {"node": answer.node, "namespace_id": answer.namespace_id, "blocks": answer.blocks,
            "tokens": answer.tokens, "candidates": [dataclasses.asdict(b) for b in answer.candidates]}


@dataclass(frozen=True, slots=True)
class Prefill:
    model: str
    tokens: int
    cached_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Report:
    node: str
    queued_prefill_s: float | None
    prefills: tuple[Prefill, ...]


def _number(value: Any, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or value != value \
            or value == float("inf"):
        raise _bad(f"{name} must be a non-negative number")
    return float(value)


def report_from_json(obj: Any) -> Report:
    if not isinstance(obj, dict) or not isinstance(obj.get("node"), str) or not obj["node"]:
        raise _bad("a report is a JSON object with a non-empty \"node\"")
    unknown = set(obj) - {"node", "queued_prefill_s", "prefills"}
    if unknown:
        raise _bad(f"unknown field(s): {', '.join(sorted(unknown))}")
    queued = _number(obj["queued_prefill_s"], "queued_prefill_s") if "queued_prefill_s" in obj else None
    prefills = []
    raw = obj.get("prefills", [])
    if not isinstance(raw, list):
        raise _bad("prefills must be a list")
    for i, p in enumerate(raw):
        if not isinstance(p, dict):
            raise _bad(f"prefills[{i}] must be an object")
        model = p.get("model", "default")
        tokens, cached = p.get("tokens"), p.get("cached_tokens", 0)
        if not isinstance(model, str) or not isinstance(tokens, int) or not isinstance(cached, int) \
                or isinstance(tokens, bool) or not 0 <= cached < tokens:
            raise _bad(f"prefills[{i}] needs model (string), tokens > cached_tokens >= 0 (integers)")
        prefills.append(Prefill(model, tokens, cached, _number(p.get("seconds"), f"prefills[{i}].seconds")))
    return Report(obj["node"], queued, tuple(prefills))
