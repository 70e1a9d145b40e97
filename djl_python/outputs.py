"""LMI's Output: a status code and message, properties (the response's headers: `content-type`) and
content pairs, which the server writes as the response body."""
from __future__ import annotations

import json


class Output:
    def __init__(self, code: int = 200, message: str = "OK"):
        self.code = code
        self.message = message
        self.properties: dict = {}
        self.content: list[tuple[str | None, bytes]] = []

    def __str__(self):
        return json.dumps({"code": self.code, "message": self.message, "properties": self.properties,
                           "content": {str(k): f"{len(v)} bytes" for k, v in self.content}})

    def set_code(self, code: int) -> "Output":
        self.code = code
        return self

    def set_message(self, message: str) -> "Output":
        self.message = message
        return self

    def error(self, error: str, code: int = 424, message: str = "invoke handler failure") -> "Output":
        """A failed request: LMI's {"code", "message", "error"} body, status `code` (424 by default)."""
        self.code, self.message = code, message
        self.add_property("content-type", "application/json")
        return self.add_as_json({"code": code, "message": message, "error": error})

    def add_property(self, key, val) -> "Output":
        self.properties[key] = val
        return self

    def get_properties(self) -> dict:
        return self.properties

    def get_property(self, key):
        return self.properties.get(key)

    def add(self, value, key=None, batch_index=None) -> "Output":
        """str (UTF-8), bytes or bytearray as they are; anything else as JSON."""
        if key is not None:
            key = str(key)
        if batch_index is not None:
            key = f"batch_{batch_index}.{key or ''}"
        if isinstance(value, str):
            data = value.encode("utf-8")
        elif isinstance(value, (bytes, bytearray)):
            data = bytes(value)
        else:
            data = json.dumps(value, ensure_ascii=False).encode("utf-8")
        self.content.append((key, data))
        return self

    def add_as_json(self, val, key=None, batch_index=None) -> "Output":
        if "content-type" not in {k.lower() for k in self.properties}:
            self.properties["content-type"] = "application/json"
        return self.add(json.dumps(val, ensure_ascii=False).encode("utf-8"), key=key, batch_index=batch_index)
