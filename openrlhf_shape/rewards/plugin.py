"""OpenRLHF-compatible reward plug-ins, called the way OpenRLHF 0.11 calls them.

``--reward.remote_url`` is either

* a local ``.py`` file defining ``reward_func(queries, prompts, labels, **kw)``. Like OpenRLHF, the
  function is called once per sample (lists of length 1, positionally), so a function written for
  OpenRLHF that returns a bare float, a one-element list or a ``[1]`` tensor works unchanged; or
* one or more http(s) endpoints, comma-separated. Each receives ``{"query": [...], "prompts": [...],
  "labels": [...]}`` as JSON; a batch is cut into one shard per endpoint and the shards are sent
  concurrently, the endpoints taken in rotation across calls (a failed attempt moves on to the
  next endpoint). Timeout and retries are flags (``--reward.remote_timeout_s``,
  ``--reward.remote_retries``).

An answer is a dict: ``rewards`` (a tensor, list or float), optional ``scores`` (same shapes;
``rewards`` when absent) and optional ``extra_logs`` (name -> number, tensor or list). Rewards and
scores are normalised to one float per sample; every extra-log value becomes a list of floats (the
caller logs their mean).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import numbers
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

RewardFn = Callable[..., dict]


class RewardPluginError(RuntimeError):
    """A reward plug-in failed (bad file, unreachable endpoint, wrong output, or it raised)."""


def _flat_numbers(value: Any, what: str, source: str) -> list[float]:
    """A number, a tensor / numpy array of any shape, or a (nested) list of those -> flat floats."""
    if isinstance(value, bool) or isinstance(value, numbers.Number):
        return [float(value)]
    if hasattr(value, "detach"):  # torch tensor: any shape, any dtype, any device
        value = value.detach().float().cpu().reshape(-1).tolist()
    elif hasattr(value, "tolist"):  # numpy array / scalar
        value = value.tolist()
        if not isinstance(value, list):
            value = [value]
    if isinstance(value, (list, tuple)):
        out: list[float] = []
        for v in value:
            out.extend(_flat_numbers(v, what, source))
        return out
    raise RewardPluginError(
        f"reward plug-in {source}: {what} must be a number, a tensor or a list of numbers, got {type(value).__name__}"
    )


def _per_sample(value: Any, name: str, n: int, source: str) -> list[float]:
    vals = _flat_numbers(value, repr(name), source)
    if len(vals) != n:
        raise RewardPluginError(
            f"reward plug-in {source}: {name!r} must hold one number per sample ({n}), got {len(vals)}"
        )
    return vals


def validate_output(out: Any, n: int, source: str) -> dict:
    """Normalise a plug-in answer for ``n`` samples to
    ``{"rewards": [n floats], "scores": [n floats], "extra_logs": {name: [floats]}}``."""
    if not isinstance(out, dict) or "rewards" not in out:
        raise RewardPluginError(
            f"reward plug-in {source} must return a dict with 'rewards' (and optionally 'scores', "
            f"'extra_logs'); got {type(out).__name__}"
            + (f" with keys {sorted(out)}" if isinstance(out, dict) else "")
        )
    rewards = _per_sample(out["rewards"], "rewards", n, source)
    scores = _per_sample(out["scores"], "scores", n, source) if out.get("scores") is not None else list(rewards)
    extra_in = out.get("extra_logs") or {}
    if not isinstance(extra_in, dict):
        raise RewardPluginError(f"reward plug-in {source}: 'extra_logs' must be a dict, got {type(extra_in).__name__}")
    extra = {str(k): _flat_numbers(v, f"extra_logs[{k!r}]", source) for k, v in extra_in.items()}
    return {"rewards": rewards, "scores": scores, "extra_logs": extra}


def merge_outputs(parts: list[dict]) -> dict:
    """Concatenate normalised answers of consecutive sample chunks (extra logs: values appended)."""
    merged: dict = {"rewards": [], "scores": [], "extra_logs": {}}
    for p in parts:
        merged["rewards"].extend(p["rewards"])
        merged["scores"].extend(p["scores"])
        for k, v in p["extra_logs"].items():
            merged["extra_logs"].setdefault(k, []).extend(v)
    return merged


def mean_extra_logs(extra: dict[str, list[float]], prefix: str = "reward/") -> dict[str, float]:
    """Extra logs as scalar metrics ``{name: mean of its values}``; a bare name (no ``/``) gets
    ``prefix`` (NaN for a name that got no values; a plug-in's own NaN is kept: worth seeing)."""
    out = {}
    for k, vals in extra.items():
        name = k if "/" in k else prefix + k
        out[name] = float(sum(vals) / len(vals)) if vals else math.nan
    return out


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
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").startswith("openrlhf"):
            hint = " (install it: pip install --no-deps openrlhf==0.11.2, see requirements/cpu.txt)"
        raise RewardPluginError(
            f"--reward.remote_url={path!r}: importing it raised {type(exc).__name__}: {exc}{hint}"
        ) from exc
    fn = getattr(module, "reward_func", None)
    if not callable(fn):
        raise RewardPluginError(
            f"--reward.remote_url={path!r} defines no reward_func; add "
            "`def reward_func(queries, prompts, labels, **kwargs) -> dict` returning "
            '{"rewards": ..., "scores": ..., "extra_logs": {...}}'
        )
    return fn


def _local_reward_fn(path: str) -> RewardFn:
    fn = _load_py(path)

    def call(queries: list[str], prompts: list[str], labels: list[str], **kw) -> dict:
        parts = []
        for i, (q, p, lab) in enumerate(zip(queries, prompts, labels)):
            try:
                out = fn([q], [p], [lab], **kw)
            except Exception as exc:
                raise RewardPluginError(
                    f"reward_func in {path} raised {type(exc).__name__}: {exc} on prompt index {i} "
                    f"(prompt {p[:120]!r})"
                ) from exc
            parts.append(validate_output(out, 1, path))
        return merge_outputs(parts)

    return call


def _post_json(url: str, body: bytes, timeout_s: float) -> Any:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read().decode())


