"""The one error type of the loader: every bad file, tensor or config ends here, naming what was wrong."""
from __future__ import annotations

import os
from typing import Optional


class LoadError(Exception):
    """A checkpoint, config, GGUF or tokenizer file could not be loaded. `.path` is the file, `.tensor` the
    tensor (or config key) involved, when there is one."""

    def __init__(self, message: str, path: Optional[os.PathLike | str] = None, tensor: Optional[str] = None):
        self.path = None if path is None else str(path)
        self.tensor = tensor
        where = []
        if self.path is not None:
            where.append(f"file {self.path}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
