"""``openrlhf-shape doctor``: what a long job needs from the Ray cluster, checked in a minute before it.

With the same config and flags as ``train``, against the cluster the job will use (``--train.ray_address``):

* **nodes**: every alive node with its CPUs and GPUs, against what the layout needs;
* **placement**: the job's per-node placement groups (``cluster/ray_placement.py``), created for real,
  then released (and seen released);
* **rendezvous**: a listener on Megatron rank 0's bundle (where the real rendezvous and the weight-sync
  store live), connected to from every node of the cluster;
* **shared paths**: the output directory (checkpoints and the HF export are renamed by rank 0 after the
  others wrote their shards: on node-local disks the other nodes' shards are silently left behind) is
  writable from every node and what one node writes, every node sees; the model directory is readable
  on every node at the same path;
* **environment**: the NCCL/GLOO/CUDA variables each node's workers get, printed (not judged).

Every check returns a :class:`Check`; the command prints them and exits 1 if one failed. Nothing of
the job starts (no model, no engine), and everything the doctor made is removed.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "UCX_", "FI_",
                "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"[{'ok' if self.ok else 'FAIL'}] {self.name}: {self.detail}"


# ---------------------------------------------------------------------------------------------------
# What runs on the nodes (Ray tasks / one actor; plain functions so they pickle by reference)
# ---------------------------------------------------------------------------------------------------


def _node_report(paths: dict[str, str], token: str, model_dir: str | None, rendezvous: tuple[str, int] | None,
                 timeout_s: float) -> dict[str, Any]:
    """On one node: reach the rendezvous, see the driver's token file, write this node's own, read the
    model's config.json; the environment the workers get."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    out: dict[str, Any] = {"node_id": node, "host": socket.gethostname(),
                           "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}}
    if rendezvous is not None:
        try:
            with socket.create_connection(rendezvous, timeout=timeout_s):
                out["rendezvous"] = "reached"
        except OSError as e:
            out["rendezvous"] = f"{type(e).__name__}: {e}"
    out["paths"] = {}
    for flag, path in paths.items():
        sees = os.path.exists(os.path.join(path, f".doctor-{token}"))
        try:
            with open(os.path.join(path, f".doctor-{token}-{node}"), "w") as f:
                f.write(node)
            wrote = "wrote"
        except OSError as e:
            wrote = f"cannot write ({e.strerror})"
        out["paths"][flag] = {"sees_driver_file": sees, "write": wrote}
    if model_dir is not None:
        out["model_config"] = os.path.isfile(os.path.join(model_dir, "config.json"))
    return out


class _Listener:
    """Holds a listening socket on its node (the rendezvous's stand-in) and accepts in a thread."""

    def __init__(self):
        import threading

        import ray

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("", 0))
        self.sock.listen(64)
        self.ip = ray.util.get_node_ip_address()
        self.node = ray.get_runtime_context().get_node_id()

        def accept() -> None:
            while True:
                try:
                    conn, _ = self.sock.accept()
                    conn.close()
                except OSError:
                    return

        threading.Thread(target=accept, daemon=True).start()

    def address(self) -> dict[str, Any]:
        return {"ip": self.ip, "port": self.sock.getsockname()[1], "node_id": self.node}


# ---------------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------------


def shared_paths(cfg) -> dict[str, str]:
    """flag -> directory that every node must share (created here if missing)."""
    paths = {"--ckpt.output_dir": os.path.abspath(cfg.ckpt.output_dir)}
    if cfg.ckpt.path:
        paths["--ckpt.path"] = os.path.abspath(cfg.ckpt.path)
    return paths


def write_driver_tokens(paths: dict[str, str], token: str) -> tuple[dict[str, str], list[str], list[Check]]:
    """The driver's token file in each path: (paths it could write, files made, failures)."""
    made, failed = [], []
    for flag, path in paths.items():
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, f".doctor-{token}"), "w") as f:
                f.write("driver")
            made.append(os.path.join(path, f".doctor-{token}"))
        except OSError as e:
            failed.append(Check(f"shared path {flag}", False, f"{path}: the driver cannot write it ({e})"))
    writable = {f: p for f, p in paths.items() if os.path.join(p, f".doctor-{token}") in made}
    return writable, made, failed