def _http_reward_fn(urls: list[str], timeout_s: float, retries: int, backoff_s: float) -> RewardFn:
    rotation = itertools.cycle(range(len(urls)))
    lock = threading.Lock()

    def next_url() -> int:
        with lock:
            return next(rotation)

    def send(shard: tuple[list[str], list[str], list[str]]) -> dict:
        queries, prompts, labels = shard
        body = json.dumps({"query": list(queries), "prompts": list(prompts), "labels": list(labels)}).encode()
        errors: list[str] = []
        for attempt in range(retries + 1):
            url = urls[next_url()]
            try:
                return validate_output(_post_json(url, body, timeout_s), len(queries), url)
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:300]
                if exc.code < 500:  # a client error will not fix itself
                    raise RewardPluginError(f"reward endpoint {url} answered HTTP {exc.code}: {detail}") from exc
                errors.append(f"{url}: HTTP {exc.code} {detail[:80]}")
            except json.JSONDecodeError as exc:
                errors.append(f"{url}: invalid JSON ({exc})")
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                errors.append(f"{url} unreachable ({type(exc).__name__}: {getattr(exc, 'reason', exc)})")
            if attempt < retries:
                time.sleep(backoff_s * (2**attempt))
        raise RewardPluginError(
            f"reward endpoint(s) failed {retries + 1} time(s): {'; '.join(errors[-3:])}. Is the reward server "
            f"running and --reward.remote_url right? (--reward.remote_timeout_s {timeout_s}, "
            f"--reward.remote_retries {retries})"
        )

    def call(queries: list[str], prompts: list[str], labels: list[str], **kw) -> dict:
        n = len(queries)
        if n == 0:
            return {"rewards": [], "scores": [], "extra_logs": {}}
        k = min(len(urls), n)
        size = -(-n // k)
        shards = [(queries[i : i + size], prompts[i : i + size], labels[i : i + size]) for i in range(0, n, size)]
        if len(shards) == 1:
            return send(shards[0])
        with ThreadPoolExecutor(len(shards)) as pool:
            return merge_outputs(list(pool.map(send, shards)))

    return call


def split_urls(remote_url: str | list[str] | tuple[str, ...]) -> list[str]:
    """``"http://a,http://b"`` (OpenRLHF's comma-separated form) or a list -> stripped entries."""
    items = remote_url if isinstance(remote_url, (list, tuple)) else str(remote_url).split(",")
    return [u.strip() for u in items if u and u.strip()]


def load_reward_fn(
    remote_url: str | list[str], timeout_s: float = 180.0, retries: int = 4, backoff_s: float = 1.0
) -> RewardFn:
    """A callable ``fn(queries, prompts, labels, **kw) -> {"rewards", "scores", "extra_logs"}`` (floats
    per sample; extra logs as lists of floats) for a local ``.py`` file or http(s) endpoint(s).
    Defaults follow OpenRLHF 0.11 (180 s per request, 5 attempts). Raises :class:`RewardPluginError`."""
    urls = split_urls(remote_url or "")
    if not urls:
        raise RewardPluginError("--reward.remote_url is empty; give a .py file or http(s) URL(s), comma-separated")
    if timeout_s <= 0 or retries < 0:
        raise RewardPluginError(
            f"--reward.remote_timeout_s must be > 0 and --reward.remote_retries >= 0 (got {timeout_s}, {retries})"
        )
    if all(u.startswith(("http://", "https://")) for u in urls):
        return _http_reward_fn(urls, timeout_s, retries, backoff_s)
    if len(urls) == 1 and urls[0].endswith(".py"):
        return _local_reward_fn(urls[0])
    if any(u.endswith(".py") for u in urls):
        raise RewardPluginError(
            f"--reward.remote_url={','.join(urls)!r}: a .py reward_func file must be the only entry "
            "(comma-separated lists are for http(s) endpoints)"
        )
    bad = next(u for u in urls if not u.startswith(("http://", "https://")))
    raise RewardPluginError(
        f"--reward.remote_url entry {bad!r} is neither an http(s) URL nor a .py file with reward_func"
    )
