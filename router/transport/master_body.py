"""The schedule call's JSON body, encoded without holding the routing loop (both HTTP-shaped adapters)."""

from __future__ import annotations

import trio

from router.wire.master import MasterScheduleRequest, encode_schedule_json, schedule_json_items, schedule_json_parts

# Array items encoded between two checkpoints: about a millisecond of json's work. A body with no more
# (every prompt with keys up to this many blocks) is encoded at once, without a checkpoint.
SCHEDULE_JSON_SLICE_ITEMS = 8192


async def schedule_body(request: MasterScheduleRequest) -> bytes:
    """The body; a long prompt's in slices with a checkpoint after each, so other requests run in
    between and the caller's deadline can end the encoding there."""
    if schedule_json_items(request) <= SCHEDULE_JSON_SLICE_ITEMS:
        return encode_schedule_json(request)
    parts: list[bytes] = []
    for part in schedule_json_parts(request, SCHEDULE_JSON_SLICE_ITEMS):
        parts.append(part)
        await trio.lowlevel.checkpoint()
    return b"".join(parts)
