"""A loaded model's first-use costs, paid before its runner reports ready.

The first request through a freshly loaded model pays for work later ones do
not: MLX builds the CPU kernels of its compiled functions (a C++ compiler run
each, ~1 s on 2 cores, kept on disk under the temp folder: a fresh machine has
none), one for the activation of every MLP and four for a draw at a temperature,
and traces those functions for their first shapes; the CPU decode kernel
(`cpu_few_rows`, compiled when the model loads) runs its first parallel regions.
`warm_up` and `warm_up_shard` send a few tokens through every path a request
takes, on caches of their own: the prefix cache is never touched.
"""

import mlx.core as mx

from exo.engine.mlx.batch import ContinuousBatcher, GenerationFailed, can_batch
from exo.engine.mlx.cpu_few_rows import KERNEL_ROWS
from exo.engine.mlx.generate import LocalModel, TextGenerator
from exo.engine.mlx.sampling import SamplingStep
from exo.engine.mlx.shard import ShardModel
from exo.shared.types.tasks import GenerationParams

# A short prompt, in any model's vocabulary, and how many tokens each reply draws.
_PROMPT = "Hello! What can you do?"
_REPLY_TOKENS = 3
_TEMPERATURE = 0.7
_TOP_P = 0.9


def warm_up(model: LocalModel) -> None:
    """Generate a few tokens on `model` the ways requests do: greedy in batches of
    every size up to one past its `eager_rows` (so both decode modes run), and
    drawn at a temperature. Call it after loading and before reporting ready; it
    raises what a request would have failed with."""
    prompt = model.tokenizer.encode(_PROMPT)
    no_eos = {token: -100.0 for token in model.tokenizer.eos_token_ids}  # every row runs its course
    rows = min(model.eager_rows, KERNEL_ROWS) + 1  # a tensor rank's is unbounded
    # Replies of different lengths: the batch shrinks one row at a time.
    greedy = [
        GenerationParams(max_tokens=_REPLY_TOKENS + n, temperature=0, logit_bias=no_eos)
        for n in range(rows)
    ]
    drawn = GenerationParams(
        max_tokens=_REPLY_TOKENS, temperature=_TEMPERATURE, top_p=_TOP_P, seed=0, logit_bias=no_eos
    )
    generator = TextGenerator(model, model.tokenizer, prefix_cache=None)
    if not can_batch(model.make_cache()):
        for params in (greedy[0], drawn):
            for _ in generator.generate(prompt, params):
                pass
        return
    batcher = ContinuousBatcher(generator)
    for together in (greedy, [drawn]):
        for n, params in enumerate(together):
            batcher.add(f"warm-up-{n}", prompt, params)
        while not batcher.idle:
            for _, output in batcher.step():
                if isinstance(output, GenerationFailed):
                    raise output.error


def warm_up_shard(shard: ShardModel) -> None:
    """`warm_up` for one rank of a pipeline, on its own: a prompt then a few
    single tokens through its layers (token ids on the first rank, zeros of the
    hidden size elsewhere), and on the last rank the logits, drawn greedily and
    at a temperature. Call it after loading the shard, before reporting ready."""
    first, last = shard.layer_range.is_first, shard.layer_range.is_last
    prompt = list(range(1, 9))
    samplers = [
        SamplingStep(GenerationParams(max_tokens=_REPLY_TOKENS, temperature=0), prompt),
        SamplingStep(
            GenerationParams(
                max_tokens=_REPLY_TOKENS, temperature=_TEMPERATURE, top_p=_TOP_P, seed=0
            ),
            prompt,
        ),
    ]
    cache = shard.make_cache()
    for tokens in [prompt] + [[1]] * _REPLY_TOKENS:
        inputs = mx.array([tokens]) if first else shard.placeholder_hidden(len(tokens))
        out = shard.run(inputs, cache)
        if last:
            for sampler in samplers:
                sampler.sample(out[:, -1, :])
        else:
            mx.eval(out)
