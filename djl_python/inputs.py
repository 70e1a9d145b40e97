"""LMI's Input: a request's properties (its headers; the model's properties in the start-up call)
and its content, a list of (key, bytes) pairs, read as bytes, text or JSON."""
from __future__ import annotations

import json


class Input:
    def __init__(self, properties: dict | None = None, content: list | None = None):
        self.properties = dict(properties or {})
        self.content: list[tuple[str | None, bytes]] = list(content or [])
        self.function_name = None

    @classmethod
    def of(cls, body: bytes, properties: dict) -> "Input":
        """One request: its body under the key `data`, as LMI's front end sends it."""
        return cls(properties, [("data", bytes(body))] if body else [])

    def __str__(self):
        return f"properties: {self.properties}" + "".join(f"\n{k}: {v!r}" for k, v in self.content)

    def is_batch(self) -> bool:
        return "batch_size" in self.properties

    def get_batch_size(self) -> int:
        return int(self.properties.get("batch_size", "1"))

    def get_batches(self) -> list["Input"]:
        """One request per Input here (the engine batches behind the handler)."""
        return [self]

    def get_function_name(self):
        return self.function_name

    def get_properties(self) -> dict:
        return self.properties

    def get_property(self, key: str):
        """A property by name, case-insensitively (headers arrive in any case)."""
        return next((v for k, v in self.properties.items() if k.lower() == key.lower()), None)

    def get_content(self) -> list:
        return self.content

    def contains_key(self, key) -> bool:
        return any(k == key for k, _ in self.content)

    def is_empty(self) -> bool:
        return not self.content

    def get_as_bytes(self, key=None):
        if not self.content:
            return None
        if key:
            for k, v in self.content:
                if k == key:
                    return v
            raise KeyError(f"requested data for key:{key} is not found!")
        return next((v for k, v in self.content if k == "data"), self.content[0][1])

    def get_as_string(self, key=None) -> str:
        return self.get_as_bytes(key=key).decode("utf-8")

    def get_as_json(self, key=None):
        return json.loads(self.get_as_string(key=key))

    def get_data(self, key=None):
        """By the content type, as LMI: JSON, text, else bytes (None when empty)."""
        ctype = self.get_property("content-type") or ""
        if ctype.startswith("application/json"):
            return self.get_as_json(key)
        if ctype.startswith("text/"):
            return self.get_as_string(key)
        return None if not self.content else self.get_as_bytes(key)
