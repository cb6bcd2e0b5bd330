"""The connector's stats and worker reports through vLLM's own machinery: the TP
aggregator of worker outputs, the pickling that carries them to the engine core, the
msgpack codec that carries scheduler stats to the front end, the "KV Transfer metrics"
logger and the Prometheus logger of ``/metrics``."""

from __future__ import annotations

import logging
import os
import pickle

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.metrics")

from prometheus_client import REGISTRY, generate_latest  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.v1.engine import EngineCoreOutputs  # noqa: E402
from vllm.v1.metrics.prometheus import unregister_vllm_metrics  # noqa: E402
from vllm.v1.metrics.stats import SchedulerStats  # noqa: E402
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from kvstore.connector.v1_stats import KVStoreConnectorStats, TransferReports  # noqa: E402
from kvstore.connector.vllm_v1 import KVStoreConnectorV1  # noqa: E402

KVT = KVTransferConfig(kv_connector="KVStoreConnectorV1",
                       kv_connector_module_path="kvstore.connector.vllm_v1",
                       kv_role="kv_both", kv_connector_extra_config={"server": "tcp://h:1"})


def rank_stats(first_rank: bool) -> KVStoreConnectorStats:
    """One TP worker's step: a load of 32 tokens and a save of 64, one failed save."""
    s = KVStoreConnectorStats()
    s.record_load(32, 4096, 0.010, failed=False, count_request=first_rank)
    s.record_save(64, 8192, 0.020, ok=True, count_request=first_rank)
    s.record_save(64, 8192, 0.5, ok=False, count_request=first_rank)
    return s


def worker_output(stats, reports):
    out = pickle.loads(pickle.dumps(EMPTY_MODEL_RUNNER_OUTPUT))
    out.kv_connector_output = KVConnectorOutput(kv_connector_stats=stats,
                                                kv_connector_worker_meta=reports)
    return pickle.loads(pickle.dumps(out))  # as the multiproc executor carries it


def test_take_resets_and_an_idle_interval_is_none():
    s = rank_stats(True)
    taken = s.take()
    assert taken.data["saves"] == 1 and taken.data["save_failures"] == 1
    assert s.is_empty() and s.take() is None
    assert taken.data["loaded_bytes"] == 4096  # the taken one is not reset with it


def test_tp_workers_aggregate_through_vllms_output_aggregator():
    """Bytes and failures add over ranks; requests and tokens are the first rank's."""
    agg = KVOutputAggregator(expected_finished_count=2)
    r0 = TransferReports(saved={"a": [64]}, dropped={"b": [32]})
    r1 = TransferReports(saved={"a": [0]})
    out = agg.aggregate([worker_output(rank_stats(True), r0),
                         worker_output(rank_stats(False), r1)])
    kv = out.kv_connector_output
    d = kv.kv_connector_stats.data
    assert (d["loads"], d["loaded_tokens"], d["loaded_bytes"]) == (1, 32, 8192)
    assert (d["saves"], d["saved_tokens"], d["saved_bytes"]) == (1, 64, 16384)
    assert d["save_failures"] == 2 and d["load_failures"] == 0
    assert sorted(d["save_seconds"]) == [0.020, 0.020]
    assert kv.kv_connector_worker_meta.saved == {"a": [64, 0]}
    assert kv.kv_connector_worker_meta.dropped == {"b": [32]}


def test_stats_cross_to_the_front_end_and_reach_the_log_line(caplog):
    """Scheduler stats carry ``to_dict()`` through vLLM's msgpack codec; the front end's
    KVConnectorLogging rebuilds it with our class, accumulates and logs it once."""
    sched = KVStoreConnectorStats()
    sched.record_lookup(0)
    sched.record_lookup(10)
    sched.record_rejected(2)
    step = rank_stats(True).aggregate(sched)
    outs = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=step.to_dict()))
    wire = MsgpackEncoder().encode(outs)
    data = MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats.kv_connector_stats
    assert data == step.data

    logging_ = KVConnectorLogging(KVT)
    logging_.observe(data)
    logging_.observe(rank_stats(True).to_dict())
    lines = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and lines[0].startswith("KV Transfer metrics: ")
    assert "Loads=2" in lines[0] and "Saved tokens=128" in lines[0]
    assert "Hits=1" in lines[0] and "Misses=1" in lines[0] and "Rejected servers=2" in lines[0]
    assert "Save failures=2" in lines[0] and "Avg save ms=20.0" in lines[0]
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1  # reset after logging: nothing new, no line


