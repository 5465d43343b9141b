"""Tokenizers, document sources (HF datasets), packing and the resumable per-rank loader."""
