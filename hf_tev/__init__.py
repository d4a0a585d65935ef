"""hf_tev: lossless tree speculative decoding (DFlash + DDTree trees + Tree Exit Verification) for transformers."""

__version__ = "0.1.0"
