"""Upstream RPC method paths, pinned explicitly (the wire carries no package names)."""

from __future__ import annotations

KVCM_GET_CLUSTER_INFO = "/kv_cache_manager.proto.meta.MetaService/GetClusterInfo"
KVCM_GET_HOST_CACHE_STATE = "/kv_cache_manager.proto.meta.MetaService/GetHostCacheState"
WORKER_GET_STATUS = "/RpcService/GetWorkerStatus"
ROUTER_ROUTE = "/kvroute.v1.Router/Route"

ALL_UPSTREAM = (KVCM_GET_CLUSTER_INFO, KVCM_GET_HOST_CACHE_STATE, WORKER_GET_STATUS)
