"""The ``torch_dynamo_backends`` entry point (``backend="shardc"``), which installed copies of
shardc name as ``shardc.backend:shardc_backend``: the backend itself is
:mod:`shardc.compile.backend`."""

from shardc.compile.backend import backend, shardc_backend

__all__ = ["backend", "shardc_backend"]
