"""Weight sync: a trainer publishes versions of a named state dict; inference engines receive them.

Engine-agnostic core under the vLLM backend and the SGLang loader
(:mod:`dmabuf_interop.integrations`), built on the channel's public API
(:mod:`dmabuf_interop.channel`)::

    # trainer
    with WeightPublisher("/run/user/1000/w.sock", device=0, max_bytes=8 << 30) as pub:
        pub.accept(timeout=60)                       # one per engine (GPU, TP rank)
        pub.publish(model.state_dict(), version=1)   # every engine gets version 1

    # engine, another process
    with WeightReceiver("/run/user/1000/w.sock", device=0) as rx:
        rx.load(model.load_weights)                  # or rx.load_into(model); or `with rx.receive() as v`

A version goes as one or more ``send_many`` batches on every engine's channel,
each batch's first item carrying ``meta`` (JSON, checked on arrival):
``{"weight_sync": 1, "version": v, "batch": i, "batches": n, "keep": bool,
"dtypes": {name: torch dtype}}``. A trainer tensor in the publisher's pool is
lent as it is (zero copy); with ``lend_segments`` (default: when
``PYTORCH_CUDA_ALLOC_CONF`` asks for expandable segments) a CUDA tensor is
handed to the channel, which lends torch's pages in place; any other tensor is
copied once into the pool (staged), however many engines there are. Staging
buffers are kept from version to version when they all fit in the pool
(``keep``: the engine may hold every batch until it releases the version);
otherwise a version goes in buckets of at most half the pool's free bytes, staged
in turn in two blocks kept from version to version, each when the engines gave
the one two before it back (the pool is reused), and an engine gives batch
``i-1`` back as it takes batch ``i``.

A version that stops part-way is reported, never half-applied silently: the
trainer sends an ``abort`` batch when it fails after the first batch went out,
and the engine raises :class:`~dmabuf_interop.errors.IncompleteVersionError`
saying how many batches its loader already applied (a batch from a stale,
unfinished version is skipped at the start of the next one).

Nothing is pickled: tensors travel as the channel's JSON descriptors; dtypes
the channel has no name for (float8, and bfloat16 over host pools, which NumPy
lacks) travel as same-size integers and are viewed back on arrival from a
fixed list of torch dtype names. Peers are checked as channels check them
(``SO_PEERCRED``: the same uid unless ``allow_uids``/``allow_gids`` say more).
"""

from __future__ import annotations

from ._protocol import DTYPES, MAX_BATCH_ITEMS, MAX_BATCHES, PROTOCOL, RECV_STREAMS
from .publisher import PublishReport, WeightPublisher
from .receiver import Batch, ReceivedVersion, WeightReceiver

__all__ = ["DTYPES", "MAX_BATCHES", "MAX_BATCH_ITEMS", "PROTOCOL", "RECV_STREAMS", "Batch", "PublishReport",
           "ReceivedVersion", "WeightPublisher", "WeightReceiver"]
