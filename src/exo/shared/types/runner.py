"""Runner lifecycle status."""

from typing import Literal

RunnerStatus = Literal["starting", "loading", "ready", "running", "failed", "stopped"]
