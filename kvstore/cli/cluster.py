"""The ``kvstore`` CLI's cluster view: the nodes registered in etcd.

``kvstore nodes --etcd URL``: each registered node, its tiers and usage, and
whether it answers (registered in etcd is not the same as alive: a SIGKILLed node
stays listed until its lease expires). ``kvstore stats --cluster --etcd URL``: the
summed stats of every registered node, then each node's own.

Both reuse the CLI's server options for the per-node channels (CURVE keys,
--timeout, --json); the node list comes from etcd, so ``--server`` is ignored.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import click

from kvstore.core import protocol as p
from kvstore.cli.admin import Admin, fail, server_options
from kvstore.cli.views import TIER_ORDER, stats_view
from kvstore.cli.format import (format_bytes, format_count, format_ratio, render_table, to_json,
                                to_json_line)
from kvstore.cluster.membership import NodeInfo, NodeSet
from kvstore.core.config import load_config
from kvstore.cluster.etcd import EtcdClient

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
ETCD_TIMEOUT_S = 2.0

etcd_option = click.option("--etcd", envvar="KVSTORE_CLIENT_ETCD", metavar="etcd://HOST:PORT",
                           help="The cluster's etcd [client.etcd].")
prefix_option = click.option("--prefix", envvar="KVSTORE_CLUSTER_PREFIX",
                             help="etcd key prefix of node records [cluster.prefix].")


def registered_nodes(etcd: str | None, prefix: str | None,
                     config_file: str | None = None) -> list[NodeInfo]:
    """Every node registered under the prefix, by node id (one etcd range read).
    ``etcd`` and ``prefix`` (flags or their environment variables) win over
    ``config_file``'s ``client.etcd`` and ``cluster.prefix``."""
    cfg = load_config(config_file, sections=("client", "cluster"))
    url = etcd or cfg.client.etcd
    if not url:
        fail("the cluster view needs --etcd etcd://HOST:PORT (or KVSTORE_CLIENT_ETCD, or "
             "client.etcd in --config)")
    nodes = NodeSet(EtcdClient(url, timeout_s=ETCD_TIMEOUT_S), prefix or cfg.cluster.prefix)
    return sorted(nodes.registered().values(), key=lambda n: n.node_id)


def node_admin(admin: Admin, nodes: list[NodeInfo]) -> Admin:
    """An Admin over the nodes' control addresses, with the command's CURVE/timeout/json."""
    return Admin([n.address for n in nodes], admin.timeout_s, admin.curve, admin.as_json,
                 admin.config_file)


# ------------------------------------------------------------------ nodes
@click.command(context_settings=CONTEXT)
@server_options
@etcd_option
@prefix_option
def nodes(admin: Admin, etcd: str | None, prefix: str | None) -> None:
    """Nodes registered in etcd: address, TE segment, tiers, usage, and liveness
    (UP: registered and answering; DOWN: registered but not answering). Exit 1 after
    the list when a node is DOWN, with one stderr line per such node (as ``stats
    --cluster``), so ``kvstore nodes`` can be a cluster's probe."""
    infos = registered_nodes(etcd, prefix, admin.config_file)
    cluster = node_admin(admin, infos)
    try:
        rows = [_node_row(info, cluster) for info in infos]
    finally:
        cluster.close()
    if admin.as_json:
        click.echo(to_json(rows))
    elif not rows:
        click.echo("no nodes registered")
    else:
        click.echo(render_table(["NODE", "ADDRESS", "TE SEGMENT", "STATE", "UPTIME", "ENTRIES",
                                 "TIERS (used/capacity)"], [_node_cells(r) for r in rows]))
    cluster.errors = [f"node {r['node_id']} is DOWN: {r['error']}" for r in rows
                      if not r["alive"]]
    cluster.finish()


def _node_row(info: NodeInfo, cluster: Admin) -> dict[str, Any]:
    row: dict[str, Any] = {"node_id": info.node_id, "address": info.address,
                           "te_segment": info.te_segment, "registered": True,
                           "registered_at": info.started, "capacities": info.tiers}
    try:
        channel = cluster.channel(info.address)
        health = channel.call(p.Health(deep=False))
        stats = channel.call(p.Stats())["stats"]
    except Exception as exc:  # noqa: BLE001 - a node that does not answer is a fact to show
        return {**row, "alive": False, "error": str(exc)}
    return {**row, "alive": True, "uptime_s": health.get("uptime_s"),
            "entries": stats.get("entries"),
            "tiers": {n: {"capacity": t.get("capacity"), "used": t.get("used"),
                          "entries": t.get("entries")} for n, t in stats["tiers"].items()}}


def _node_cells(row: Mapping[str, Any]) -> list[str]:
    if not row["alive"]:
        tiers = ", ".join(f"{n} {format_bytes(c)}" for n, c in _ordered(row["capacities"]))
        return [row["node_id"], row["address"], row["te_segment"], "DOWN", "-", "-", tiers]
    tiers = ", ".join(f"{n} {format_bytes(t['used'])}/{format_bytes(t['capacity'])} "
                      f"({format_ratio(t['used'] or 0, t['capacity'] or 0)})"
                      for n, t in _ordered(row["tiers"]))
    return [row["node_id"], row["address"], row["te_segment"], "UP",
            f"{format_count(round(row.get('uptime_s') or 0))}s", format_count(row["entries"]),
            tiers]


def _ordered(tiers: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return sorted(tiers.items(), key=lambda kv: TIER_ORDER.index(kv[0])
                  if kv[0] in TIER_ORDER else len(TIER_ORDER))


# ------------------------------------------------------------------ stats --cluster
def sum_stats(per_node: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Node stats added up: numeric counters summed, tiers summed field by field."""
    total: dict[str, Any] = {"tiers": {}}
    for st in per_node:
        for name, value in st.items():
            if name == "tiers":
                for tier, fields in value.items():
                    into = total["tiers"].setdefault(tier, {})
                    for f, v in fields.items():
                        if _number(v):
                            into[f] = into.get(f, 0) + v
            elif _number(value) and name != "uptime_s":
                total[name] = total.get(name, 0) + value
    total["nodes"] = len(per_node)
    return total


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def cluster_stats(admin: Admin, etcd: str | None, prefix: str | None = None,
                  watch: float | None = None, count: int | None = None) -> None:
    """``kvstore stats --cluster``: the summed view first, then every node's."""
    shown = 0
    while True:
        infos = registered_nodes(etcd, prefix, admin.config_file)
        cluster = node_admin(admin, infos)
        try:
            results = [(s, r["stats"]) for s, r in cluster.call_each(lambda: p.Stats())]
            total = (f"cluster total ({len(results)} nodes)",
                     sum_stats([st for _, st in results]))
            if cluster.as_json:  # --watch: JSON Lines, one compact list per refresh
                dump = to_json_line if watch else to_json
                click.echo(dump([{"server": s, **r} for s, r in [total, *results]]))
            else:
                click.echo(f"{len(results)} of {len(infos)} registered nodes answered\n\n"
                           + "\n\n".join(stats_view(s, st) for s, st in [total, *results]))
            cluster.finish()
        finally:
            cluster.close()
        shown += 1
        if not watch or (count and shown >= count):
            return
        time.sleep(watch)
