"""The HTTP server's LoRA adapter routes (vLLM's names and bodies; no I/O beyond the adapter files).

Contract: ``cards(base, loras, created)``: ``/v1/models``' entries for the adapters (``parent``
the base model's id, ``root`` the adapter's path). ``load(body, loras)`` (``POST
/v1/load_lora_adapter``, ``{"lora_name", "lora_path"}``) reads and registers an adapter;
``unload(body, loras)`` (``POST /v1/unload_lora_adapter``, ``{"lora_name"}``) forgets one
(requests already running under it finish). Both answer a one-line text; a bad body or an
adapter that cannot be read is a 400 naming the cause, an unknown name a 404, a name already
loaded a 400. The server routes them only with ``--lora_admin`` and for admin keys.
"""

from __future__ import annotations

from typing import Any, Mapping

from serving.api.http_errors import ApiError, bad
from serving.lora import LoraRegistry


def cards(base: Mapping[str, Any], loras: LoraRegistry | None) -> list[dict[str, Any]]:
  if loras is None:
    return []
  return [{**base, "id": ref.name, "root": path, "parent": base["id"]}
          for ref, path in loras.listing()]


def _name(body: Mapping[str, Any]) -> str:
  name = body.get("lora_name")
  if not isinstance(name, str) or not name:
    raise bad("lora_name", "must be a non-empty string")
  return name


def load(body: Mapping[str, Any], loras: LoraRegistry) -> str:
  name, path = _name(body), body.get("lora_path")
  if not isinstance(path, str) or not path:
    raise bad("lora_path", "must be a non-empty string (a PEFT adapter directory)")
  try:
    loras.load(name, path)
  except KeyError as e:
    raise ApiError(400, f"The lora adapter {name!r} has already been loaded ({e.args[0]})",
                   param="lora_name") from None
  except (ValueError, FileNotFoundError, OSError) as e:
    raise bad("lora_path", str(e)) from None
  return f"Success: LoRA adapter {name!r} added successfully."


def unload(body: Mapping[str, Any], loras: LoraRegistry) -> str:
  name = _name(body)
  try:
    loras.unload(name)
  except LookupError as e:
    raise ApiError(404, str(e.args[0]), param="lora_name", code="model_not_found") from None
  return f"Success: LoRA adapter {name!r} removed successfully."
