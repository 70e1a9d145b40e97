"""The Responses API's stored responses (`store`, `previous_response_id`, GET / DELETE
/v1/responses/<id>): an in-memory LRU bounded by count and by bytes (option.responses_store_max_items,
option.responses_store_max_mb). A response past either bound is evicted, least recently used first;
one larger than the byte bound alone is not kept. In this process only: a restart, or another
worker process, does not see it. Thread-safe; no Flask."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict


class ResponseStore:
    def __init__(self, max_items: int, max_bytes: int):
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[str, tuple[dict, int]] = OrderedDict()   # id -> (record, its size)
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def size(record: dict) -> int:
        """What a record counts against the byte bound: its JSON text's UTF-8 bytes."""
        return len(json.dumps(record, ensure_ascii=False).encode("utf-8", "backslashreplace"))

    def put(self, rid: str, record: dict) -> bool:
        """Keep `record` under `rid` (most recently used); False when it alone exceeds the bound."""
        n = self.size(record)
        with self._lock:
            self._drop(rid)
            if n > self.max_bytes or self.max_items == 0:
                return False
            self._items[rid] = (record, n)
            self._bytes += n
            while len(self._items) > self.max_items or self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))
            return True

    def get(self, rid: str) -> dict | None:
        with self._lock:
            got = self._items.get(rid)
            if got is None:
                return None
            self._items.move_to_end(rid)
            return got[0]

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._drop(rid)

    def _drop(self, rid: str) -> bool:
        got = self._items.pop(rid, None)
        if got is not None:
            self._bytes -= got[1]
        return got is not None

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes
