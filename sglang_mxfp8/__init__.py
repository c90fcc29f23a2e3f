"""sglang_mxfp8: serve MXFP8 checkpoints with stock SGLang on Hopper and Blackwell.

Importing this package is cheap (no torch, no sglang): the startup hook imports it in every
Python process. The SGLang integration lives in :mod:`sglang_mxfp8.plugin`.
"""

__version__ = "0.1.0"
SUPPORTED_SGLANG = "0.5.10.post1"
