"""Adapters that plug dmabuf-interop into other projects (torch's tensor sharing, inference engines).

Each module here imports its project lazily: importing ``dmabuf_interop.integrations`` needs none of them.
"""
