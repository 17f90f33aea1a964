"""Exporters that read aiokvo's events and statistics, never its hot path.

* :mod:`aiokvo.telemetry.prometheus`: ``OffloadMetrics`` (a collector for a
  prometheus-client registry) and ``start_metrics_server`` (extra
  ``aiokvo[prometheus]``);
* :mod:`aiokvo.telemetry.kv_events`: KV events over ZMQ in vLLM's wire
  format, for KV-aware routers (extra ``aiokvo[kv-events]``);
* :mod:`aiokvo.telemetry.kv_wire`: that format's structs and the pure
  translation of aiokvo's events into it;
* :mod:`aiokvo.telemetry.stats`: per-tier totals and rates from statistics
  snapshots (pure; what the exporters and the live view share);
* :mod:`aiokvo.telemetry.watch` and :mod:`aiokvo.telemetry.cli`: the live
  view, ``aiokvo watch`` / ``python -m aiokvo.telemetry watch`` (extra
  ``aiokvo[watch]``).

Submodules are imported on demand, so ``import aiokvo.telemetry`` needs none
of the optional dependencies.
"""
