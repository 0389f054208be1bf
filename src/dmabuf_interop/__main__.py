"""``python -m dmabuf_interop``: the same as the ``dmabuf-interop`` command."""

from .cli import main

raise SystemExit(main())
