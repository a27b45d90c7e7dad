"""Corpora to packed training sequences: sources and built-in text, tokenization, packing and
the readers the training and evaluation stages use."""
