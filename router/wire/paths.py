"""Upstream RPC method paths, pinned explicitly (the wire carries no package names)."""

from __future__ import annotations

KVCM_GET_CLUSTER_INFO = "/kv_cache_manager.proto.meta.MetaService/GetClusterInfo"
KVCM_GET_HOST_CACHE_STATE = "/kv_cache_manager.proto.meta.MetaService/GetHostCacheState"
WORKER_GET_STATUS = "/RpcService/GetWorkerStatus"
ROUTER_ROUTE = "/kvroute.v1.Router/Route"
# The central scheduler's gRPC API (package-less upstream; our messages live in kvroute.master.v1).
MASTER_SCHEDULE = "/FlexlbService/Schedule"
MASTER_CANCEL = "/FlexlbService/Cancel"
# Its HTTP JSON API (paths on the scheduler's HTTP port).
MASTER_HTTP_SCHEDULE = "/rtp_llm/schedule"
MASTER_HTTP_INFO = "/rtp_llm/master/info"

ALL_UPSTREAM = (KVCM_GET_CLUSTER_INFO, KVCM_GET_HOST_CACHE_STATE, WORKER_GET_STATUS, MASTER_SCHEDULE, MASTER_CANCEL)
