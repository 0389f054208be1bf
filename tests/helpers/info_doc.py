"""The documented JSON keys of ``dmabuf-interop info --json`` (docs/info.md), checked against a report."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "info.md"
PROBE_RE = re.compile(r"^(ok|unsupported \(\w+\)|unknown( \(.*\))?)$")


def _doc_keys() -> dict[str, str]:
    """``{key: type}`` from the table in docs/info.md."""
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \|", DOC.read_text(), re.M)
    return {k: t.strip() for k, t in rows}


def _type_ok(value: object, doc_type: str) -> bool:
    allowed = {"int": int, "str": str, "bool": bool, "list[str]": list, "list[object]": list, "object": dict,
               "null": type(None), "[int, int]": list, '`"unknown"`': str}
    kinds = [allowed[t.strip()] for t in doc_type.split(" or ")]
    if isinstance(value, bool) and bool not in kinds:
        return False
    return isinstance(value, tuple(kinds))


def _paths(obj: object, prefix: str = "") -> dict[str, object]:
    """Flatten to documented key paths (``gpus[].x``, ``mechanisms.<mechanism>.x``, ...)."""
    out: dict[str, object] = {}
    if prefix:
        out[prefix] = obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            k = {"mechanisms": "<mechanism>", "gpus[].attributes": "<ATTRIBUTE>",
                 "gpus[].probe_details": "<probe>", "nixl.ucx_env": "<UCX_VARIABLE>"}.get(prefix, k)
            out.update(_paths(v, f"{prefix}.{k}" if prefix else k))
    elif isinstance(obj, list) and prefix == "gpus":
        for item in obj:
            out.update(_paths(item, "gpus[]"))
        out.pop("gpus[]", None)
    return out


def check_documented(report: dict) -> None:
    """Every key of ``report`` is in docs/info.md with the documented type, and every
    documented key that applies is present."""
    doc, got = _doc_keys(), _paths(report)
    undocumented = set(got) - set(doc)
    assert not undocumented, f"keys missing from docs/info.md: {sorted(undocumented)}"
    for key, doc_type in doc.items():
        if key.startswith("gpus[]") and not report["gpus"] or "<probe>" in key or "<ATTRIBUTE>" in key \
                or "<UCX_VARIABLE>" in key:
            continue
        if key == "gpus[].probes.posix_fd_import_peer" and report["cuda"]["device_count"] < 2:
            continue
        assert key in got, f"documented key {key} missing from the JSON"
    for key, value in got.items():
        assert _type_ok(value, doc[key]), f"{key}={value!r} is not {doc[key]}"
