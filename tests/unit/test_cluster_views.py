"""The cluster CLI's pure parts: summing node stats, rendering node rows."""

from kvstore.cli.cluster import _node_cells, sum_stats


def test_sum_stats_adds_counters_and_tiers_and_skips_the_rest():
    a = {"tiers": {"dram": {"capacity": 10, "used": 4, "entries": 2, "hits": 1}},
         "entries": 2, "hits": 1, "misses": 3, "uptime_s": 50.0, "version": "x", "flag": True}
    b = {"tiers": {"dram": {"capacity": 10, "used": 1, "entries": 1, "hits": 0},
                   "nvme": {"capacity": 100, "used": 0, "entries": 0, "hits": 0}},
         "entries": 1, "hits": 0, "misses": 1, "uptime_s": 7.0}
    total = sum_stats([a, b])
    assert total["tiers"] == {"dram": {"capacity": 20, "used": 5, "entries": 3, "hits": 1},
                              "nvme": {"capacity": 100, "used": 0, "entries": 0, "hits": 0}}
    assert (total["entries"], total["hits"], total["misses"], total["nodes"]) == (3, 1, 4, 2)
    assert "uptime_s" not in total and "version" not in total and "flag" not in total


def test_sum_of_no_nodes_is_empty():
    assert sum_stats([]) == {"tiers": {}, "nodes": 0}


def test_node_rows_show_state_and_tiers_in_order():
    down = {"node_id": "n1", "address": "tcp://h:1", "te_segment": "h:2", "alive": False,
            "capacities": {"nvme": 2 << 30, "dram": 1 << 30}}
    cells = _node_cells(down)
    assert cells[3] == "DOWN" and cells[-1].index("dram") < cells[-1].index("nvme")
    up = {**down, "alive": True, "uptime_s": 12.4, "entries": 7,
          "tiers": {"dram": {"capacity": 1 << 30, "used": 1 << 29, "entries": 7}}}
    cells = _node_cells(up)
    assert cells[3] == "UP" and cells[5] == "7" and "50" in cells[-1]
