"""dmabuf-interop: share CUDA buffers between contexts, processes and GPUs through Linux fds."""