def test_prometheus_counters_and_histograms_through_vllms_logger():
    unregister_vllm_metrics()
    try:
        prom = KVConnectorProm(VllmConfig(kv_transfer_config=KVT), ["model_name", "engine"],
                               {0: ["m", "0"]})
        assert prom.prom_metrics is not None  # built by KVStoreConnectorV1.build_prom_metrics
        for _ in range(2):
            prom.observe(rank_stats(True).to_dict(), engine_idx=0)
        text = generate_latest(REGISTRY).decode()
    finally:
        unregister_vllm_metrics()
    labels = '{engine="0",model_name="m"}'
    assert f"vllm:kvstore_loaded_bytes_total{labels} 8192.0" in text
    assert f"vllm:kvstore_saves_total{labels} 2.0" in text
    assert f"vllm:kvstore_save_failures_total{labels} 2.0" in text
    assert f"vllm:kvstore_misses_total{labels} 0.0" in text
    assert f"vllm:kvstore_load_seconds_count{labels} 2.0" in text
    assert f'vllm:kvstore_save_seconds_bucket{{engine="0",le="0.025",model_name="m"}} 2.0' in text


def test_stats_of_an_older_or_newer_peer_rebuild():
    """Keys a peer lacks read as 0; keys we do not know are carried, not dropped."""
    s = KVStoreConnectorV1.build_kv_connector_stats({"loads": 3, "future_thing": 1})
    assert s.data["loads"] == 3 and s.data["saved_bytes"] == 0 and s.data["future_thing"] == 1
    assert s.reduce()["Loads"] == 3
    assert KVStoreConnectorV1.build_kv_connector_stats().is_empty()


def hashed_request(req_id: str, prompt: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(req_id, prompt, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(4, sha256))


def test_tp_events_wait_for_every_worker_stored_is_the_least_removed_the_most():
    """Two TP workers: a block is in the store once both ranks' entries are, and gone
    once either rank's were taken."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvstore.connector.v1_stats import StoreEvents

    def published(hashes):  # as vLLM publishes them (64-bit ints by default)
        return [maybe_convert_block_hash(h) for h in hashes]

    events = StoreEvents(enabled=True, workers=2, block_size=4, hash_block_size=4)
    req = hashed_request("r", list(range(13)))  # 3 full blocks
    events.expect_save(req)
    events.observe(TransferReports(saved={"r": [12]}))
    assert events.take() == [] and events.pending()  # rank 1 not in yet
    events.observe(TransferReports(saved={"r": [8]}))  # committed only 2 blocks' worth
    (stored,) = events.take()
    assert stored.block_hashes == published(req.block_hashes[:2]) and not events.pending()

    events.expect_drop(req)
    events.observe(TransferReports(dropped={"r": [0, 12]}))
    (removed,) = events.take()
    assert removed.block_hashes == published(req.block_hashes[:3])
    events.observe(TransferReports(saved={"unknown": [12]}))  # not expected: ignored
    assert events.take() == []


def test_reports_that_never_come_stop_keeping_vllm_stepping(monkeypatch, caplog):
    from kvstore.connector import v1_stats

    events = v1_stats.StoreEvents(enabled=True, workers=2, block_size=4, hash_block_size=4)
    events.expect_save(hashed_request("lost", list(range(9))))
    events.observe(TransferReports(saved={"lost": [8]}))
    assert events.pending()
    monkeypatch.setattr(v1_stats, "REPORT_WAIT_S", 0.0)
    with caplog.at_level(logging.WARNING):
        assert not events.pending()
    assert "never came" in caplog.text and events.take() == []
