"""Every in-place weight layout: what SGLang's loader writes (checkpoint shapes and dtypes) turned, in the same
storage or in buffers allocated once, into what a GPU's kernels read, idempotently, with reloads told apart by row
fingerprints. ``hopper``: power-of-two block scales (``hopper_triton``: the conversion's GPU kernel); ``blackwell``:
scale swizzles, the trtllm row shuffle, padding."""
