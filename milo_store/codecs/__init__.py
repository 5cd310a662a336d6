"""Codecs past the low-rank one (issue 45). Only the transform codec lives here so far, beside its
plain-PyTorch reference; it is not yet a store codec (no writer, reader or format support)."""
