"""Containers whose items live outside reference counting, so workers share them without copying.

A list of millions of Python objects handed to forked workers is copied into each of them page
by page, because reading an object writes its reference count (pytorch#13246). The containers
here keep their items as bytes in one sealed, anonymous memory file that every worker maps
(the design note, docs/design/copy-on-read.md in the source repository, explains how).
"""

from pipeload.shared._convert import CopyOnReadWarning, share_containers, warn_if_copy_on_read
from pipeload.shared._mapping import SharedMapping
from pipeload.shared._sequence import SharedSequence

__all__ = ["CopyOnReadWarning", "SharedMapping", "SharedSequence", "share_containers", "warn_if_copy_on_read"]
