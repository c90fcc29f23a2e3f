"""The JIT modules a launch compiles while SGLang starts, in a process of their own.

``python -m sglang_mxfp8.kernels.jit_builds KERNEL [KERNEL ...]`` builds each named registry kernel's JIT module
(:meth:`~sglang_mxfp8.kernels.base.Kernel.prebuild`: CPU only, into the library's cache), all at once, and logs when
each is ready. :func:`sglang_mxfp8.sglang.launch.start_prebuilds` starts it from the launching process:

- before SGLang's own imports, so the longest build starts about when the launcher does, not after SGLang's imports
  and argument parsing;
- as a process rather than threads of the launcher, because threads would import torch and FlashInfer while SGLang's
  main thread imports them too, and would start compilers while that thread still sets environment variables;
- with no GPU visible (``CUDA_VISIBLE_DEVICES`` empty, FlashInfer's target set by ``FLASHINFER_CUDA_ARCH_LIST``), so it
  holds no CUDA context while SGLang sizes its memory pools;
- in a session of its own: when the launcher exits, it stops its compilers and exits too.

The scheduler loading a module still being built waits on FlashInfer's lock for it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import List

from .. import error_line

logger = logging.getLogger("sglang_mxfp8")
LAUNCHER_ENV = "SGLANG_MXFP8_LAUNCHER"  # the launching process's pid, in its environment and its children's


def stop_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """Wait until ``parent`` is no longer this process's parent, then end this process group: this process and the
    compilers it started (it leads the group when its launcher started it in a session of its own)."""
    while os.getppid() == parent:
        time.sleep(poll_s)
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGTERM)
    os._exit(1)


def build_all(names: List[str]) -> int:
    """Build the named kernels' JIT modules concurrently; 0 when all were built (or found in the cache), 1 when one
    failed (its warning says so; the server builds it again when it loads the model), 2 for a name not in the
    registry."""
    from . import registry

    kernels = {k.name: k for k in registry.all_kernels()}
    unknown = [name for name in names if name not in kernels]
    if unknown:
        logger.error("sglang_mxfp8: no kernel named %s in the registry (known: %s)", ", ".join(unknown),
                     ", ".join(sorted(kernels)))
        return 2
    logger.info("sglang_mxfp8: building the JIT modules of %s while SGLang starts (process %d; the server waits for "
                "one still building where it needs it)", ", ".join(names), os.getpid())
    failed: List[str] = []

    def build(name: str) -> None:
        start = time.monotonic()
        try:
            kernels[name].prebuild()
        except Exception as e:  # noqa: BLE001 - one line; the scheduler builds (and reports) it again at load
            failed.append(name)
            logger.warning("sglang_mxfp8: building %s's JIT module at launch failed (%s); the server builds it when "
                           "it loads the model", name, error_line(e, 200))
        else:
            logger.info("sglang_mxfp8: %s's JIT module ready in %.0f s (built beside the launcher)", name,
                        time.monotonic() - start)

    threads = [threading.Thread(target=build, args=(name,), name=f"build {name}") for name in dict.fromkeys(names)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 1 if failed else 0


def main(argv: List[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", stream=sys.stderr)
    launcher = int(os.environ.get(LAUNCHER_ENV) or os.getppid())  # not getppid alone: the launcher may be gone already
    threading.Thread(target=stop_with_parent, args=(launcher,), daemon=True).start()
    return build_all(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
