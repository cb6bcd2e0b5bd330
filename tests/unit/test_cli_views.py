"""Text views of the admin CLI, on a stats dict of the shape Store.stats() returns."""

from kvstore.cli.views import ls_table, sort_entries, stats_view

STATS = {"tiers": {"nvme": {"capacity": 4 << 30, "used": 1 << 30, "entries": 10, "hits": 1},
                   "dram": {"capacity": 1 << 30, "used": 1 << 29, "entries": 5, "hits": 3,
                            "bytes_in": 3 << 20, "bytes_out": 3 << 19}},
         "entries": 15, "hits": 4, "misses": 4, "bytes_in": 3 << 20, "bytes_out": 1 << 20,
         "evictions": 2, "demotions": 7, "stagings": 1, "checksum_failures": 1,
         "commit_checksum_failures": 1, "leases": 2, "leased_entries": 6, "reservations": 1,
         "pinned_entries": 0, "reservations_expired": 0, "leases_expired": 3,
         "requests": 99, "errors": 1, "busy": 5, "late_writes": 2, "uptime_s": 3700}


def test_stats_view_shows_tiers_in_order_with_rates():
    text = stats_view("tcp://n1:7700", STATS)
    lines = text.splitlines()
    assert lines[0] == "tcp://n1:7700  (up 1h01m)"
    assert lines[2].split()[:5] == ["dram", "1.0GiB", "512.0MiB", "50.0%", "5"]
    assert lines[3].split()[0] == "nvme" and lines[4].split()[0] == "total"
    # 3 of 8 lookups served from dram; 3 MiB committed into it, 1.5 MiB served from it
    assert lines[2].split()[-3:] == ["37.5%", "3.0MiB", "1.5MiB"]
    assert lines[3].split()[-3:] == ["12.5%", "-", "-"]  # an old server: no per-tier bytes
    assert "4 / 4 (hit rate 50.0%)" in text
    assert "3.0MiB / 1.0MiB" in text and "7 / 1" in text
    assert "checksum failures:" in text and "2 (6 entries)" in text and "99 (1)" in text
    assert "busy / late writes / reads:" in text and "5 / 2 / -" in text


def test_stats_view_tolerates_missing_fields():
    assert "total" in stats_view("s", {"tiers": {}})


def test_sort_entries():
    es = [{"key": b"b", "created": 2.0, "last_access": 5.0, "nbytes": 1, "tier": "nvme"},
          {"key": b"a", "created": 1.0, "last_access": 9.0, "nbytes": 3, "tier": "dram"}]
    assert [e["key"] for e in sort_entries(es, "age", False, None)] == [b"a", b"b"]
    assert [e["key"] for e in sort_entries(es, "last-access", True, None)] == [b"a", b"b"]
    assert [e["key"] for e in sort_entries(es, "tier", False, None)] == [b"a", b"b"]
    assert [e["key"] for e in sort_entries(es, "prompt", False, [b"b", b"a"])] == [b"b", b"a"]
    assert [e["key"] for e in sort_entries(es, "prompt", False, None)] == [b"a", b"b"]


def test_ls_table():
    entry = {"key": "ab" * 16, "tier": "dram", "nbytes": 512, "ntokens": 4, "age_s": 3.0,
             "idle_s": 1.0, "pins": 0, "pending": 1, "namespace": "0123456789abcdef"}
    text = ls_table("s", {"total": 3, "offset": 1, "entries": [entry],
                          "prompt_blocks": 4, "stored_prefix_blocks": 2})
    assert text.splitlines()[0] == ("s: 1 of 3 entries (from #1); the prompt has 4 blocks, "
                                    "the first 2 stored")
    assert "ab" * 16 in text and "512B" in text
    assert text.splitlines()[1].split()[-1] == "NS"
    assert text.splitlines()[2].split()[-1] == "01234567"  # the tag's first 8 hex digits
    assert ls_table("s", {"total": 0, "entries": []}) == "s: 0 of 0 entries"
