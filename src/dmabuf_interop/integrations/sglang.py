"""SGLang custom weight loader: ``update_weights_from_tensor`` pulls the version from a channel.

Server: ``python -m sglang.launch_server ... --custom-weight-loader
dmabuf_interop.integrations.sglang.load_weights``. Trainer (``sglang.Engine`` in process, or the HTTP
route with the same fields)::

    from dmabuf_interop.weight_sync import WeightPublisher
    from dmabuf_interop.integrations.sglang import LOADER, send_version

    pub = WeightPublisher("/run/user/1000/w.sock", device=0, max_bytes=8 << 30)
    engine.begin_weight_update()  # SGLang loads weights only between begin and end
    try:
        send_version(pub, model.state_dict(), version=1, engines=tp_size,
                     update=lambda named: engine.update_weights_from_tensor(named, load_format=LOADER))
    finally:
        engine.end_weight_update()

SGLang resolves ``load_format`` with ``dynamic_import`` once it is listed in
``--custom-weight-loader`` and calls ``loader(model, named_tensors)`` on every TP rank. The request's
``named_tensors`` is one placeholder: a one-element CPU tensor whose name is ``dmabuf-interop:``
followed by JSON (``address``, ``version``, ``timeout``); no CUDA handle is serialised. Each rank's loader
connects to the trainer once (the connection is kept for later versions), receives the version, and
hands it to ``model.load_weights`` batch by batch.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any, Callable, Mapping

from .._time import deadline_after, remaining
from ..channel.rendezvous import local_address_ok
from ..errors import IncompleteVersionError, InvalidArgumentError, ProtocolError, WaitTimeoutError
from ..weight_sync import WeightPublisher, WeightReceiver

__all__ = ["LOADER", "PREFIX", "load_weights", "placeholder", "send_version"]

#: The import path to give ``--custom-weight-loader`` and ``load_format``.
LOADER = "dmabuf_interop.integrations.sglang.load_weights"
#: The placeholder's name starts with this; JSON follows.
PREFIX = "dmabuf-interop:"

#: Seconds between looks at ``update``'s answer while :func:`send_version` waits for the loaders to connect.
_ANSWER_POLL = 0.05

_receivers: dict[tuple[str, int | None], WeightReceiver] = {}
_lock = threading.Lock()


def placeholder(address: str, version: int, timeout: float = 300.0) -> list[tuple[str, Any]]:
    """The ``named_tensors`` of the request: one one-element CPU tensor named with the JSON of
    ``address``, ``version`` and ``timeout`` (seconds per batch)."""
    import torch

    name = PREFIX + json.dumps({"address": address, "version": version, "timeout": timeout})
    _parse(name)  # the loader's checks, here before anything is sent
    return [(name, torch.zeros(1, dtype=torch.uint8))]


def _parse(name: Any) -> dict[str, Any]:
    if not isinstance(name, str) or not name.startswith(PREFIX) or len(name) > 4096:
        raise ProtocolError(f"not a dmabuf-interop placeholder: {str(name)[:100]!r}")
    try:
        info = json.loads(name[len(PREFIX):])
    except ValueError as exc:
        raise ProtocolError(f"the placeholder's JSON does not parse: {exc}") from None
    if not isinstance(info, dict) or set(info) != {"address", "version", "timeout"}:
        raise ProtocolError("the placeholder needs exactly address, version and timeout")
    a, v, t = info["address"], info["version"], info["timeout"]
    if not local_address_ok(a):
        raise ProtocolError(f"a bad address in the placeholder: {a!r}")
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ProtocolError(f"a bad version in the placeholder: {v!r}")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t <= 0:
        raise ProtocolError(f"a bad timeout in the placeholder: {t!r}")
    return info


def load_weights(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom loader: ``custom_loader(model, named_tensors)``.

    Raises:
        ProtocolError: ``named_tensors`` is not exactly one placeholder.
        InvalidArgumentError: the trainer sent another version than the request named.
        IncompleteVersionError: the version stopped part-way (SGLang reports the failure to the caller).
    """
    items = list(named_tensors)
    if len(items) != 1:
        raise ProtocolError(f"the dmabuf-interop loader takes one placeholder, got {len(items)} tensors")
    info = _parse(items[0][0])
    import torch

    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    key = (info["address"], device)
    with _lock:
        rx = _receivers.get(key)
        if rx is None:
            rx = _receivers[key] = WeightReceiver(info["address"], device=device, timeout=info["timeout"])
    try:
        got = rx.load(model.load_weights, timeout=info["timeout"])
    except BaseException:
        with _lock:  # the channel may be broken: connect afresh next time
            _receivers.pop(key, None)
        rx.close()
        raise
    if got != info["version"]:
        raise InvalidArgumentError(f"the trainer sent version {got}, the request named {info['version']}")


def send_version(publisher: WeightPublisher, state: Mapping[str, Any], version: int, *,
                 update: Callable[[list[tuple[str, Any]]], Any], engines: int,
                 timeout: float | None = None) -> Any:
    """Trainer side of one version: call ``update(placeholder)`` (SGLang's ``update_weights_from_tensor``)
    in a thread, take connections until ``engines`` are connected (the TP ranks connect on their first
    version), publish ``state`` as ``version`` and return what ``update`` returned.

    Raises:
        WaitTimeoutError: the engines did not connect, or ``update`` did not return, in time.
        IncompleteVersionError: the version stopped part-way (the loaders were told).
        InvalidArgumentError: :meth:`~dmabuf_interop.weight_sync.WeightPublisher.publish` refused the state
            dict (the loaders were told), or SGLang answered ``(False, message)`` (at once when it answers
            before the loaders connect: a call outside ``begin_weight_update`` / ``end_weight_update``).
    """
    t = publisher.timeout if timeout is None else timeout
    named = placeholder(publisher.address, version, timeout=t if t is not None else 300.0)
    deadline = deadline_after(t)
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["value"] = update(named)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out["error"] = exc

    worker = threading.Thread(target=call, name="dmabuf-interop-sglang-update", daemon=True)
    worker.start()
    try:
        while publisher.engines < engines:
            if not worker.is_alive():  # SGLang answered before every loader connected: a refusal, most likely
                _raise_answer(out)
            left = remaining(deadline)
            if left is not None and left <= 0:
                raise WaitTimeoutError(f"{publisher.engines} of {engines} engines connected within {t} s")
            try:  # (in slices: an answer that comes first is seen within _ANSWER_POLL seconds)
                publisher.accept(timeout=_ANSWER_POLL if left is None else min(_ANSWER_POLL, left))
            except WaitTimeoutError:
                pass
        try:
            publisher.publish(state, version, timeout=t)
        except BaseException as exc:
            if not isinstance(exc, IncompleteVersionError):  # refused before a batch went: the loaders wait
                publisher.abort(version, f"the trainer refused the version: {type(exc).__name__}: {exc}")
            raise
    finally:
        worker.join(t)
    if worker.is_alive():
        raise WaitTimeoutError(f"update_weights_from_tensor did not return within {t} s")
    _raise_answer(out)
    return out.get("value")


def _raise_answer(out: dict[str, Any]) -> None:
    """Raise what ``update`` raised, or InvalidArgumentError for SGLang's ``(False, message)``."""
    if "error" in out:
        raise out["error"]
    value = out.get("value")
    if isinstance(value, tuple) and len(value) >= 2 and value[0] is False:  # SGLang's (success, message)
        raise InvalidArgumentError(f"SGLang refused the update: {value[1]}")
