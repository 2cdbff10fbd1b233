"""Stand-ins for the loader's launchers and its per-call workspace, for CPU tests of the launchers that wrap them
(`svdq_loader.ops.decode_act.ImagesLauncher`): they record what they are asked to do and touch no GPU."""
from __future__ import annotations

#: the pointer every stub workspace reports
WORKSPACE_PTR = 0x7000_0000


class StubLauncher:
    """Records each launch's argument list."""

    def __init__(self, name: str):
        self.name, self.device, self.calls = name, None, []

    def launch(self, args) -> None:
        self.calls.append(list(args))


def stub_workspaces(launcher) -> list[int]:
    """Make `launcher`'s per-call workspaces stubs at WORKSPACE_PTR; returns the list their sizes go to."""
    sizes: list[int] = []

    class Workspace:
        def __init__(self, nbytes: int):
            sizes.append(nbytes)

        def data_ptr(self) -> int:
            return WORKSPACE_PTR

    launcher._empty = Workspace
    return sizes
