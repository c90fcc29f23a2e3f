"""``sglang-mxfp8 bench``: MXFP8 against BF16 measured in the same run, as data.

Routines: ``layers`` (:mod:`.layers`), ``serve`` / ``start`` / ``refit`` / ``accuracy`` (:mod:`.served`), ``tests``
(the repository's GPU tests); suites and steps in :mod:`.run`; the row schema in :mod:`.rows`; reports generated from
rows in :mod:`.report`.
"""
