"""Run a `ContinuousBatcher` until it is idle, collecting its outputs by task id."""

from exo.engine.mlx.batch import BatchOutput, ContinuousBatcher


def drain(
    batch: ContinuousBatcher,
    outputs: dict[str, list[BatchOutput]] | None = None,
    max_steps: int = 2000,
) -> dict[str, list[BatchOutput]]:
    """Step `batch` until idle; its outputs, added to `outputs` when given."""
    outputs = {} if outputs is None else outputs
    for _ in range(max_steps):
        if batch.idle:
            return outputs
        for task_id, output in batch.step():
            outputs.setdefault(task_id, []).append(output)
    raise AssertionError("the batch did not finish")
