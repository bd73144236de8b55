"""A loaded model's first-use costs, paid before its runner reports ready.

The first request through a freshly loaded model pays for work later ones do
not: MLX builds the CPU kernels of its compiled functions (a C++ compiler run
each, ~1 s on 2 cores, kept on disk under the temp folder: a fresh machine has
none), one for the activation of every MLP and four for a draw at a temperature,
and traces those functions for their first shapes; the CPU decode kernels run
their first parallel regions (`cpu_few_rows`'s is compiled when the model loads,
`cpu_attention`'s at its first call, here, or read from numba's disk cache).
`warm_up` sends a few tokens through the paths a request takes (decode of 1 to
`_ROWS` rows: more rows were measured to cost nothing more at first use), on
caches of its own: the prefix cache is never touched.
It runs on one thread (`cpu_threads.py`): on a busy machine, a few times faster.
"""

from exo.engine.mlx.batch import (
    ContinuousBatcher,
    GenerationFailed,
    can_batch,
)
from exo.engine.mlx.cpu_threads import one_cpu_thread
from exo.engine.mlx.generate import LocalModel, TextGenerator
from exo.engine.mlx.prefix_cache import LayerCache
from exo.shared.types.tasks import GenerationParams

# A short prompt, in any model's vocabulary, and how many tokens each reply draws.
_PROMPT = "Hello! What can you do?"
_REPLY_TOKENS = 3
_TEMPERATURE = 0.7
_TOP_P = 0.9
# Batches of 1 to this many rows. A bigger batch's first steps are no slower than
# its later ones after that (SmolLM2-135M, 2 cores: 10 and 17 rows, either decode
# mode), and each further size cost ~0.25 s of every runner's start.
_ROWS = 5


def warm_up(model: LocalModel, caches: list[LayerCache]) -> None:
    """Generate a few tokens on `model` the ways requests do: greedy in batches of
    every size up to `_ROWS` where the model's `caches` (all its layers') batch,
    one at a time where not, and drawn at a temperature. Call it after loading and
    before reporting ready (a split instance's ranks all together); it raises what
    a request would have failed with."""
    with one_cpu_thread():  # see above
        _generate(model, caches)


def _generate(model: LocalModel, caches: list[LayerCache]) -> None:
    prompt = model.tokenizer.encode(_PROMPT)
    no_eos = {token: -100.0 for token in model.tokenizer.eos_token_ids}  # every row runs its course
    # Replies of different lengths: the batch shrinks one row at a time.
    greedy = [
        GenerationParams(max_tokens=_REPLY_TOKENS + n, temperature=0, logit_bias=no_eos)
        for n in range(_ROWS)
    ]
    drawn = GenerationParams(
        max_tokens=_REPLY_TOKENS, temperature=_TEMPERATURE, top_p=_TOP_P, seed=0, logit_bias=no_eos
    )
    generator = TextGenerator(model, model.tokenizer, prefix_cache=None)
    if not can_batch(caches):
        for params in (greedy[0], drawn):
            for _ in generator.generate(prompt, params):
                pass
        return
    batcher = ContinuousBatcher.for_caches(generator, caches)
    for together in (greedy, [drawn]):
        for n, params in enumerate(together):
            batcher.add(f"warm-up-{n}", prompt, params)
        while not batcher.idle:
            for _, output in batcher.step():
                if isinstance(output, GenerationFailed):
                    raise output.error