def path_verdicts(writable: dict[str, str], reports: list[dict], token: str, made: list[str]) -> list[Check]:
    """Per path: every node wrote its file, saw the driver's, and the driver sees every node's
    (the node files are appended to ``made`` for clean-up)."""
    checks = []
    for flag, path in writable.items():
        problems = []
        for r in reports:
            st = r["paths"][flag]
            where = f"{r['host']} ({r['node_id'][:8]})"
            if st["write"] != "wrote":
                problems.append(f"{where} {st['write']}")
            elif not st["sees_driver_file"]:
                problems.append(f"{where} does not see the driver's file")
            elif not os.path.exists(os.path.join(path, f".doctor-{token}-{r['node_id']}")):
                problems.append(f"the driver does not see {where}'s file")
            made.append(os.path.join(path, f".doctor-{token}-{r['node_id']}"))
        checks.append(Check(f"shared path {flag}", not problems and bool(reports),
                            f"{path}: " + ("written and seen by every node" if not problems else "; ".join(problems)
                                           + f": {flag} must be on a filesystem every node shares, at the same path")))
    return checks


def _remove(files: list[str]) -> None:
    for p in files:
        try:
            os.remove(p)
        except OSError:
            pass


def _on_nodes(fn, node_ids: list[str], *args):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return [ray.remote(fn).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
            .remote(*args) for n in node_ids]


def check_shared_output(cfg, node_ids: list[str], timeout_s: float = 60.0) -> None:
    """Start-up guard of a multi-node run: the output directories are shared by the driver and every node
    that hosts ranks (checkpoints and the HF export are finished by rank 0 after every rank wrote its
    shards: on node-local disks the other nodes' shards would be silently missing). Raises naming the
    flag; a run whose ranks all sit on the driver's node has nothing to check."""
    import ray

    others = sorted(set(node_ids) - {ray.get_runtime_context().get_node_id()})
    if not others:
        return
    token = uuid.uuid4().hex[:12]
    writable, made, failed = write_driver_tokens(shared_paths(cfg), token)
    try:
        reports = ray.get(_on_nodes(_node_report, others, writable, token, None, None, 10.0), timeout=timeout_s)
        failed += [c for c in path_verdicts(writable, reports, token, made) if not c.ok]
    finally:
        _remove(made)
    if failed:
        raise RuntimeError("the run's output is not on a filesystem shared by every node: "
                           + " | ".join(c.detail for c in failed) + " (openrlhf-shape doctor checks a cluster before a run)")


def run_doctor(cfg, on_gpu: bool, timeout_s: float = 60.0) -> list[Check]:
    """Every check against the Ray cluster this process is connected to (see the module docstring)."""
    import ray

    from openrlhf_shape.cluster.placement import plan_for

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    res = [(n["NodeID"], n.get("NodeManagerAddress", "?"), n.get("Resources", {})) for n in nodes]
    plan = plan_for(cfg, on_gpu)
    checks: list[Check] = [_nodes_check(nodes, res, plan, on_gpu)]
    placement = _try_placement(plan, on_gpu, timeout_s, checks)
    rendezvous, listener = _start_listener(placement, timeout_s, checks) if placement is not None else (None, None)

    token = uuid.uuid4().hex[:12]
    writable, made, failed = write_driver_tokens(shared_paths(cfg), token)
    checks += failed
    model_dir = cfg.actor.model_name_or_path if cfg.actor.model_name_or_path != "demo" else None
    reports = []
    try:
        refs = _on_nodes(_node_report, [node_id for node_id, _, _ in res], writable, token, model_dir, rendezvous,
                         min(timeout_s, 10.0))
        reports = ray.get(refs, timeout=timeout_s)
    except Exception as e:
        checks.append(Check("nodes respond", False, f"a node did not run the check within {timeout_s:.0f} s: {e}"))
    finally:
        if listener is not None:
            ray.kill(listener)

    if rendezvous is not None and reports:
        checks.append(_rendezvous_check(rendezvous, reports))
    checks += path_verdicts(writable, reports, token, made)
    checks += _node_report_checks(reports, model_dir)
    _remove(made)
    if placement is not None:
        checks.append(_release(placement))
    return checks


