"""Simulated peers: KVCM replicas and engine workers, served in memory or over real gRPC.

Layers (each usable alone):

- pure-ish cores, no I/O, time passed in: ``index.SimKvcmIndex`` (prefix index with
  per-worker LRU), ``kvcm.SimKvcmCluster`` (replicas, leader, faults), ``worker.SimWorker``
  (queueing model and status replies);
- servers executing a core's call plan: ``memory_server`` (handlers for
  ``MemoryNetwork``, faults on trio time) and ``grpc_server`` (real gRPC on 127.0.0.1:0);
- ``cluster.SimCluster``: the façade building replicas + workers on either transport;
- ``cluster_cli``: ``kvroute sim-cluster``.
"""
