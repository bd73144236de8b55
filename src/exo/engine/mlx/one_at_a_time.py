"""A batch of one: `TextGenerator.generate` behind the interface of
`batch.ContinuousBatcher`, so that one serving loop serves both.

For a model whose caches have no batched form. Each `step()` advances the reply
by one output; the first step reads the whole prompt. Its progress goes out through `on_progress` as it is
read, not with the step's outputs, and `is_cancelled` is asked between chunks
and between tokens: during a long prefill that is when the caller reads its
inbox (a cancellation, or a stop, which it raises through `generate`).
"""

from collections.abc import Callable, Generator, Sequence
from typing import cast

from exo.engine.mlx.batch import BatchOutput, GenerationFailed
from exo.engine.mlx.generate import Finished, GenerationOutput, TextGenerator
from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.shared.prompt_images import PromptImage
from exo.shared.types.tasks import GenerationParams

# `TextGenerator.generate` is a generator function: `close()` ends a reply early.
Reply = Generator[GenerationOutput, None, None]


class OneAtATime:
    """Serves one request at a time through a `TextGenerator`."""

    max_batch = 1

    def __init__(
        self,
        generator: TextGenerator,
        on_progress: Callable[[str, int, int], None] = lambda task_id, done, total: None,
        is_cancelled: Callable[[str], bool] = lambda task_id: False,
    ) -> None:
        """`on_progress(task_id, done, total)` as the prompt is read;
        `is_cancelled(task_id)` between prefill chunks and between tokens."""
        self._generator = generator
        self._on_progress = on_progress
        self._is_cancelled = is_cancelled
        self._reply: tuple[str, Reply] | None = None

    @property
    def prefix_cache(self) -> KVPrefixCache | None:
        return self._generator.prefix_cache

    @property
    def idle(self) -> bool:
        return self._reply is None

    def add(
        self,
        task_id: str,
        tokens: Sequence[int],
        params: GenerationParams,
        system_prompt_length: int = 0,
        images: Sequence[PromptImage] = (),
    ) -> None:
        """Take a request while none is served; it starts in the next step, which
        reports its progress as it goes (none to report here)."""
        if self._reply is not None:
            raise RuntimeError(f"one request at a time: {self._reply[0]} is being served")
        reply = self._generator.generate(
            tokens,
            params,
            system_prompt_length,
            is_cancelled=lambda: self._is_cancelled(task_id),
            on_progress=lambda done, total: self._on_progress(task_id, done, total),
            images=images,
        )
        self._reply = (task_id, cast(Reply, reply))

    def cancel(self, task_id: str) -> bool:
        """Drop the request (its reply is not stored); whether it was here."""
        if self._reply is None or self._reply[0] != task_id:
            return False
        _, reply = self._reply
        self._reply = None
        reply.close()  # ends the request where it stands
        return True

    def step(self) -> list[tuple[str, BatchOutput]]:
        """The reply's next output (the first step reads the prompt first); a
        failure fails the request, never the next one."""
        if self._reply is None:
            return []
        task_id, reply = self._reply
        try:
            output = next(reply)
            outputs: list[tuple[str, BatchOutput]] = [(task_id, output)]
            if isinstance(output, Finished):
                # The rest of `generate` stores the reply and ends the request.
                outputs += [(task_id, rest) for rest in reply]
                self._reply = None
            return outputs
        except Exception as error:
            self._reply = None
            return [(task_id, GenerationFailed(error))]