def _nodes_check(nodes: list[dict], res: list[tuple[str, str, dict]], plan, on_gpu: bool) -> Check:
    """Enough alive nodes (with GPUs, on GPU) for the layout's per-node bundles."""
    gpu_nodes = [r for r in res if r[2].get("GPU", 0) >= 1]
    desc = ", ".join(f"{ip} {int(r.get('GPU', 0))} GPU/{int(r.get('CPU', 0))} CPU" for _, ip, r in res)
    if on_gpu:
        ok = len(gpu_nodes) >= len(plan.node_bundles)
        need = f"the layout needs {len(plan.node_bundles)} node(s) with {list(plan.node_bundles)} GPUs"
    else:
        ok = bool(nodes)
        need = f"CPU run: {sum(plan.node_bundles)} CPU slots on the local node"
    return Check("nodes", ok, f"{len(nodes)} alive ({desc}); {need}")


def _try_placement(plan, on_gpu: bool, timeout_s: float, checks: list[Check]):
    """The run's placement groups (tiny bundles), or None; the outcome is appended to ``checks``."""
    from openrlhf_shape.cluster.ray_placement import RayPlacement

    try:
        placement = RayPlacement(plan, cpus_per_bundle=0.01, gpus=on_gpu, timeout_s=timeout_s)
    except Exception as e:
        checks.append(Check("placement", False, str(e)))
        return None
    checks.append(Check("placement", True, f"{len(placement.groups)} per-node group(s) of {list(plan.node_bundles)} "
                                           "bundles placed"))
    return placement


def _start_listener(placement, timeout_s: float, checks: list[Check]):
    """(rendezvous (ip, port), listener actor) on rank 0's bundle, or (None, None) with a failed check appended."""
    import ray

    listener = None
    try:
        opts = placement.rank_options(0, 0.01)
        listener = ray.remote(_Listener).options(**opts).remote()
        addr = ray.get(listener.address.remote(), timeout=timeout_s)
        return (addr["ip"], int(addr["port"])), listener
    except Exception as e:
        checks.append(Check("rendezvous", False, f"no listener on rank 0's bundle: {e}"))
        return None, listener


def _rendezvous_check(rendezvous: tuple[str, int], reports: list[dict]) -> Check:
    """Every node reached the listener on rank 0's node (the port every rank connects to at start-up)."""
    bad = [f"{r['host']} ({r['node_id'][:8]}): {r['rendezvous']}" for r in reports if r["rendezvous"] != "reached"]
    return Check("rendezvous", not bad, f"{rendezvous[0]}:{rendezvous[1]} on rank 0's node "
                 + ("reached from every node" if not bad else "NOT reached from " + "; ".join(bad)
                    + " (open the port range between nodes, or set the interface: NCCL_SOCKET_IFNAME, "
                    "GLOO_SOCKET_IFNAME)"))


def _node_report_checks(reports: list[dict], model_dir: str | None) -> list[Check]:
    """The model directory seen by every node, and each node's NCCL/GLOO/CUDA environment."""
    checks = []
    if model_dir is not None and reports:
        missing = [r["host"] for r in reports if not r["model_config"]]
        checks.append(Check("model directory", not missing,
                            f"{model_dir}/config.json " + ("read on every node" if not missing else
                                                           f"missing on {', '.join(missing)}: --actor.model_name_or_path "
                                                           "must be on a filesystem every node sees")))
    for r in reports:
        env = " ".join(f"{k}={v}" for k, v in r["env"].items()) or "(no NCCL/GLOO/CUDA variables set)"
        checks.append(Check(f"env {r['host']} ({r['node_id'][:8]})", True, env))
    return checks


def _release(placement) -> Check:
    """Remove the doctor's placement groups and check Ray reports them removed."""
    from ray.util.placement_group import placement_group_table

    groups = list(placement.groups)
    placement.remove()
    states = [placement_group_table(g).get("state") for g in groups]
    return Check("placement released", all(s == "REMOVED" for s in states), f"group states {states}")
