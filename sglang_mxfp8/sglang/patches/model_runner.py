"""``model_runner.*``: a failed refit from disk rolled back, and weights that arrive other than from disk
post-processed.

- ``refit_rollback``: SGLang's ``update_weights_from_disk`` sets the new model path before loading, so its rollback
  after a failed load re-reads the *bad* checkpoint, fails again and takes the scheduler down; ours rolls back to the
  checkpoint being served and answers ``success: false`` with the error naming the tensor.
- ``tensor_update_postprocess``: SGLang (0.5.10.post1 to 0.5.23) runs no post-load processing after
  ``update_weights_from_tensor`` / ``..._distributed`` / ``..._ipc`` (RL weight sync) unless the trainer calls its
  post-processing endpoint, so kernel layouts would go stale. Those calls mark the model; the next
  ``ModelRunner.forward`` (before any CUDA-graph replay) re-runs our idempotent post-processing once for all buckets
  sent since. ``update_weights_from_tensor`` has no rollback in SGLang and a load that raises takes the scheduler
  down, so an update to an MXFP8 model is checked whole before any tensor is written and refused with
  ``success: false`` naming the tensor. From 0.5.17 the weight updates live on ``WeightUpdater``; both patches follow
  them there.

Every weight update keeps torch's global state, which torch.compile guards on (:func:`..weights.torch_state_kept`).
"""

from __future__ import annotations

import functools
import logging

from ...format.checkpoint import refused_update
from ...compat import model_runner_of, sglang_object
from ..loads import LoadClock
from ..patching import replace, target
from ..weights import FROM_TENSORS, postprocess_mxfp8_modules, refit_rollback, scale_name_of, torch_state_kept

logger = logging.getLogger("sglang_mxfp8")

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
        with torch_state_kept(original.__name__):
            result = original(self, *args, **kwargs)
        model_runner_of(self)._sglang_mxfp8_pending = True
        return result

    return update


def _unwrapped(named_tensors, runner) -> list:
    """The update's tensors on this rank's device, as SGLang's own update unwraps them (taking them again is a
    no-op)."""
    import torch
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # SGLang's, before any CUDA tensor of another process is opened
    device = torch.get_device_module(runner.device).current_device()
    rank = getattr(runner, "tp_rank", 0)
    return [(name, (t.get(rank) if type(t).__name__ == "LocalSerializedTensor" else t).to(device))
            for name, t in named_tensors]


def _bucket_tensors(bucket: dict) -> list:
    """The named tensors of a ``flattened_bucket`` update, as SGLang rebuilds them: views of its one flat tensor."""
    flat = bucket["flattened_tensor"]
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in bucket["metadata"]]


def _refused_bucket(flat, named: list, scale_name: str):
    """:func:`refused_update` of a trainer's bucket; on a GPU its values in one launch (ops/value_checks.py) rather
    than a few per tensor."""
    if not flat.is_cuda:
        return refused_update(named, scale_name)
    from ... import error_line
    from ...format.checkpoint import checked_values
    from ...kernels.base import log_once
    from ...ops import value_checks

    problem = refused_update(named, scale_name, values=False)
    checked = checked_values(named, scale_name)
    if problem is not None or not value_checks.fits(flat, checked):
        return problem or refused_update(named, scale_name, structure=False)
    try:
        return value_checks.first_refused(flat, checked)
    except Exception as e:  # noqa: BLE001 - a kernel that does not build here: the checks one tensor at a time
        log_once(logging.WARNING, "sglang_mxfp8: the one-launch value check of a bucket failed "
                                  f"({error_line(e, 160)}); checking its tensors one by one")
        return refused_update(named, scale_name, structure=False)


def _checked_and_marking(original):
    """``update_weights_from_tensor``: an update to an MXFP8 model (named tensors, or a trainer's flattened bucket)
    checked whole (:func:`refused_update`) before any of it is written; refused, nothing is loaded and the previous
    weights keep serving. A load that still raises answers ``success: false`` instead of taking the scheduler down."""

    @functools.wraps(original)
    def update_weights_from_tensor(self, named_tensors, load_format=None, *args, **kwargs):
        runner = model_runner_of(self)
        scale_name = scale_name_of(runner.model)
        if scale_name is None:  # no MXFP8 layer: SGLang's update as shipped
            return original(self, named_tensors, load_format, *args, **kwargs)
        if not getattr(runner, "_sglang_mxfp8_pending", False):
            LoadClock.reset()  # an update's first call: its peak memory counts from here, not from the forwards before
        with torch_state_kept("update_weights_from_tensor"):
            if load_format in (None, "direct", "flattened_bucket") and named_tensors:
                if load_format == "flattened_bucket":  # a trainer's bucket: one flat tensor and where each lies in it
                    named = _bucket_tensors(named_tensors)
                    problem = _refused_bucket(named_tensors["flattened_tensor"], named, scale_name)
                else:
                    named = named_tensors = _unwrapped(named_tensors, runner)
                    problem = refused_update(named, scale_name)
                if problem is not None:
                    logger.error("sglang_mxfp8: update_weights_from_tensor refused: %s", problem)
                    return False, (f"Failed to update weights: {problem}. Nothing of this update was loaded; the "
                                   "previous weights keep serving.")
            try:
                result = original(self, named_tensors, load_format, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - SGLang would let it end the scheduler
                logger.error("sglang_mxfp8: update_weights_from_tensor failed while loading: %s", e)
                result = (False, f"Failed to update weights: {e}. Tensors of this update before the failing one may be "
                                 "loaded; send the whole update again.")
        runner._sglang_mxfp8_pending = True
        if result[0]:
            setattr(runner, FROM_TENSORS, True)  # what serves now is on no disk: a failed disk refit checks first
        return result

    return update_weights_from_tensor


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
    replace(updates, "update_weights_from_tensor", PATCH, _checked_and_marking)
    for name in OTHER_UPDATES[1:]:
        if hasattr(updates, name):
            replace(updates, name, f"{PATCH}.{name}", _marking)
    replace(cls, "forward", PATCH + ".forward", _postprocessing_first)
