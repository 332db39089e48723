"""Past responses, kept in memory so that `previous_response_id` continues a conversation and
`GET /v1/responses/{id}` finds a response.

Bounded: the last `capacity` responses (`responses_store_size`), the oldest dropped first; 0
keeps none. Each entry holds the whole conversation up to and including that response (as
Responses items, shared with the entries before it, not copied), so a follow-up needs only its
direct predecessor to be kept. Nothing is written to disk: a restart forgets every response.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from server.api.errors import APIError, bad_request
from server.api.responses_protocol import ConversationItem


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as the client got it
    conversation: list[ConversationItem]  # its input items after its predecessors', its output


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if not self.enabled:
            return
        self._entries[response_id] = entry
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def previous(self, response_id: str) -> StoredResponse:
        """The response a request continues (`previous_response_id`), or a 400 naming it."""
        if not self.enabled:
            raise bad_request(
                "this server keeps no responses (responses_store_size is 0); send the whole "
                "conversation in input instead",
                "previous_response_id",
                "unsupported",
            )
        entry = self._entries.get(response_id)
        if entry is None:
            raise bad_request(
                f"previous response with id {response_id!r} not found (this server keeps the "
                f"last {self.capacity} responses, in memory)",
                "previous_response_id",
                "previous_response_not_found",
            )
        return entry

    def get(self, response_id: str) -> dict[str, Any]:
        """A stored response's object (`GET /v1/responses/{id}`), or a 404."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(
                404,
                f"response with id {response_id!r} not found",
                param="response_id",
                code="response_not_found",
            )
        return entry.body
