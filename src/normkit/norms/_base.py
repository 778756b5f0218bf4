"""What every normkit module adds to its torch.nn parent: a forward-time backend."""

from __future__ import annotations

from ._core import check_backend


class BackendMixin:
    """Adds the keyword-only ``backend`` argument and attribute to a torch.nn norm.

    The backend is read by ``forward`` every call, so it can be changed on a built
    module (``module.backend = "reference"``). It is not part of the ``state_dict``:
    checkpoints stay interchangeable with torch.nn.
    """

    def __init__(self, *args, backend: str = "auto", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.backend = check_backend(backend)

    def extra_repr(self) -> str:
        base = super().extra_repr()
        return base if self.backend == "auto" else f"{base}, backend={self.backend!r}"
