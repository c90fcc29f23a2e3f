"""``model_runner.*``: a failed refit from disk rolled back, and weights that arrive other than from disk
post-processed.

- ``refit_rollback``: SGLang's ``update_weights_from_disk`` sets the new model path before loading, so its rollback
  after a failed load re-reads the *bad* checkpoint, fails again and takes the scheduler down; ours rolls back to the
  checkpoint being served and answers ``success: false`` with the error naming the tensor.
- ``tensor_update_postprocess``: SGLang (0.5.10.post1 to 0.5.23) runs no post-load processing after
  ``update_weights_from_tensor`` / ``..._distributed`` / ``..._ipc`` (RL weight sync) unless the trainer calls its
  post-processing endpoint, so kernel layouts would go stale. Those calls mark the model; the next
  ``ModelRunner.forward`` (before any CUDA-graph replay) re-runs our idempotent post-processing once for all buckets
  sent since. From 0.5.17 the weight updates live on ``WeightUpdater``; both patches follow them there.
"""

from __future__ import annotations

import functools

from ..compat import sglang_object
from ..patching import replace, target
from ..weights import model_runner_of, postprocess_mxfp8_modules, refit_rollback

PATCH = "model_runner.tensor_update_postprocess"
# the ways weights arrive other than from disk, by release
OTHER_UPDATES = ("update_weights_from_tensor", "update_weights_from_distributed", "load_weights_from_distributed",
                 "update_weights_from_ipc")


def roll_back_failed_refits() -> None:
    updates = sglang_object("weight_updates", has="update_weights_from_disk")
    replace(updates, "update_weights_from_disk", "model_runner.refit_rollback", refit_rollback)


def _marking(original):
    @functools.wraps(original)
    def update(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        model_runner_of(self)._sglang_mxfp8_pending = True
        return result

    return update


def _postprocessing_first(original):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if getattr(self, "_sglang_mxfp8_pending", False):
            self._sglang_mxfp8_pending = False
            postprocess_mxfp8_modules(self.model)
        return original(self, *args, **kwargs)

    return forward


def postprocess_tensor_updates() -> None:
    from sglang.srt.model_executor import model_runner

    cls = target(model_runner, "ModelRunner", PATCH)
    updates = sglang_object("weight_updates", has="update_weights_from_disk")
    replace(updates, "update_weights_from_tensor", PATCH, _marking)
    for name in OTHER_UPDATES[1:]:
        if hasattr(updates, name):
            replace(updates, name, f"{PATCH}.{name}", _marking)
    replace(cls, "forward", PATCH + ".forward", _postprocessing_first)
