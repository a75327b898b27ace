"""``torch.utils.data._utils.collate``'s path under pipeload: ``from pipeload._utils.collate
import default_collate, default_collate_fn_map, collate``.

A thin re-export of ``pipeload.collate``, for custom collate functions written against torch's
module (extending ``default_collate_fn_map``, calling ``collate(batch,
collate_fn_map=...)``). Every name is the same object as in ``pipeload.collate`` (and as
``pipeload.<name>`` where the top level has it): a type added to ``default_collate_fn_map`` here
is seen by ``pipeload.default_collate``.

Example:
    >>> import torch
    >>> from pipeload._utils.collate import collate, default_collate_fn_map
    >>> class Box:
    ...     def __init__(self, v): self.v = v
    >>> def collate_boxes(batch, *, collate_fn_map=None):
    ...     return torch.tensor([b.v for b in batch])
    >>> collate([Box(1), Box(2)], collate_fn_map={Box: collate_boxes, **default_collate_fn_map})
    tensor([1, 2])
"""

from pipeload.collate import (
    _TEXT_OR_OBJECT_DTYPE,
    _UNSUPPORTED_TYPE_MESSAGE,
    collate,
    collate_float_fn,
    collate_int_fn,
    collate_numpy_array_fn,
    collate_numpy_scalar_fn,
    collate_str_fn,
    collate_tensor_fn,
    default_collate,
    default_collate_fn_map,
    default_convert,
)

# Under torch's names: collate functions copied from torch's module raise with the first, and
# test numpy dtypes with the second.
default_collate_err_msg_format = _UNSUPPORTED_TYPE_MESSAGE
np_str_obj_array_pattern = _TEXT_OR_OBJECT_DTYPE

__all__ = [
    "collate",
    "collate_float_fn",
    "collate_int_fn",
    "collate_numpy_array_fn",
    "collate_numpy_scalar_fn",
    "collate_str_fn",
    "collate_tensor_fn",
    "default_collate",
    "default_collate_err_msg_format",
    "default_collate_fn_map",
    "default_convert",
    "np_str_obj_array_pattern",
]
