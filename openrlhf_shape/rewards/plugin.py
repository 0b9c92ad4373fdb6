"""OpenRLHF-compatible reward plug-in: ``--reward.remote_url`` is a local ``.py`` file defining
``reward_func(queries, prompts, labels, **kw) -> {"rewards", "scores", "extra_logs"}`` or an
http(s) endpoint that takes ``{"query": [...], "prompts": [...], "labels": [...]}`` as JSON and
answers with the same dict (``scores`` / ``extra_logs`` optional).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

RewardFn = Callable[[list[str], list[str], list[str]], dict]


class RewardPluginError(RuntimeError):
    """A reward plug-in failed (bad file, unreachable endpoint, wrong output, or it raised)."""


def _as_list(value: Any, name: str, n: int, source: str) -> list[float]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
        raise RewardPluginError(f"reward plug-in {source}: {name!r} must be a list of {n} numbers, got {got}")
    try:
        return [float(v) for v in value]
    except (TypeError, ValueError) as exc:
        raise RewardPluginError(f"reward plug-in {source}: {name!r} holds a non-number ({exc})") from exc


def validate_output(out: Any, n: int, source: str) -> dict:
    """Check and normalise a plug-in answer to {"rewards": [n], "scores": [n], "extra_logs": dict}."""
    if not isinstance(out, dict) or "rewards" not in out:
        raise RewardPluginError(
            f"reward plug-in {source} must return a dict with 'rewards' (and optionally 'scores', "
            f"'extra_logs'); got {type(out).__name__}"
            + (f" with keys {sorted(out)}" if isinstance(out, dict) else "")
        )
    rewards = _as_list(out["rewards"], "rewards", n, source)
    scores = _as_list(out["scores"], "scores", n, source) if out.get("scores") is not None else list(rewards)
    extra = out.get("extra_logs") or {}
    if not isinstance(extra, dict):
        raise RewardPluginError(f"reward plug-in {source}: 'extra_logs' must be a dict, got {type(extra).__name__}")
    return {"rewards": rewards, "scores": scores, "extra_logs": extra}


def _load_py(path: str) -> Callable:
    if not os.path.isfile(path):
        raise RewardPluginError(f"--reward.remote_url={path!r}: file not found (give a .py path or an http(s) URL)")
    name = f"_reward_plugin_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RewardPluginError(f"--reward.remote_url={path!r}: cannot import this file as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise RewardPluginError(f"--reward.remote_url={path!r}: importing it raised {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, "reward_func", None)
    if not callable(fn):
        raise RewardPluginError(
            f"--reward.remote_url={path!r} defines no reward_func; add "
            "`def reward_func(queries, prompts, labels, **kwargs) -> dict` returning "
            '{"rewards": [...], "scores": [...], "extra_logs": {...}}'
        )
    return fn


def _local_reward_fn(path: str) -> RewardFn:
    fn = _load_py(path)

    def call(queries: list[str], prompts: list[str], labels: list[str], **kw) -> dict:
        n = len(queries)
        try:
            out = fn(queries, prompts, labels, **kw)
        except Exception as exc:
            # Find the first prompt that makes it raise on its own, so the error names it.
            bad = None
            for i in range(n):
                try:
                    fn(queries[i : i + 1], prompts[i : i + 1], labels[i : i + 1], **kw)
                except Exception:
                    bad = i
                    break
            where = f" on prompt index {bad} (prompt {prompts[bad][:120]!r})" if bad is not None else ""
            raise RewardPluginError(
                f"reward_func in {path} raised {type(exc).__name__}: {exc}{where}"
            ) from exc
        return validate_output(out, n, path)

    return call


def _http_reward_fn(url: str, timeout_s: float, retries: int, backoff_s: float) -> RewardFn:
    def call(queries: list[str], prompts: list[str], labels: list[str], **kw) -> dict:
        body = json.dumps({"query": list(queries), "prompts": list(prompts), "labels": list(labels)}).encode()
        last: Exception | None = None
        for attempt in range(retries + 1):
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                    out = json.loads(resp.read().decode())
                return validate_output(out, len(queries), url)
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:300]
                last = RewardPluginError(f"reward endpoint {url} answered HTTP {exc.code}: {detail}")
                if exc.code < 500:  # a client error will not fix itself
                    raise last from exc
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                last = RewardPluginError(
                    f"reward endpoint {url} unreachable ({type(exc).__name__}: {reason}); is the reward server "
                    f"running and is --reward.remote_url right? (timeout {timeout_s}s, {retries} retries)"
                )
            except json.JSONDecodeError as exc:
                last = RewardPluginError(f"reward endpoint {url} answered with invalid JSON: {exc}")
            if attempt < retries:
                time.sleep(backoff_s * (2**attempt))
        assert last is not None
        raise last

    return call


def load_reward_fn(remote_url: str, timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 1.0) -> RewardFn:
    """A callable ``fn(queries, prompts, labels, **kw) -> {"rewards", "scores", "extra_logs"}`` (lists of
    floats) for a local ``.py`` file or an http(s) endpoint. Raises :class:`RewardPluginError`."""
    if not remote_url:
        raise RewardPluginError("--reward.remote_url is empty; give a .py file or an http(s) URL")
    if timeout_s <= 0 or retries < 0:
        raise RewardPluginError(f"reward plug-in: timeout_s must be > 0 and retries >= 0 (got {timeout_s}, {retries})")
    if remote_url.startswith(("http://", "https://")):
        return _http_reward_fn(remote_url, timeout_s, retries, backoff_s)
    if remote_url.endswith(".py"):
        return _local_reward_fn(remote_url)
    raise RewardPluginError(
        f"--reward.remote_url={remote_url!r} is neither an http(s) URL nor a .py file with reward_func"
    )
