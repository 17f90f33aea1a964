"""Exporters that read aiokvo's events and statistics, never its hot path.

* :mod:`aiokvo.telemetry.kv_events`: KV events over ZMQ in vLLM's wire
  format, for KV-aware routers (extra ``aiokvo[kv-events]``);
* :mod:`aiokvo.telemetry.kv_wire`: that format's structs and the pure
  translation of aiokvo's events into it.

Submodules are imported on demand, so ``import aiokvo.telemetry`` needs none
of the optional dependencies.
"""
